"""Split-K by hand (kernels/split_k.py) and the add + RMSNorm that sums its partials (kernels/norm.py)."""

import pytest
import torch

from pcg_engine.kernels import split_k
from pcg_engine.kernels.norm import add_rms_norm_partials, add_rms_norm_partials_ref

FP32 = dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("transposed", [False, True], ids=["checkpoint-layout", "stored-transposed"])
@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("rows", [1, 3])
def test_partials_sum_to_the_projection(transposed, splits, rows, device):
    n, k = 24, 32
    w = torch.randn(n, k, device=device)
    if transposed:  # models/fuse.py's store_transposed: the [N, K] view of a [K, N] tensor
        w = w.t().contiguous().t()
    x = torch.randn(rows, k, device=device)
    parts = split_k.partials(x, w, splits)
    assert parts.shape == (splits, rows, n) and parts.dtype == torch.float32
    torch.testing.assert_close(parts.sum(0), x @ w.t(), **FP32)
    # each partial is its own slice of K
    s = k // splits
    torch.testing.assert_close(parts[1], x[:, s:2 * s] @ w[:, s:2 * s].t(), **FP32)


def test_strided_rows_and_bf16(device):
    w = torch.randn(16, 64, device=device).bfloat16()
    x = torch.randn(2, 128, device=device).bfloat16()[:, ::2]   # rows not K-contiguous
    parts = split_k.partials(x, w, 4)
    assert parts.dtype == torch.float32
    torch.testing.assert_close(parts.sum(0), x.float() @ w.float().t(), rtol=1e-3, atol=1e-3)


def test_k_not_a_multiple_of_the_splits_is_refused(device):
    with pytest.raises(ValueError, match="K = 30 is not a multiple of 4"):
        split_k.partials(torch.randn(1, 30, device=device), torch.randn(8, 30, device=device), 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits,rows,d", [(4, 1, 64), (2, 3, 100), (4, 4, 32)])
def test_add_rms_norm_partials_matches_reference(dtype, splits, rows, d, device, poison_empty):
    parts = torch.randn(splits, rows, d, device=device)
    residual = torch.randn(rows, d, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(d, device=device)).to(dtype)
    out, new_res = add_rms_norm_partials(parts, residual, w, 1e-6)
    ref_out, ref_res = add_rms_norm_partials_ref(parts, residual, w, 1e-6)
    assert out.dtype == new_res.dtype == dtype and out.shape == new_res.shape == residual.shape
    tol = FP32 if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)   # the interpreter truncates bf16
    torch.testing.assert_close(new_res, ref_res, **tol)
    torch.testing.assert_close(out, ref_out, **tol)


def test_partials_of_the_wrong_shape_or_dtype_are_refused(device):
    residual, w = torch.randn(2, 8, device=device), torch.ones(8, device=device)
    for bad in (torch.randn(2, 8, device=device), torch.randn(4, 3, 8, device=device),
                torch.randn(4, 2, 8, device=device).half()):
        with pytest.raises(ValueError, match="partials: expected"):
            add_rms_norm_partials(bad, residual, w, 1e-6)


def test_only_measured_shapes_split_and_the_switch_turns_it_off(monkeypatch):
    assert split_k.splits_for(4096, 4096) == 4 and split_k.splits_for(4096, 12288) == 4
    assert split_k.splits_for(1024, 2048) == 0
    monkeypatch.setattr(split_k, "ENABLED", False)
    assert split_k.splits_for(4096, 4096) == 0
