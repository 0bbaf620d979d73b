"""RMSNorm and fused residual-add + RMSNorm against transformers' Qwen3RMSNorm semantics."""

import pytest
import torch
import triton

from pcg_engine.kernels import norm
from pcg_engine.kernels.norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref

FP32 = dict(rtol=1e-4, atol=1e-5)

# (rows, D): a single token; rows not a multiple of anything; D not a power of two; D = 8192.
SHAPES = [(1, 16), (5, 32), (3, 100), (2, 8192)]


@pytest.mark.parametrize("n,d", SHAPES)
def test_rms_norm_matches_reference(n, d, device, poison_empty):
    x, w = torch.randn(n, d, device=device) * 3, torch.randn(d, device=device)
    out = rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-6), **FP32)


@pytest.mark.parametrize("n,d", SHAPES)
def test_add_rms_norm_matches_reference(n, d, device, poison_empty):
    x, r, w = (torch.randn(n, d, device=device), torch.randn(n, d, device=device), torch.randn(d, device=device))
    out, new_res = add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_res = add_rms_norm_ref(x, r, w, 1e-5)
    torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, **FP32)


@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_eps_is_read_and_a_zero_row_stays_zero(eps, device, poison_empty):
    """Found by a test audit: randn rows have a mean square near 1, where eps = 1e-6 moves nothing a
    tolerance sees, so a kernel that dropped eps or fixed it passed every test. Here the rows' mean
    square is about eps (eps moves the result by ~30%), and row 0 is zero (0/0 without eps)."""
    scale = eps ** 0.5
    x, r = torch.randn(4, 40, device=device) * scale, torch.randn(4, 40, device=device) * scale
    x[0], r[0] = 0.0, 0.0
    w = torch.rand(40, device=device) + 0.5
    out = rms_norm(x, w, eps)
    torch.testing.assert_close(out, rms_norm_ref(x, w, eps), **FP32)
    assert (out[0] == 0).all()
    out, new_res = add_rms_norm(x, r, w, eps)
    ref_out, ref_res = add_rms_norm_ref(x, r, w, eps)
    torch.testing.assert_close(out, ref_out, **FP32)
    torch.testing.assert_close(new_res, ref_res, **FP32)
    assert (out[0] == 0).all()
    parts = torch.randn(2, 4, 40, device=device) * scale
    parts[:, 0] = 0.0
    out, new_res = norm.add_rms_norm_partials(parts, r, w, eps)
    ref_out, ref_res = norm.add_rms_norm_partials_ref(parts, r, w, eps)
    torch.testing.assert_close(out, ref_out, **FP32)
    torch.testing.assert_close(new_res, ref_res, **FP32)
    assert (out[0] == 0).all()


def test_several_rows_per_program_with_partial_last_block(device, poison_empty, monkeypatch):
    # Real batches get several rows a program only above 512 rows, too slow to interpret; force
    # the tiling on a small batch instead: 4 rows a program, 7 rows, so the last block is partial.
    monkeypatch.setattr(norm, "_launch_config", lambda n, d, partials=False: (4, triton.next_power_of_2(d), 1))
    x, r, w = torch.randn(7, 24, device=device), torch.randn(7, 24, device=device), torch.randn(24, device=device)
    out, new_res = add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_res = add_rms_norm_ref(x, r, w, 1e-6)
    torch.testing.assert_close(out, ref_out, **FP32)
    torch.testing.assert_close(new_res, ref_res, **FP32)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **FP32)


def test_bf16_rounds_like_transformers(device):
    # The residual sum and the normalised value are rounded to bf16 where transformers rounds
    # them, so on a GPU the residual is bit-exact and the output differs only where rsqrt's last
    # bit does. (Triton's CPU interpreter truncates fp32 -> bf16 instead of rounding to nearest,
    # so there only a tolerance holds.)
    x, r = torch.randn(7, 64, device=device).bfloat16(), torch.randn(7, 64, device=device).bfloat16()
    w = (1 + 0.1 * torch.randn(64, device=device)).bfloat16()
    out, new_res = add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_res = add_rms_norm_ref(x, r, w, 1e-6)
    assert new_res.dtype == out.dtype == torch.bfloat16
    torch.testing.assert_close(new_res, ref_res, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2)
    if device == "cuda":
        assert torch.equal(new_res, ref_res)
        assert (out != ref_out).float().mean() < 0.05


def test_fp32_weight_with_bf16_input_returns_input_dtype(device):
    x, w = torch.randn(3, 32, device=device).bfloat16(), torch.randn(32, device=device)
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == torch.bfloat16
    # Two bf16 roundings (normed value, then times the weight) may each land one ulp apart from the
    # reference's (the CPU interpreter truncates instead of rounding): allow 2 ulps, 2 * 2**-7
    # relative. 1e-2 was below that and failed on about 1 random input in 50.
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-6), rtol=2 * 2**-7, atol=1e-2)


def test_per_head_view_and_strided_rows(device):
    # q/k norm: [T, H, head_dim] normalised per head; x a column slice of a wider buffer.
    q, w = torch.randn(3, 4, 16, device=device), torch.randn(16, device=device)
    torch.testing.assert_close(rms_norm(q, w, 1e-6), rms_norm_ref(q, w, 1e-6), **FP32)
    wide = torch.randn(6, 96, device=device)
    x, r, w2 = wide[:, 8:40], torch.randn(6, 32, device=device), torch.randn(32, device=device)
    assert x.stride(0) == 96
    out, new_res = add_rms_norm(x, r, w2, 1e-6)
    ref_out, ref_res = add_rms_norm_ref(x, r, w2, 1e-6)
    torch.testing.assert_close(out, ref_out, **FP32)
    torch.testing.assert_close(new_res, ref_res, **FP32)


def test_empty_batch_and_bad_shapes(device):
    w = torch.randn(16, device=device)
    assert rms_norm(torch.randn(0, 16, device=device), w, 1e-6).shape == (0, 16)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(2, 8, device=device), w, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(torch.randn(2, 16, device=device), torch.randn(3, 16, device=device), w, 1e-6)
    with pytest.raises(ValueError, match="x, weight: expected floating-point"):   # was: zeros
        rms_norm(torch.ones(2, 16, dtype=torch.int32, device=device), w, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("n,d", [(1, 1024), (256, 1024), (8192, 1024), (8192, 4096), (8192, 2048),
                                 (8192 * 16, 128), (64 * 8, 128)])
def test_gpu_real_shapes_bf16(n, d, rel_err):
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(d, device="cuda")).bfloat16()
    out, new_res = add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_res = add_rms_norm_ref(x, r, w, 1e-6)
    assert torch.equal(new_res, ref_res)
    assert rel_err(out, ref_out) <= 1e-2
    assert rel_err(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)) <= 1e-2


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_inputs(rel_err):
    n, d = 64, 1024
    x, r = (torch.randn(n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(d, device="cuda", dtype=torch.bfloat16)
    add_rms_norm(x, r, w, 1e-6)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, new_res = add_rms_norm(x, r, w, 1e-6)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        r.copy_(torch.randn_like(r))
        graph.replay()
        ref_out, ref_res = add_rms_norm_ref(x, r, w, 1e-6)
        assert torch.equal(new_res, ref_res)
        assert rel_err(out, ref_out) <= 1e-2
