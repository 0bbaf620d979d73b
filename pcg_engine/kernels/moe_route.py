"""MoE routing in one launch: each token's top-k router logits and their softmax.

With norm_topk_prob (Qwen3-MoE's setting) a token's expert weights are the softmax of its k largest
router logits (models/moe.py says why that equals transformers' softmax, top-k and renormalisation).
In torch that is three kernels a layer (top-k, softmax, the cast to the activations' dtype), each
~1-2 µs at decode batch sizes and paid in every MoE layer (48 in Qwen3-30B-A3B). Here one program
a token loads its E logits, takes the largest k times (ties to the lower expert index), and
writes the k weights, softmaxed in fp32 and rounded once, and the k expert ids (int64, as
torch.topk gives them), largest first. The grid is the token count: nothing depends on the values.

Against torch.topk: where logits are exactly equal, torch does not say which expert it takes; this
takes the lower index, and the weights are the same either way. A NaN logit is taken first, as
torch does, and makes the token's weights NaN; -inf logits are taken last, each expert once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pcg_engine.kernels import pdl
from pcg_engine.kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _topk_softmax_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_l, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                         E_PAD: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # kernels/pdl.py: the logits come from the router's projection
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_PAD)
    x = tl.load(logits_ptr + t * stride_l + experts, mask=experts < E, other=0.0).to(tl.float32)
    # The selection key: NaN above everything, as torch.topk orders it. Taken experts (and the
    # padding lanes) are masked out, not overwritten with -inf, so genuine -inf logits still give
    # k distinct experts.
    key = tl.where(x != x, float("inf"), x)
    taken = experts >= E
    slots = tl.arange(0, K_PAD)
    top = tl.full((K_PAD,), float("-inf"), tl.float32)
    ids = tl.zeros((K_PAD,), tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.where(taken, float("-inf"), key), axis=0)
        pick = tl.min(tl.where(~taken & (key == best), experts, E_PAD), axis=0)
        top = tl.where(slots == j, tl.sum(tl.where(experts == pick, x, 0.0), axis=0), top)
        ids = tl.where(slots == j, pick, ids)
        taken = taken | (experts == pick)
    # top[0] is the largest: exp(top - top[0]) <= 1, and the padding slots give exp(-inf) = 0.
    p = tl.exp(top - tl.max(top, axis=0))
    w = p / tl.sum(p, axis=0)
    ok = slots < TOP_K
    tl.store(w_ptr + t * TOP_K + slots, w.to(w_ptr.dtype.element_ty), mask=ok)
    tl.store(ids_ptr + t * TOP_K + slots, ids, mask=ok)


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, top_k] in logits' dtype, ids [T, top_k] int64), largest first."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits: expected a floating-point [T, E] tensor, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k: expected 1..{e} (the number of experts), got {top_k}")
    weights = torch.empty((t, top_k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    _topk_softmax_kernel[(t,)](logits, weights, ids, e, logits.stride(0), TOP_K=top_k,
                               K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(e),
                               num_warps=1 if e <= 256 else 4, **pdl.launch_kwargs(logits.device))
    return weights, ids


def topk_softmax_ref(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch version (models/moe.py's route without kernels): top-k, softmax in fp32, cast."""
    top, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=torch.float32).to(logits.dtype), ids
