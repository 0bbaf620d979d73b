"""The few-token fused MoE (kernels/moe_gemv.py) against the per-expert loop, and fused_moe's choice of it.
Its GPU tests (30B-A3B shapes in bf16, CUDA-graph replay with new routing) are test_fused_moe.py's, by path."""

import pytest
import torch

from pcg_engine.kernels import fused_moe as moe, moe_gemv
from pcg_engine.kernels.fused_moe import fused_moe, fused_moe_ref
from pcg_engine.kernels.moe_gemv import GemvConfig

from test_fused_moe import FP32, routing, weights


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


def test_auto_takes_gemv_for_a_few_tokens_only(device, monkeypatch):
    """fused_moe's default path: the GEMV launches up to GEMV_MAX_ASSIGNMENTS routed pairs, the
    grouped GEMM above, and the grouped GEMM whenever its tiles are given."""
    monkeypatch.setattr(moe_gemv, "ENABLED", True)       # whatever PCG_MOE_GEMV says here
    calls = []
    real = moe_gemv.fused_moe_gemv
    monkeypatch.setattr(moe_gemv, "fused_moe_gemv", lambda *a: calls.append(a[4].shape[0]) or real(*a))
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


def test_down_launch_preloads_only_with_pdl_and_whole_slices(monkeypatch):
    """The down launch's PRELOAD (k-slices of expert rows loaded before gdc_wait): DOWN_PRELOAD
    slices with PDL, at most K's slices, none where K is not a multiple of the tile (the preloaded
    loads take no mask) or without PDL (the kernel asserts it)."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(moe_gemv, "_moe_gemv_down_kernel", Recorder())
    monkeypatch.setattr(moe_gemv, "DOWN_PRELOAD", 2)
    ids, scales = torch.zeros(4, dtype=torch.int64), torch.ones(4)

    def preload(inter, block_k, pdl_on):
        monkeypatch.setattr(moe_gemv.pdl, "launch_kwargs", lambda device: {"PDL": pdl_on})
        w2 = torch.zeros(3, 16, inter)
        moe_gemv.launch_down(torch.zeros(4, inter), w2, ids, scales, 2, GemvConfig(2, block_k, 4, 1))
        return launches[-1]["PRELOAD"]

    assert preload(768, 256, True) == 2
    assert preload(256, 256, True) == 1          # one slice is all K has
    assert preload(700, 256, True) == 0          # a ragged last slice
    assert preload(768, 256, False) == 0
    monkeypatch.setattr(moe_gemv, "DOWN_PRELOAD", 0)
    assert preload(768, 256, True) == 0
