"""The one-launch MoE routing (kernels/moe_route.py) against torch's top-k and softmax."""

import pytest
import torch

from pcg_engine.kernels.moe_route import topk_softmax, topk_softmax_ref


def check(logits, top_k):
    weights, ids = topk_softmax(logits, top_k)
    ref_w, ref_ids = topk_softmax_ref(logits, top_k)
    assert weights.shape == ids.shape == (logits.shape[0], top_k)
    assert weights.dtype == logits.dtype and ids.dtype == torch.int64
    # The k largest logits, largest first (ids may differ from torch's only between equal logits).
    assert torch.equal(logits.gather(1, ids), logits.gather(1, ref_ids))
    assert (ids.sort(1).values.diff(dim=1) > 0).all()          # k distinct experts
    torch.testing.assert_close(weights, ref_w, rtol=1e-5 if logits.dtype == torch.float32 else 1e-2, atol=1e-6)
    return weights, ids


# (T, E, k): Qwen3-30B-A3B's router (128, 8); E not a power of two; top-1; k = E; k not a power of two.
@pytest.mark.parametrize("t,e,k", [(5, 128, 8), (3, 60, 4), (4, 6, 1), (2, 8, 8), (1, 8, 2), (3, 7, 3), (2, 128, 6),
                                   (2, 5, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_softmax_matches_torch(t, e, k, dtype, device, poison_empty):
    check(torch.randn(t, e, device=device).to(dtype), k)


def test_ties_go_to_the_lower_expert_and_strided_logits(device):
    """Exact ties (bf16 logits tie often): the lower expert index first, the weights as torch's."""
    wide = torch.zeros(3, 32, device=device)
    logits = wide[:, :16]                     # rows strided
    logits[0, [3, 9, 12]] = 2.0               # a three-way tie at the top, k = 2 takes two of them
    logits[1, [5, 7]] = -1.0                  # every other logit ties at 0: the tie is at the k-th place
    logits[1, 0] = 1.0
    weights, ids = check(logits, 2)
    assert ids[0].tolist() == [3, 9]
    assert ids[1].tolist() == [0, 1]
    assert ids[2].tolist() == [0, 1]          # all equal
    torch.testing.assert_close(weights[2], torch.full((2,), 0.5, device=device))


def test_no_tokens_and_bad_arguments(device):
    weights, ids = topk_softmax(torch.randn(0, 8, device=device), 2)
    assert weights.shape == ids.shape == (0, 2)
    with pytest.raises(ValueError, match="top_k"):
        topk_softmax(torch.randn(2, 8, device=device), 9)
    with pytest.raises(ValueError, match="logits"):
        topk_softmax(torch.randn(2, 8, device=device).long(), 2)


def test_nan_first_and_minus_inf_last_each_expert_once(device):
    """As torch.topk orders them: a NaN logit is taken first (its token's weights are then NaN), and
    -inf logits last, each expert once even where k reaches into them."""
    logits = torch.randn(3, 8, device=device)
    logits[0, 5] = float("nan")
    logits[1] = float("nan")
    logits[2] = float("-inf")
    logits[2, 6] = 0.0
    weights, ids = topk_softmax(logits, 3)
    assert ids[0, 0].item() == 5 and weights[0].isnan().all()
    assert sorted(ids[1].tolist()) == [0, 1, 2] and weights[1].isnan().all()
    assert ids[2].tolist() == [6, 0, 1]
    torch.testing.assert_close(weights[2], torch.tensor([1.0, 0.0, 0.0], device=device))
    _, ref_ids = topk_softmax_ref(logits, 3)
    assert ids[0, 0] == ref_ids[0, 0] and ids[2, 0] == ref_ids[2, 0]


@pytest.mark.gpu
def test_gpu_a3b_router_in_a_cuda_graph():
    """30B-A3B's router shape in bf16, captured and replayed with new logits."""
    logits = torch.randn(16, 128, device="cuda", dtype=torch.bfloat16)
    topk_softmax(logits, 8)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = topk_softmax(logits, 8)
    for _ in range(2):
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        ref_w, ref_ids = topk_softmax_ref(logits, 8)
        assert torch.equal(logits.gather(1, ids), logits.gather(1, ref_ids))
        torch.testing.assert_close(weights, ref_w, rtol=1e-2, atol=1e-6)
