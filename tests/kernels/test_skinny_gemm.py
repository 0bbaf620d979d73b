"""The skinny GEMM against F.linear: both inner products, ragged shapes, strided rows, the dispatch."""

import pytest
import torch

from pcg_engine.kernels import skinny_gemm as sg
from pcg_engine.kernels.skinny_gemm import SkinnyConfig, skinny_gemm

FP32 = dict(rtol=1e-4, atol=1e-4)


# (M, N, K): one row; rows not a power of two; N not a multiple of the tile (wrapped weight rows,
# masked store); K not a multiple of the tile (masked K tail); the 16-row maximum.
@pytest.mark.parametrize("m,n,k", [(1, 32, 64), (3, 40, 48), (5, 17, 100), (16, 24, 32)])
@pytest.mark.parametrize("config", [SkinnyConfig(block_n=16, block_k=32, use_dot=True),
                                    SkinnyConfig(block_n=8, block_k=32, use_dot=False),
                                    SkinnyConfig(block_n=1, block_k=64, use_dot=False)],
                         ids=["dot", "sum", "sum-n1"])
def test_matches_linear(m, n, k, config, device, poison_empty):
    x = torch.randn(m, k, device=device)
    w = torch.randn(n, k, device=device)
    y = skinny_gemm(x, w, config)
    assert y.shape == (m, n) and y.dtype == x.dtype
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w), **FP32)


def test_strided_rows_and_half_precision(device):
    # x as a row-strided view (a slice of a wider activation), in half precision with fp32
    # accumulation: bf16 on the GPU; fp16 under the CPU interpreter, whose bf16 dot is not usable.
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    wide = torch.randn(4, 96, device=device, dtype=dtype)
    x = wide[:, :64]
    assert x.stride() == (96, 1)
    w = torch.randn(48, 64, device=device).to(dtype)
    ref = (x.float() @ w.float().T).to(dtype)
    for config in (SkinnyConfig(16, 32, True), SkinnyConfig(8, 32, False)):
        y = skinny_gemm(x, w, config)
        torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=2e-2)


def test_rejects_more_rows_than_the_maximum(device):
    x = torch.randn(sg.MAX_M + 1, 16, device=device)
    with pytest.raises(ValueError, match="M <= 16"):
        skinny_gemm(x, torch.randn(16, 16, device=device), SkinnyConfig(16, 16, True))


def test_row_buckets_and_dispatch(monkeypatch):
    assert [sg.row_bucket(m) for m in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    monkeypatch.setattr(sg, "TUNED", {(4, 32, 64): SkinnyConfig(16, 32, True)})
    assert sg.tuned_config(3, 32, 64) == SkinnyConfig(16, 32, True)
    assert sg.tuned_config(5, 32, 64) is None          # another row bucket: not measured
    assert sg.tuned_config(17, 32, 64) is None         # above MAX_M: never
    # On the CPU the dispatch is always F.linear, tuned shape or not.
    x, w = torch.randn(3, 64), torch.randn(32, 64)
    torch.testing.assert_close(sg.linear(x, w), torch.nn.functional.linear(x, w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 3072), (6144, 4096), (128, 2048)])
def test_gpu_real_shapes_bf16(m, n, k):
    """The sweep's kinds of tile and the TUNED one where the shape has it ((128, 2048): Qwen3-30B-A3B's
    router) against an fp32 product."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    ref = x.float() @ w.float().T
    tuned = [c for c in (sg.tuned_config(m, n, k),) if c is not None]
    for config in (SkinnyConfig(32, 256, True), SkinnyConfig(8, 512, False), SkinnyConfig(16, 512, False), *tuned):
        y = skinny_gemm(x, w, config)
        assert (y.float() - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_linear_layers_take_the_kernel_only_for_tuned_shapes(monkeypatch):
    import pcg_engine.kernels.ops  # noqa: F401  (registers torch.ops.pcg.linear)
    from pcg_engine.models.fuse import set_kernels
    from pcg_engine.models.layers import Linear, RMSNorm

    model = torch.nn.Sequential(Linear(64, 32), Linear(32, 64), RMSNorm(64, 1e-6))
    for m in model[:2]:                 # layers.Linear skips the random init (the loader fills it)
        torch.nn.init.normal_(m.weight)
    monkeypatch.setattr(sg, "TUNED", {(1, 32, 64): SkinnyConfig(16, 32, True)})
    set_kernels(model, True)
    assert [m.use_kernels for m in model] == [True, False, True]
    x = torch.randn(3, 64)
    # The op's CPU path is F.linear: same numbers as the layer without kernels.
    torch.testing.assert_close(model[0](x), torch.nn.functional.linear(x, model[0].weight))
    set_kernels(model, False)
    assert [m.use_kernels for m in model] == [False, False, False]
    monkeypatch.setattr(sg, "ENABLED", False)           # PCG_SKINNY_GEMM=0
    set_kernels(model, True)
    assert [m.use_kernels for m in model] == [False, False, True]


def test_moe_router_takes_the_kernel_for_a_tuned_shape(monkeypatch):
    """The MoE router is a layers.Linear, so a tuned router shape (Qwen3-30B-A3B's 128 x 2048) takes
    the skinny GEMM; its logits through the op equal F.linear's on the CPU."""
    import pcg_engine.kernels.ops  # noqa: F401  (registers torch.ops.pcg.linear)
    from types import SimpleNamespace
    from pcg_engine.models.fuse import set_kernels
    from pcg_engine.models.moe import SparseMoE

    config = SimpleNamespace(num_experts=16, hidden_size=64, moe_intermediate_size=8, num_experts_per_tok=2,
                             norm_topk_prob=True)
    moe = SparseMoE(config)
    torch.nn.init.normal_(moe.gate.weight)
    set_kernels(moe, True)
    assert not moe.gate.use_kernels                     # (16, 64): no measured shape
    assert sg.has_tuned(128, 2048)                      # the 30B-A3B router's entry
    monkeypatch.setattr(sg, "TUNED", {(1, 16, 64): SkinnyConfig(2, 64, False)})
    set_kernels(moe, True)
    assert moe.gate.use_kernels
    h = torch.randn(1, 64)
    torch.testing.assert_close(moe.gate(h), torch.nn.functional.linear(h, moe.gate.weight))


def test_tuned_table_is_well_formed():
    for (m, n, k), cfg in sg.TUNED.items():
        assert m == sg.row_bucket(m) <= sg.MAX_M and n > 0 and k > 0
        assert cfg.use_dot is False or cfg.block_n >= 16     # tl.dot's minimum tile


@pytest.mark.parametrize("m,k", [(1, 64), (3, 48), (5, 100)])
@pytest.mark.parametrize("config", [SkinnyConfig(16, 32, True), SkinnyConfig(4, 64, False)], ids=["dot", "sum"])
def test_gated_equals_silu_and_mul_then_linear(m, k, config, device, poison_empty):
    from pcg_engine.kernels.activation import silu_and_mul_ref
    gate_up = torch.randn(m, 2 * k, device=device) * 3
    w = torch.randn(24, k, device=device)
    y = skinny_gemm(gate_up, w, config, gated=True)
    torch.testing.assert_close(y, torch.nn.functional.linear(silu_and_mul_ref(gate_up), w), **FP32)
    with pytest.raises(ValueError, match="2K"):
        skinny_gemm(gate_up[:, :-2], w, config, gated=True)


def test_silu_mul_linear_op_falls_back_on_cpu():
    import pcg_engine.kernels.ops  # noqa: F401
    from pcg_engine.kernels.activation import silu_and_mul_ref
    gate_up, w = torch.randn(3, 64), torch.randn(16, 32)
    torch.testing.assert_close(torch.ops.pcg.silu_mul_linear(gate_up, w),
                               torch.nn.functional.linear(silu_and_mul_ref(gate_up), w), **FP32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gpu_gated_is_bitwise_the_two_kernel_path(m):
    # The fused MLP tail must not change a token: same rounding as SiLU-and-mul, then the same GEMM.
    from pcg_engine.kernels.activation import silu_and_mul
    gate_up = torch.randn(m, 2 * 3072, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16) / 3072 ** 0.5
    for config in (SkinnyConfig(2, 1024, False), SkinnyConfig(16, 256, True)):
        torch.testing.assert_close(skinny_gemm(gate_up, w, config, gated=True),
                                   skinny_gemm(silu_and_mul(gate_up), w, config), rtol=0, atol=0)


@pytest.mark.parametrize("m,k", [(1, 64), (3, 48), (6, 100)])
@pytest.mark.parametrize("config", [SkinnyConfig(16, 32, True), SkinnyConfig(4, 64, False)], ids=["dot", "sum"])
def test_norm_prologue_equals_add_rms_norm_then_linear(m, k, config, device, poison_empty):
    from pcg_engine.kernels.norm import add_rms_norm_ref
    x, residual = torch.randn(m, k, device=device), torch.randn(m, k, device=device)
    norm_weight = torch.rand(k, device=device) + 0.5
    w = torch.randn(40, k, device=device)
    residual_out = torch.empty_like(x)
    y = skinny_gemm(x, w, config, norm=(residual, norm_weight, 1e-6, residual_out))
    h, new_residual = add_rms_norm_ref(x, residual, norm_weight, 1e-6)
    torch.testing.assert_close(y, torch.nn.functional.linear(h, w), **FP32)
    torch.testing.assert_close(residual_out, new_residual, atol=0, rtol=0)   # every row, by program 0


@pytest.mark.parametrize("eps", [1e-6, 0.5])
@pytest.mark.parametrize("config", [SkinnyConfig(16, 32, True), SkinnyConfig(4, 64, False)], ids=["dot", "sum"])
def test_norm_prologue_reads_eps_and_keeps_a_zero_row_zero(eps, config, device, poison_empty):
    """Found by a test audit: with randn rows (mean square ~1) eps = 1e-6 moves nothing a tolerance
    sees. Here the rows' mean square is about eps, and row 0 (x + residual) is zero."""
    from pcg_engine.kernels.norm import add_rms_norm_ref
    scale = eps ** 0.5
    x, residual = torch.randn(3, 48, device=device) * scale, torch.randn(3, 48, device=device) * scale
    x[0], residual[0] = 0.0, 0.0
    norm_weight = torch.rand(48, device=device) + 0.5
    w = torch.randn(24, 48, device=device)
    residual_out = torch.empty_like(x)
    y = skinny_gemm(x, w, config, norm=(residual, norm_weight, eps, residual_out))
    h, new_residual = add_rms_norm_ref(x, residual, norm_weight, eps)
    torch.testing.assert_close(y, torch.nn.functional.linear(h, w), **FP32)
    torch.testing.assert_close(residual_out, new_residual, atol=0, rtol=0)
    assert (y[0] == 0).all()


def test_add_rms_norm_linear_op_falls_back_on_cpu():
    import pcg_engine.kernels.ops  # noqa: F401
    from pcg_engine.kernels.norm import add_rms_norm_ref
    x, residual, nw, w = torch.randn(3, 64), torch.randn(3, 64), torch.rand(64) + 0.5, torch.randn(16, 64)
    y, new_residual = torch.ops.pcg.add_rms_norm_linear(x, residual, nw, 1e-6, w)
    h, ref_residual = add_rms_norm_ref(x, residual, nw, 1e-6)
    torch.testing.assert_close(y, torch.nn.functional.linear(h, w), **FP32)
    torch.testing.assert_close(new_residual, ref_residual, **FP32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gpu_norm_prologue_is_bitwise_the_two_kernel_path(m):
    from pcg_engine.kernels.norm import add_rms_norm
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    nw = (torch.rand(1024, device="cuda") + 0.5).to(torch.bfloat16)
    w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16) / 32
    for config in (SkinnyConfig(4, 1024, False), SkinnyConfig(32, 128, True)):
        residual_out = torch.empty_like(x)
        y = skinny_gemm(x, w, config, norm=(residual, nw, 1e-6, residual_out))
        h, ref_residual = add_rms_norm(x, residual, nw, 1e-6)
        assert torch.equal(residual_out, ref_residual)
        # The norm's row sum may be reduced in another order than the norm kernel's: equal up to
        # an ulp of the normalised input, far below bf16 noise of the GEMM.
        torch.testing.assert_close(y, skinny_gemm(h, w, config), rtol=2e-2, atol=2e-2)


def test_prologues_fold_only_into_cuda_core_configs(monkeypatch):
    monkeypatch.setattr(sg, "TUNED", {(1, 32, 64): SkinnyConfig(4, 64, False), (2, 32, 64): SkinnyConfig(16, 32, True)})
    assert sg.prologue_config(1, 32, 64) == SkinnyConfig(4, 64, False)
    assert sg.prologue_config(2, 32, 64) is None        # tensor-core config: two kernels instead
    assert sg.tuned_config(2, 32, 64) == SkinnyConfig(16, 32, True)   # the projection alone still may


def test_preload_slices_fit_the_register_budget(monkeypatch):
    """With PDL a program preloads as many k-slices of its weight rows as fit 64 elements a thread
    (4 warps: 8,192 elements), at most four, none when K is not a multiple of the slice."""
    monkeypatch.setattr(sg, "_PRELOAD_WIDE", True)
    assert sg.preload_slices(2, 1024, 2048, 4) == 2      # Qwen3-0.6B o_proj: whole rows
    assert sg.preload_slices(2, 1024, 3072, 4) == 3      # down_proj: whole rows
    assert sg.preload_slices(4, 1024, 1024, 4) == 1      # qkv / gate_up
    assert sg.preload_slices(2, 1024, 8192, 4) == 4      # capped at the kernel's four slots
    assert sg.preload_slices(8, 1024, 4096, 4) == 1      # 8B qkv: one slice fits the budget
    assert sg.preload_slices(8, 1024, 4096, 8) == 2      # twice the threads, twice the slices
    assert sg.preload_slices(2, 1024, 3000, 4) == 0      # a masked tail: no preload
    monkeypatch.setattr(sg, "_PRELOAD_WIDE", False)      # PCG_SKINNY_PRELOAD=0: session 5's rule
    assert sg.preload_slices(2, 1024, 2048, 4) == 0 and sg.preload_slices(4, 1024, 1024, 4) == 1


def test_outputs_and_norm_weight_the_kernel_cannot_index_are_refused_or_copied(device, poison_empty):
    """skinny_gemm took `out`, the norm weight and residual_out on trust: an out of another shape
    was written out of bounds, a column-strided out or residual_out was scrambled, and a strided
    norm-weight view was read as the wrong elements, all without an error."""
    from pcg_engine.kernels.norm import add_rms_norm_ref
    config = SkinnyConfig(8, 32, False)
    x, w = torch.randn(3, 32, device=device), torch.randn(16, 32, device=device)
    # (a larger out than [M, N] here, so that the unfixed launch overruns nothing)
    for bad in (torch.zeros(4, 16, device=device), torch.zeros(16, 3, device=device).t()):
        with pytest.raises(ValueError, match="out: expected"):
            skinny_gemm(x, w, config, out=bad)
    out = torch.full((3, 20), float("nan"), device=device)[:, 2:18]   # row-strided out: fine
    assert skinny_gemm(x, w, config, out=out) is out
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w), **FP32)
    residual = torch.randn(3, 32, device=device)
    norm_weight = (torch.rand(64, device=device) + 0.5)[::2]           # a strided view: copied
    with pytest.raises(ValueError, match="residual_out"):
        skinny_gemm(x, w, config, norm=(residual, norm_weight, 1e-6, torch.zeros(32, 3, device=device).t()))
    residual_out = torch.empty_like(x)
    y = skinny_gemm(x, w, config, norm=(residual, norm_weight, 1e-6, residual_out))
    h, new_residual = add_rms_norm_ref(x, residual, norm_weight, 1e-6)
    torch.testing.assert_close(residual_out, new_residual, **FP32)
    torch.testing.assert_close(y, torch.nn.functional.linear(h, w), **FP32)
