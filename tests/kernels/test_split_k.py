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


@pytest.mark.parametrize("dtype,tiny", [(torch.bfloat16, 2.0 ** -10), (torch.float16, 2.0 ** -13)])
def test_one_partial_is_rounded_before_the_residual_add(dtype, tiny, device):
    """S = 1: the lone fp32 partial is rounded to the activation dtype, as for S > 1 (F.linear's
    output). 1 + tiny rounds to 1, so the new residual 1 + (-1) is exactly 0; unrounded it was tiny."""
    parts = torch.full((1, 2, 8), 1.0 + tiny, device=device)
    residual = torch.full((2, 8), -1.0, device=device).to(dtype)
    w = torch.ones(8, device=device, dtype=dtype)
    out, new_res = add_rms_norm_partials(parts, residual, w, 1e-6)
    ref_out, ref_res = add_rms_norm_partials_ref(parts, residual, w, 1e-6)
    assert (ref_res == 0).all() and (ref_out == 0).all()
    assert torch.equal(new_res, ref_res) and torch.equal(out, ref_out)


def test_partials_of_the_wrong_shape_or_dtype_are_refused(device):
    residual, w = torch.randn(2, 8, device=device), torch.ones(8, device=device)
    for bad in (torch.randn(2, 8, device=device), torch.randn(4, 3, 8, device=device),
                torch.randn(4, 2, 8, device=device).half(),
                torch.randn(0, 2, 8, device=device)):   # S = 0: the kernel would read partial 0 anyway
        with pytest.raises(ValueError, match="partials: expected"):
            add_rms_norm_partials(bad, residual, w, 1e-6)


def test_only_measured_shapes_split_and_the_switch_turns_it_off(monkeypatch):
    """PCG_SPLIT_K is read when a model is fused (splits_for), not at import: a value set after the
    engine was imported (the compile cache key reads it at set-up) reaches the model too."""
    assert split_k.splits_for(4096, 4096) == 4 and split_k.splits_for(4096, 12288) == 4
    assert split_k.splits_for(2048, 4096) == 4
    assert split_k.splits_for(1024, 2048) == 0
    monkeypatch.setenv("PCG_SPLIT_K", "0")
    assert split_k.splits_for(4096, 4096) == 0
    monkeypatch.setenv("PCG_SPLIT_K", "1")
    assert split_k.splits_for(4096, 4096) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 12288), (2048, 4096)], ids=["8B-o", "8B-down", "30B-A3B-o"])
@pytest.mark.parametrize("rows", [1, 4])
def test_gpu_real_shapes_bf16(n, k, rows, rel_err):
    """At Qwen3-8B's o and down and Qwen3-30B-A3B's o shapes in bf16: the bmm's partials sum to
    F.linear's output within bf16 rounding, and the partial norm matches the reference (the fp32 sum's
    order may differ from torch's, so a rounding of the residual may too: a tolerance, not equality)."""
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).t().contiguous().t()
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    parts = split_k.partials(x, w, 4)
    assert parts.dtype == torch.float32
    plain = torch.nn.functional.linear(x, w)
    assert rel_err(parts.sum(0), plain) <= 1e-2
    residual = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(n, device="cuda")).bfloat16()
    out, new_res = add_rms_norm_partials(parts, residual, nw, 1e-6)
    ref_out, ref_res = add_rms_norm_partials_ref(parts, residual, nw, 1e-6)
    assert rel_err(new_res, ref_res) <= 1e-2
    assert rel_err(out, ref_out) <= 1e-2


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_inputs(rel_err):
    n, k = 4096, 4096
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t().contiguous().t()
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
    nw = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    add_rms_norm_partials(split_k.partials(x, w, 4), residual, nw, 1e-6)   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, new_res = add_rms_norm_partials(split_k.partials(x, w, 4), residual, nw, 1e-6)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        residual.copy_(torch.randn_like(residual))
        graph.replay()
        ref_out, ref_res = add_rms_norm_partials_ref(split_k.partials(x, w, 4), residual, nw, 1e-6)
        assert rel_err(new_res, ref_res) <= 1e-2
        assert rel_err(out, ref_out) <= 1e-2

