"""The one-launch MoE routing with its add + RMSNorm (kernels/moe_norm_route.py) against the three ops in torch."""

import pytest
import torch

from pcg_engine.kernels import moe_norm_route as mnr
from pcg_engine.kernels.moe_norm_route import RouteWorkspace, norm_route, norm_route_ref


def inputs(t, d, e, device, parts=0, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*((parts,) if parts else ()), t, d, generator=g)
    x = x.to(device) if parts else x.to(device, dtype)             # partials stay fp32
    residual = torch.randn(t, d, generator=g).to(device, dtype)
    norm_weight = (1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype)
    gate = (torch.randn(e, d, generator=g) / d ** 0.5).to(device, dtype)
    return x, residual, norm_weight, gate


def check(x, residual, norm_weight, gate, top_k, block_e, workspace=None):
    e = gate.shape[0]
    workspace = workspace or RouteWorkspace(mnr.MAX_TOKENS, e, residual.device)
    h, res, w, ids = norm_route(x, residual, norm_weight, 1e-6, gate, top_k, block_e, workspace)
    rh, rres, rw, rids = norm_route_ref(x, residual, norm_weight, 1e-6, gate, top_k)
    torch.testing.assert_close(res, rres)
    torch.testing.assert_close(h, rh, rtol=1e-5, atol=1e-5)
    assert torch.equal(ids, rids) and ids.dtype == torch.int64
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)
    assert w.dtype == residual.dtype
    assert not workspace.counts.any()                     # each token's last program zeroed its counter
    return w, ids


# (T, D, E, k, BLOCK_E, S partials): chunks dividing E or not, one chunk, D and E not powers of two,
# top-1 and k = E, the split-K partials (S = 1 and 4) and a plain x.
@pytest.mark.parametrize("t,d,e,k,block_e,parts", [(3, 48, 12, 3, 4, 0), (2, 64, 10, 2, 4, 4), (1, 40, 7, 7, 2, 0),
                                                   (4, 32, 16, 1, 16, 1), (8, 24, 9, 4, 1, 0), (1, 64, 16, 8, 2, 4)])
def test_norm_route_matches_the_three_ops(t, d, e, k, block_e, parts, device, poison_empty):
    check(*inputs(t, d, e, device, parts), k, block_e)


def test_counters_serve_repeated_launches_and_no_tokens(device):
    """One workspace across calls with fresh inputs (as the layers of a step and the steps reuse it),
    fewer tokens than before, and no token at all."""
    ws = RouteWorkspace(mnr.MAX_TOKENS, 12, device)
    for seed, t in ((1, 5), (2, 2), (3, 5)):
        check(*inputs(t, 32, 12, device, 4 if t < 4 else 0, seed=seed), 3, 4, ws)
    x, residual, nw, gate = inputs(0, 32, 12, device)
    h, res, w, ids = norm_route(x, residual, nw, 1e-6, gate, 3, 4, ws)
    assert h.shape == (0, 32) and ids.shape == (0, 3)


def test_bad_arguments_name_what_is_wrong(device):
    x, residual, nw, gate = inputs(2, 32, 12, device)
    ws = RouteWorkspace(2, 12, device)
    with pytest.raises(ValueError, match="top_k"):
        norm_route(x, residual, nw, 1e-6, gate, 13, 4, ws)
    with pytest.raises(ValueError, match="residual"):
        norm_route(x[:1], residual, nw, 1e-6, gate, 2, 4, ws)
    with pytest.raises(ValueError, match="float32"):
        norm_route(x.unsqueeze(0).half(), residual, nw, 1e-6, gate, 2, 4, ws)
    with pytest.raises(ValueError, match="workspace"):
        norm_route(*inputs(3, 32, 12, device)[:3], 1e-6, gate, 2, 4, ws)


def test_block_experts_reads_the_table_and_the_switch(monkeypatch):
    assert mnr.block_experts(128, 2048) == 2               # Qwen3-30B-A3B
    assert mnr.block_experts(64, 2048) == 0
    monkeypatch.setenv("PCG_MOE_FUSED_ROUTE", "0")
    assert mnr.block_experts(128, 2048) == 0


def router_agrees(x, residual, nw, gate, k, block_e, ws):
    """bf16 at real shapes: the normed state and residual within rounding of the reference, and the
    chosen experts the k largest of the reference logits computed from the kernel's own h, up to a
    logit's last bf16 bit (the fp32 sums over D run in another order), their weights the softmax."""
    h, res, w, ids = norm_route(x, residual, nw, 1e-6, gate, k, block_e, ws)
    rh, rres, _, _ = norm_route_ref(x, residual, nw, 1e-6, gate, k)
    assert (res.float() - rres.float()).abs().max() <= 1e-2 * rres.float().abs().max()
    assert (h.float() - rh.float()).abs().max() <= 1e-2 * rh.float().abs().max()
    logits = h.float() @ gate.float().T
    chosen = logits.gather(1, ids)
    rest = logits.scatter(1, ids, float("-inf"))
    slack = 2 ** -7 * logits.abs().amax(1, keepdim=True)
    assert (chosen.amin(1, keepdim=True) >= rest.amax(1, keepdim=True) - slack).all()
    torch.testing.assert_close(w.float(), torch.softmax(chosen, dim=-1), rtol=2e-2, atol=2e-3)
    assert not ws.counts.any()
    return h, res, w, ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t,parts", [(1, 4), (4, 4), (8, 0)])
def test_gpu_qwen3_30b_a3b_shapes_bf16(t, parts):
    ws = RouteWorkspace(mnr.MAX_TOKENS, 128, "cuda")
    for seed in range(3):
        router_agrees(*inputs(t, 2048, 128, "cuda", parts, torch.bfloat16, seed), 8, mnr.FUSED[(128, 2048)], ws)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_graph_replay_with_new_inputs():
    """Captured once, replayed with new partials, residuals and norm weights copied in: each replay
    routes its own inputs (the counters reset inside the graph)."""
    ws = RouteWorkspace(mnr.MAX_TOKENS, 128, "cuda")
    x, residual, nw, gate = inputs(2, 2048, 128, "cuda", 4, torch.bfloat16)
    norm_route(x, residual, nw, 1e-6, gate, 8, 2, ws)          # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = norm_route(x, residual, nw, 1e-6, gate, 8, 2, ws)
    for seed in (7, 8):
        nx, nres, nnw, _ = inputs(2, 2048, 128, "cuda", 4, torch.bfloat16, seed)
        x.copy_(nx), residual.copy_(nres), nw.copy_(nnw)
        graph.replay()
        h, res, w, ids = router_agrees(x, residual, nw, gate, 8, 2, RouteWorkspace(mnr.MAX_TOKENS, 128, "cuda"))
        assert torch.equal(out[0], h) and torch.equal(out[1], res) and torch.equal(out[3], ids)
        torch.testing.assert_close(out[2], w, rtol=0, atol=0)
