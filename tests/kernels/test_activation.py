"""SiLU-and-mul against the torch expression transformers' Qwen3MLP uses."""

import pytest
import torch

from pcg_engine.kernels import activation
from pcg_engine.kernels.activation import silu_and_mul, silu_and_mul_ref

FP32 = dict(rtol=1e-4, atol=1e-5)


# (rows, I): a single token; I a power of two; I not a power of two (masked lanes); I = 768,
# whose 256-wide blocks tile it exactly (three column blocks a row).
@pytest.mark.parametrize("n,width", [(1, 16), (5, 64), (3, 100), (2, 768)])
def test_matches_reference(n, width, device, poison_empty):
    x = torch.randn(n, 2 * width, device=device) * 4
    out = silu_and_mul(x)
    assert out.shape == (n, width) and out.dtype == x.dtype and out.is_contiguous()
    torch.testing.assert_close(out, silu_and_mul_ref(x), **FP32)


def test_block_choice():
    assert activation._block(3072) == 1024
    assert activation._block(768) == 256
    assert activation._block(16) == 16
    assert activation._block(100) == 128  # no power-of-two divisor >= 128: masked tail


def test_several_rows_per_program(device, poison_empty, monkeypatch):
    # Above 512 rows a program takes several rows; emulate that on 7 rows with a 16-wide block
    # over I = 40 (3 column blocks, the last one partial), 4 rows a program.
    monkeypatch.setattr(activation, "_launch_config", lambda n, width: (4, 16, 1))
    x = torch.randn(7, 80, device=device)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **FP32)


def test_strided_rows_extreme_values_and_leading_dims(device):
    wide = torch.randn(4, 100, device=device) * 30  # |x| up to ~100: exp(-x) overflows harmlessly
    x = wide[:, 10:74]
    out = silu_and_mul(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, silu_and_mul_ref(x), **FP32)
    x3 = torch.randn(2, 3, 32, device=device)
    assert silu_and_mul(x3).shape == (2, 3, 16)
    torch.testing.assert_close(silu_and_mul(x3), silu_and_mul_ref(x3), **FP32)


def test_bf16_and_bad_shapes(device):
    x = torch.randn(3, 64, device=device).bfloat16()
    out = silu_and_mul(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, silu_and_mul_ref(x), rtol=2e-2, atol=2e-2)
    assert silu_and_mul(torch.randn(0, 8, device=device)).shape == (0, 4)
    with pytest.raises(ValueError, match="x"):
        silu_and_mul(torch.randn(2, 7, device=device))
    with pytest.raises(ValueError, match="x: expected a floating-point"):   # was: zeros
        silu_and_mul(torch.ones(2, 8, dtype=torch.int32, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("n,width", [(1, 3072), (256, 3072), (8192, 3072), (8192, 12288), (2048, 768)])
def test_gpu_real_shapes_bf16(n, width, rel_err):
    x = torch.randn(n, 2 * width, device="cuda", dtype=torch.bfloat16)
    out = silu_and_mul(x)
    assert rel_err(out, silu_and_mul_ref(x.float())) <= 1e-2
    assert rel_err(out, silu_and_mul_ref(x)) <= 1e-2


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_inputs(rel_err):
    x = torch.randn(64, 2 * 3072, device="cuda", dtype=torch.bfloat16)
    silu_and_mul(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = silu_and_mul(x)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert rel_err(out, silu_and_mul_ref(x)) <= 1e-2
