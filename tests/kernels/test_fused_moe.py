"""Device-only MoE alignment and the grouped-GEMM fused MoE against the per-expert loop."""

import pytest
import torch

from pcg_engine.kernels import fused_moe as moe
from pcg_engine.kernels.fused_moe import fused_moe, fused_moe_ref, moe_align, moe_align_torch, moe_config

FP32 = dict(rtol=1e-4, atol=1e-4)


def routing(n, num_experts, top_k, device):
    # topk of a softmax: distinct experts per token, weights in (0, 1).
    return torch.topk(torch.randn(n, num_experts, device=device).softmax(-1), top_k)


def weights(num_experts, d, inter, device, dtype=torch.float32):
    w13 = torch.randn(num_experts, 2 * inter, d, device=device) / d ** 0.5
    w2 = torch.randn(num_experts, d, inter, device=device) / inter ** 0.5
    return w13.to(dtype), w2.to(dtype)


def check_alignment(topk_ids, num_experts, block_m, align=moe_align):
    sorted_ids, block_expert, num_padded = align(topk_ids, num_experts, block_m)
    flat = topk_ids.reshape(-1).cpu()
    total = flat.numel()
    ids, blocks, padded = sorted_ids.cpu().long(), block_expert.cpu().long(), int(num_padded)
    # Shapes are the worst case over routings: a function of (N, k, E, block_m) only.
    m_max = -(-(total + min(num_experts, total) * (block_m - 1)) // block_m) * block_m
    assert ids.shape == (m_max,) and blocks.shape == (m_max // block_m,) and num_padded.shape == (1,)
    assert padded % block_m == 0 and padded <= m_max
    real = ids[ids < total]
    assert sorted(real.tolist()) == list(range(total))   # every assignment exactly once
    assert (ids[padded:] == total).all()                   # idle tail is all padding
    for b in range(padded // block_m):
        rows = ids[b * block_m:(b + 1) * block_m]
        rows = rows[rows < total]
        assert len(rows) > 0                               # no empty block before num_padded
        assert (flat[rows] == blocks[b]).all()             # one expert per block
        assert rows.tolist() == sorted(rows.tolist())      # stable: token order kept
    counts = torch.bincount(flat, minlength=num_experts)
    assert padded == int(((counts + block_m - 1) // block_m * block_m).sum())
    return sorted_ids, block_expert, num_padded


@pytest.mark.parametrize("n,num_experts,top_k,block_m", [(1, 8, 2, 16), (13, 8, 3, 16), (40, 64, 8, 32),
                                                         (5, 4, 4, 16), (3, 5, 2, 16)])
def test_moe_align_groups_and_pads(n, num_experts, top_k, block_m, device):
    topk_ids = routing(n, num_experts, top_k, device).indices
    kernel = check_alignment(topk_ids, num_experts, block_m)
    torch_ops = check_alignment(topk_ids, num_experts, block_m, moe_align_torch)
    for a, b in zip(kernel, torch_ops):  # both are stable, so they agree exactly
        assert torch.equal(a, b)


def test_moe_align_all_tokens_one_expert_and_int32_ids(device):
    ids = torch.full((9, 1), 5, device=device, dtype=torch.int32)
    for align in (moe_align, moe_align_torch):
        sorted_ids, block_expert, num_padded = check_alignment(ids, 8, 4, align)
        assert int(num_padded) == 12 and block_expert[:3].tolist() == [5, 5, 5]


def test_torch_alignment_survives_ids_out_of_range(device):
    """The start-up's compile-only pass (engine/precompile.py) skips the routing kernel, so the torch
    alignment of a large batch meets whatever its id buffer held: it must not index outside its
    tensors (a device-side assert ended the start on the GPU)."""
    ids = torch.tensor([[1 << 40, -7], [3, 8]], device=device)
    sorted_ids, block_expert, num_padded = moe_align_torch(ids, 8, 4)
    assert ((block_expert >= 0) & (block_expert < 8)).all() and int(num_padded) % 4 == 0


def test_large_batches_take_the_torch_path(device, monkeypatch):
    monkeypatch.setattr(moe, "_ALIGN_KERNEL_MAX_HIST", 0)      # every batch counts as large
    n, d, inter, num_experts = 9, 16, 16, 8
    x, (w13, w2) = torch.randn(n, d, device=device), weights(num_experts, d, inter, device)
    topk_weights, topk_ids = routing(n, num_experts, 2, device)
    torch.testing.assert_close(fused_moe(x, w13, w2, topk_weights, topk_ids),
                               fused_moe_ref(x, w13, w2, topk_weights, topk_ids), **FP32)


# (N, E, k, D, I): a single token; N not a multiple of block_m with uneven K (D = 40); experts
# with no tokens (16 experts, 2 tokens); rows per expert > 16 and > 64 (block_m 32 and 64 paths).
CASES = [(1, 8, 2, 32, 16), (13, 8, 3, 40, 24), (2, 16, 2, 32, 32), (40, 4, 2, 32, 16), (140, 4, 2, 16, 16)]


@pytest.mark.parametrize("path", ["grouped", "gemv"])
@pytest.mark.parametrize("n,num_experts,top_k,d,inter", CASES)
def test_fused_moe_matches_per_expert_loop(n, num_experts, top_k, d, inter, path, device, poison_empty):
    x = torch.randn(n, d, device=device)
    w13, w2 = weights(num_experts, d, inter, device)
    topk_weights, topk_ids = routing(n, num_experts, top_k, device)
    out = fused_moe(x, w13, w2, topk_weights, topk_ids, path=path)
    assert out.shape == (n, d) and out.dtype == x.dtype
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, topk_weights, topk_ids), **FP32)


def test_config_table_picks_block_m_by_rows_per_expert():
    assert moe_config(1, 8, 128, 768, 2048, gated=True).block_m == 16
    assert moe_config(512, 8, 128, 768, 2048, gated=True).block_m == 32
    assert moe_config(2048, 8, 128, 2048, 768, gated=False).block_m == 64
    cfg = moe_config(3, 2, 8, 12, 40, gated=True)  # tiny shapes: tiles shrink to the matrix
    assert cfg.block_n == 16 and cfg.block_k == 64


def test_all_tokens_to_one_expert_top1_and_strided_x(device, poison_empty):
    n, num_experts, d, inter = 20, 4, 32, 16
    wide = torch.randn(n, 2 * d, device=device)
    x = wide[:, :d]                                   # rows strided, inner dim unit-stride
    w13, w2 = weights(num_experts, d, inter, device)
    topk_ids = torch.full((n, 1), 2, device=device, dtype=torch.int64)
    topk_weights = torch.rand(n, 1, device=device)
    torch.testing.assert_close(fused_moe(x, w13, w2, topk_weights, topk_ids),
                               fused_moe_ref(x, w13, w2, topk_weights, topk_ids), **FP32)
    # the same pair of experts for every token, top-2
    topk_ids = torch.tensor([[3, 1]], device=device).expand(n, 2).contiguous()
    topk_weights = torch.rand(n, 2, device=device)
    torch.testing.assert_close(fused_moe(x, w13, w2, topk_weights, topk_ids),
                               fused_moe_ref(x, w13, w2, topk_weights, topk_ids), **FP32)


def test_half_precision_and_bad_inputs(device):
    # fp16 here; bf16 below (under the CPU interpreter the kernel upcasts bf16 tiles) and on the GPU
    # at real shapes.
    n, num_experts, top_k, d, inter = 6, 4, 2, 32, 16
    x = torch.randn(n, d, device=device).half()
    w13, w2 = weights(num_experts, d, inter, device, torch.float16)
    topk_weights, topk_ids = routing(n, num_experts, top_k, device)
    out = fused_moe(x, w13, w2, topk_weights, topk_ids)
    assert out.dtype == torch.float16
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert fused_moe(x[:0], w13, w2, topk_weights[:0], topk_ids[:0]).shape == (0, d)
    with pytest.raises(ValueError, match="w13, w2"):
        fused_moe(x, w13.float(), w2, topk_weights, topk_ids)
    with pytest.raises(ValueError, match="topk"):
        fused_moe(x, w13, w2, topk_weights, topk_ids[:, :1])
    with pytest.raises(ValueError, match="x: expected a floating-point"):   # was: an error inside Triton
        fused_moe(x.long(), w13.long(), w2.long(), topk_weights, topk_ids)


@pytest.mark.parametrize("n,top_k", [(5, 2), (20, 1)])
def test_bfloat16_matches_the_loop(n, top_k, device, poison_empty):
    """bf16 through the fused kernel. Triton's CPU interpreter computed a bf16 tl.dot on the raw
    bits: the output was ~1e10 off (the tiny MoE model in bfloat16 with kernels=True answered the
    same token at every step); the kernel now upcasts bf16 tiles to fp32 there."""
    num_experts, d, inter = 4, 32, 16
    x = torch.randn(n, d, device=device)
    w13, w2 = weights(num_experts, d, inter, device)
    topk_weights, topk_ids = routing(n, num_experts, top_k, device)
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    out = fused_moe(x, w13, w2, topk_weights, topk_ids)
    assert out.dtype == torch.bfloat16
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2


A3B = dict(num_experts=128, d=2048, inter=768, top_k=8)  # Qwen3-30B-A3B's MoE layer


@pytest.fixture(scope="module")
def a3b_weights():
    return weights(A3B["num_experts"], A3B["d"], A3B["inter"], "cuda", torch.bfloat16)


# Both paths at few tokens (kernels/moe_gemv.py's GEMV launches and the grouped GEMM), then what
# fused_moe picks.
GPU_CASES = [(1, "grouped"), (1, "gemv"), (2, "gemv"), (4, "gemv"), (16, "auto"), (64, "auto"), (256, "auto"),
             (2048, "auto")]


@pytest.mark.gpu
@pytest.mark.parametrize("n,path", GPU_CASES)
def test_gpu_a3b_shapes_bf16(n, path, a3b_weights, rel_err):
    w13, w2 = a3b_weights
    x = torch.randn(n, A3B["d"], device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = routing(n, A3B["num_experts"], A3B["top_k"], "cuda")
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
    torch.cuda.set_sync_debug_mode("error")  # the fused path must never wait for the host
    try:
        out = fused_moe(x, w13, w2, topk_weights, topk_ids, path=path)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rel_err(out, ref) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("n,path", [(16, "grouped"), (4, "gemv")])
def test_gpu_cuda_graph_replay_with_new_routing(n, path, a3b_weights, rel_err):
    w13, w2 = a3b_weights
    x = torch.randn(n, A3B["d"], device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = routing(n, A3B["num_experts"], A3B["top_k"], "cuda")
    fused_moe(x, w13, w2, topk_weights, topk_ids, path=path)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, topk_weights, topk_ids, path=path)
    for concentrated in (False, True):
        new_w, new_ids = routing(n, A3B["num_experts"], A3B["top_k"], "cuda")
        if concentrated:  # every token on experts 0..7: a routing unlike the captured one
            new_ids = torch.arange(8, device="cuda").expand(n, 8).contiguous()
        x.copy_(torch.randn_like(x))
        topk_weights.copy_(new_w)
        topk_ids.copy_(new_ids)
        graph.replay()
        ref = fused_moe_ref(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
        assert rel_err(out, ref) <= 1e-2


def test_fused_moe_with_other_tiles_matches_the_loop(device):
    """The benchmark's tile sweep passes configs: any tiles give the same result; block_m must agree."""
    from pcg_engine.kernels.fused_moe import MoEConfig
    x = torch.randn(3, 32, device=device)
    w13, w2 = weights(6, 32, 16, device)
    topk_weights, topk_ids = routing(3, 6, 2, device)
    configs = (MoEConfig(16, 16, 16, 4, 2), MoEConfig(16, 32, 16, 4, 2))
    got = fused_moe(x, w13, w2, topk_weights, topk_ids, configs=configs)
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, topk_weights, topk_ids), **FP32)
    with pytest.raises(ValueError, match="block_m"):
        fused_moe(x, w13, w2, topk_weights, topk_ids, configs=(configs[0], MoEConfig(32, 16, 16, 4, 2)))
