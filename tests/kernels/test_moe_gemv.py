"""The few-token fused MoE (kernels/moe_gemv.py) against the per-expert loop, and fused_moe's choice of it.
Its GPU tests (30B-A3B shapes in bf16, CUDA-graph replay with new routing) are test_fused_moe.py's, by path."""

import pytest
import torch

from pcg_engine.kernels import fused_moe as moe, moe_gemv
from pcg_engine.kernels.fused_moe import fused_moe, fused_moe_ref
from pcg_engine.kernels.moe_gemv import GemvConfig
from pcg_engine.kernels.moe_route import topk_softmax

from test_fused_moe import A3B, FP32, routing, weights


def gemv(x, w13, w2, topk_weights, topk_ids, configs=None):
    return fused_moe(x, w13, w2, topk_weights, topk_ids, configs=configs, path="gemv")


# (N, E, k, D, I): top-k not a power of two (3: the slot vector is padded); odd D and I (31, 17:
# both launches' last column blocks wrap and their stores mask, both K loops mask); one expert,
# top-1; more tokens than experts.
@pytest.mark.parametrize("n,num_experts,top_k,d,inter", [(1, 8, 3, 31, 17), (4, 16, 8, 64, 48), (2, 1, 1, 32, 16),
                                                         (9, 4, 2, 40, 24)])
def test_gemv_matches_the_loop(n, num_experts, top_k, d, inter, device, poison_empty):
    x = torch.randn(n, d, device=device)
    w13, w2 = weights(num_experts, d, inter, device)
    topk_weights, topk_ids = routing(n, num_experts, top_k, device)
    out = gemv(x, w13, w2, topk_weights, topk_ids)
    assert out.shape == (n, d) and out.dtype == x.dtype
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, topk_weights, topk_ids), **FP32)


def test_gemv_shared_experts_int32_ids_and_strided_x(device, poison_empty):
    """Every token on the same two experts (their weights read once per token), int32 ids as a
    router may give, rows of x strided."""
    n, num_experts, d, inter = 5, 6, 32, 16
    x = torch.randn(n, 2 * d, device=device)[:, :d]
    w13, w2 = weights(num_experts, d, inter, device)
    topk_ids = torch.tensor([[4, 1]], device=device, dtype=torch.int32).expand(n, 2).contiguous()
    topk_weights = torch.rand(n, 2, device=device)
    torch.testing.assert_close(gemv(x, w13, w2, topk_weights, topk_ids),
                               fused_moe_ref(x, w13, w2, topk_weights, topk_ids), **FP32)


@pytest.mark.parametrize("up,down", [(GemvConfig(1, 16, 1, 1), GemvConfig(2, 16, 2, 2)),
                                     (GemvConfig(16, 64, 4, 3), GemvConfig(16, 8, 4, 3)),
                                     (GemvConfig(2, 32, 2, 2), GemvConfig(1, 64, 1, 1))])
def test_gemv_with_other_tiles_matches_the_loop(up, down, device):
    """The benchmark's sweep passes tiles (the GPU table's 2-column blocks among them): narrow and
    wide column blocks over odd D = 63 and I = 47 (the last blocks wrap), several k tiles a slot,
    and tiles wider than the matrix."""
    x = torch.randn(3, 63, device=device)
    w13, w2 = weights(8, 63, 47, device)
    topk_weights, topk_ids = routing(3, 8, 4, device)
    torch.testing.assert_close(gemv(x, w13, w2, topk_weights, topk_ids, configs=(up, down)),
                               fused_moe_ref(x, w13, w2, topk_weights, topk_ids), **FP32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_half_precision(dtype, device, poison_empty):
    n, num_experts, top_k, d, inter = 3, 8, 2, 64, 32
    x = torch.randn(n, d, device=device).to(dtype)
    w13, w2 = weights(num_experts, d, inter, device, dtype)
    topk_weights, topk_ids = routing(n, num_experts, top_k, device)
    out = gemv(x, w13, w2, topk_weights.to(dtype), topk_ids)
    assert out.dtype == dtype
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), topk_weights.to(dtype), topk_ids)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def spy(monkeypatch, name, tokens_of):
    """The token counts moe_gemv.<name> is called with (it still runs), the path on whatever
    PCG_MOE_GEMV says here."""
    monkeypatch.setattr(moe_gemv, "ENABLED", True)
    calls, real = [], getattr(moe_gemv, name)
    monkeypatch.setattr(moe_gemv, name, lambda *a: calls.append(tokens_of(a)) or real(*a))
    return calls


def test_auto_takes_gemv_for_a_few_tokens_only(device, monkeypatch):
    """fused_moe's default path: the GEMV launches up to GEMV_MAX_ASSIGNMENTS routed pairs, the
    grouped GEMM above, and the grouped GEMM whenever its tiles are given."""
    calls = spy(monkeypatch, "fused_moe_gemv", lambda a: a[4].shape[0])
    num_experts, top_k, d, inter = 8, 2, 16, 16
    w13, w2 = weights(num_experts, d, inter, device)
    limit = moe_gemv.GEMV_MAX_ASSIGNMENTS // top_k
    for n in (1, limit, limit + 1):
        x = torch.randn(n, d, device=device)
        topk_weights, topk_ids = routing(n, num_experts, top_k, device)
        torch.testing.assert_close(fused_moe(x, w13, w2, topk_weights, topk_ids),
                                   fused_moe_ref(x, w13, w2, topk_weights, topk_ids), **FP32)
    assert calls == [1, limit]
    x = torch.randn(1, d, device=device)
    topk_weights, topk_ids = routing(1, num_experts, top_k, device)
    fused_moe(x, w13, w2, topk_weights, topk_ids, configs=(moe.MoEConfig(16, 16, 16, 4, 2),) * 2)
    assert calls == [1, limit]
    with pytest.raises(ValueError, match="path"):
        fused_moe(x, w13, w2, topk_weights, topk_ids, path="loop")
    with pytest.raises(ValueError, match="configs: the GEMV path takes two GemvConfig"):
        fused_moe(x, w13, w2, topk_weights, topk_ids, configs=(moe.MoEConfig(16, 16, 16, 4, 2),) * 2, path="gemv")
    with pytest.raises(ValueError, match="configs: the grouped GEMM path takes two MoEConfig"):
        fused_moe(x, w13, w2, topk_weights, topk_ids, configs=(GemvConfig(2, 16, 4, 1),) * 2)


# ---- the routing inside the up launch (fused_moe_gemv_routed, moe_route.route_slot) -------------

def routed_up(logits, top_k, d=16, inter=8):
    """(ids, scales) as the routing up launch writes them, into poisoned buffers."""
    n, num_experts = logits.shape
    x = torch.randn(n, d, device=logits.device, dtype=logits.dtype)
    w13, _ = weights(num_experts, d, inter, logits.device, logits.dtype)
    ids = torch.full((n * top_k,), -7, dtype=torch.int64, device=logits.device)
    scales = torch.full((n * top_k,), float("nan"), dtype=logits.dtype, device=logits.device)
    up, _ = moe_gemv.gemv_configs(inter, d)
    moe_gemv.launch_up(x, w13, ids, top_k, up, routing=(logits, scales))
    return ids.view(n, top_k), scales.view(n, top_k)


# (T, E, k) as test_moe_route.py's: Qwen3-30B-A3B's router (128, 8), E not a power of two, top-1,
# k = E, k not a power of two.
@pytest.mark.parametrize("t,e,k", [(3, 128, 8), (3, 60, 4), (4, 6, 1), (2, 8, 8), (3, 7, 3), (2, 5, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_up_launch_routes_as_the_topk_kernel(t, e, k, dtype, device):
    """Every (token, slot) gets the top-k kernel's expert, and its weight within fp32 rounding
    (the two sum the slot values in their own orders)."""
    logits = torch.randn(t, e, device=device).to(dtype)
    ids, scales = routed_up(logits, k)
    ref_w, ref_ids = topk_softmax(logits, k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(scales, ref_w, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-7)


def test_up_launch_routes_ties_nan_and_minus_inf_as_the_topk_kernel(device):
    """Exact ties go to the lower expert, a NaN logit first, -inf logits last and each expert once:
    the top-k kernel's order, slot by slot."""
    logits = torch.randn(6, 16, device=device)
    logits[0, [3, 9, 12]] = 5.0           # a three-way tie at the top
    logits[1] = 0.0                       # all equal
    logits[2, 5] = float("nan")
    logits[3] = float("nan")
    logits[4] = float("-inf")
    logits[4, 6] = 0.0
    logits[5, [2, 11]] = float("inf")
    for k in (2, 3):
        ids, scales = routed_up(logits, k)
        ref_w, ref_ids = topk_softmax(logits, k)
        assert torch.equal(ids, ref_ids), (k, ids, ref_ids)
        assert torch.equal(scales.isnan(), ref_w.isnan())
        torch.testing.assert_close(scales.nan_to_num(), ref_w.nan_to_num(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n,num_experts,top_k,d,inter", [(1, 8, 3, 31, 17), (4, 16, 8, 64, 48), (2, 1, 1, 32, 16),
                                                         (9, 5, 2, 40, 24)])
def test_routed_gemv_matches_topk_then_the_loop(n, num_experts, top_k, d, inter, device, poison_empty):
    x = torch.randn(n, d, device=device)
    w13, w2 = weights(num_experts, d, inter, device)
    logits = torch.randn(n, num_experts, device=device)
    out = moe_gemv.fused_moe_gemv_routed(x, logits, w13, w2, top_k)
    topk_weights, topk_ids = topk_softmax(logits, top_k)
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, topk_weights, topk_ids), **FP32)


def test_fused_moe_routed_takes_the_routing_up_launch_for_a_few_tokens(device, monkeypatch):
    """The routed op: the routing up launch up to GEMV_MAX_ASSIGNMENTS pairs, the top-k kernel and
    fused_moe above it or with the switch off; the same numbers either way; bad logits named."""
    monkeypatch.setattr(moe_gemv, "ROUTE_IN_UP", True)
    calls = spy(monkeypatch, "fused_moe_gemv_routed", lambda a: a[0].shape[0])
    num_experts, top_k, d, inter = 8, 2, 16, 16
    w13, w2 = weights(num_experts, d, inter, device)
    limit = moe_gemv.GEMV_MAX_ASSIGNMENTS // top_k
    for n in (1, limit, limit + 1):
        x = torch.randn(n, d, device=device)
        logits = torch.randn(n, num_experts, device=device)
        ref = fused_moe_ref(x, w13, w2, *topk_softmax(logits, top_k))
        torch.testing.assert_close(moe.fused_moe_routed(x, logits, w13, w2, top_k), ref, **FP32)
    assert calls == [1, limit]
    monkeypatch.setattr(moe_gemv, "ROUTE_IN_UP", False)
    x, logits = torch.randn(1, d, device=device), torch.randn(1, num_experts, device=device)
    torch.testing.assert_close(moe.fused_moe_routed(x, logits, w13, w2, top_k),
                               fused_moe_ref(x, w13, w2, *topk_softmax(logits, top_k)), **FP32)
    assert calls == [1, limit]
    assert moe.fused_moe_routed(x[:0], logits[:0], w13, w2, top_k).shape == (0, d)
    with pytest.raises(ValueError, match=r"logits: expected floating-point \[1, 8\]"):
        moe.fused_moe_routed(x, logits[:, :4], w13, w2, top_k)
    with pytest.raises(ValueError, match="top_k"):
        moe.fused_moe_routed(x, logits, w13, w2, 9)


@pytest.fixture(scope="module")
def a3b_experts():
    return weights(A3B["num_experts"], A3B["d"], A3B["inter"], "cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 8])
def test_gpu_a3b_routed_in_a_cuda_graph(n, a3b_experts, rel_err):
    """Qwen3-30B-A3B's shapes in bf16: the routing up launch captured once, replayed with new
    logits (a routing unlike the captured one among them), against top-k then the loop in fp32."""
    w13, w2 = a3b_experts
    x = torch.randn(n, A3B["d"], device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(n, A3B["num_experts"], device="cuda", dtype=torch.bfloat16)
    moe.fused_moe_routed(x, logits, w13, w2, A3B["top_k"])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe_routed(x, logits, w13, w2, A3B["top_k"])
    for concentrated in (False, True):
        x.copy_(torch.randn_like(x))
        logits.copy_(torch.randn_like(logits))
        if concentrated:   # every token on experts 0..7
            logits[:, :8] += 20.0
        graph.replay()
        topk_weights, topk_ids = topk_softmax(logits, A3B["top_k"])
        assert (topk_ids < 8).all() == concentrated
        ref = fused_moe_ref(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
        assert rel_err(out, ref) <= 1e-2
