"""Logits processors: the in-place edits of float32 [R, V] logits that come before sampling.

Order, as in common engines: repetition / presence / frequency penalties, min_tokens masking of
EOS and stop ids, then, when any row samples at random, the warpers: temperature, min_p, top_k,
top_p, folded into one -inf mask. Each reads its per-row knobs from `SamplingTensors` and skips
whole stages by the store's host flags, never by reading a tensor value back, so the step's one
read-back of its tokens stays its only host sync.

Kept apart from `sampler.py`: these decide which tokens may be drawn and how likely they are; the
sampler decides when to run them and turns what is left into tokens and logprobs.
"""

from __future__ import annotations

import torch

from pcg_engine.engine.sampling_tensors import SamplingTensors

_NEG_INF = float("-inf")


def apply_penalties(x: torch.Tensor, t: SamplingTensors) -> None:
    """In place on float32 [R, V]: repetition (prompt + output), then frequency and presence."""
    counts = t.output_counts
    if t.any_repetition:
        # Seen tokens become less likely whatever their sign: divide positive, multiply negative.
        rep = t.repetition_penalty[:, None]
        seen = t.prompt_mask | (counts > 0)
        x.copy_(torch.where(seen, torch.where(x > 0, x / rep, x * rep), x))
    if t.any_presence_frequency:
        c = counts.to(torch.float32)
        x.sub_(t.frequency_penalty[:, None] * c + t.presence_penalty[:, None] * (c > 0))


def apply_min_tokens(x: torch.Tensor, t: SamplingTensors) -> None:
    """In place: -inf on EOS / stop ids of rows whose output is still shorter than min_tokens."""
    if not t.any_min_tokens or not t.stop_ids.shape[1]:
        return
    active = (t.num_output < t.min_tokens)[:, None] & t.stop_valid
    # scatter_add, not scatter: padded and duplicate ids then add 0 / -inf in any order.
    x.scatter_add_(1, t.stop_ids, torch.where(active, _NEG_INF, 0.0))


def apply_warpers(x: torch.Tensor, t: SamplingTensors, raw: torch.Tensor | None = None) -> None:
    """In place: temperature, then min_p, top_k, top_p, all folded into one -inf mask.

    `raw`: the logits x was copied from, when nothing but the temperature has changed x since
    (no penalties, no min_tokens). Sorting / selecting them in their own dtype (bf16 sorts in
    half the time of float32) orders the tokens exactly as x does."""
    x.div_(t.temperature[:, None])
    thr = None
    if t.any_min_p:
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p); no softmax needed.
        thr = x.amax(dim=-1, keepdim=True) + t.min_p.log()[:, None]
    if t.max_top_k or t.any_top_p:
        kp = _top_k_top_p_threshold(x if raw is None else raw, t, thr, scale=raw is not None)
        # Each stage keeps the logits above a per-row threshold, so the chain is their maximum.
        thr = kp if thr is None else torch.maximum(thr, kp)
    if thr is not None:
        x.masked_fill_(x < thr, _NEG_INF)


def _top_k_top_p_threshold(src: torch.Tensor, t: SamplingTensors, min_p_thr: torch.Tensor | None,
                           scale: bool) -> torch.Tensor:
    """[R, 1] logit below which top-k / top-p drop a token. Ties with the cut are kept, and top-p
    renormalises over what top-k (ties included) and min_p keep, as the sequential chain does."""
    partial = not t.top_p_full_sort
    if partial:
        # Every top-p row also has a top-k: its nucleus lies inside the top max_top_k logits, so a
        # partial selection replaces the full-vocab sort (Qwen's defaults, top_k=20 top_p=0.8).
        s = src.topk(t.max_top_k, dim=-1).values
    else:
        s = src.sort(dim=-1, descending=True).values
    width = s.shape[1]
    k_idx = (t.top_k.clamp(max=width) - 1)[:, None]  # top_k is V where off
    kth_src = s.gather(1, k_idx)
    outside = None
    if partial and t.any_top_p:  # tokens tied with the k-th beyond the selection are kept too
        outside = (src == kth_src).sum(-1, keepdim=True) - (s == kth_src).sum(-1, keepdim=True)
    if scale:  # the very float32 values x holds, by the same division
        s = s.float().div_(t.temperature[:, None])
    # Rows over width have top-k off (partial path only; their top_p is then 1 too).
    kth = torch.where((t.top_k > width)[:, None], _NEG_INF, s.gather(1, k_idx))
    if not t.any_top_p:
        return kth
    s.masked_fill_(s < (kth if min_p_thr is None else torch.maximum(kth, min_p_thr)), _NEG_INF)
    probs = s.softmax(dim=-1)
    top_p = t.top_p[:, None]
    if outside is not None:  # each weighs what the k-th does: scale the target mass to match
        top_p = top_p * (1 + outside * probs.gather(1, k_idx))
    cum = probs.cumsum_(dim=-1)
    # Keep token j while the mass before it is below top_p; the first is always kept.
    n = (cum[:, :-1] < top_p).sum(dim=-1, keepdim=True) + 1
    # Rounding must not trim a row whose top-p is off.
    p_thr = torch.where(t.top_p[:, None] >= 1.0, _NEG_INF, s.gather(1, n - 1))
    return torch.maximum(kth, p_thr)
