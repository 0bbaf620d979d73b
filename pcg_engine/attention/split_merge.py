"""Split-KV's merge: partial attention results of a request's key shares combined into one output.

A split launch of the attention kernels (triton_attention.py, rope_decode_attention.py) writes, per
split, the normalised partial output and its log2-sum-exp; the merge weighs each partial by
exp2(lse - max) and renormalises. Two forms:
  * `_merge_splits_kernel`: a second small kernel, one program per (token, query head), the
    splits padded to a power of two. The default everywhere (inside CUDA graphs too: on the H200
    the fused form below lost at every context measured, launch_config.GRAPH_SPLIT_DECODE_TUNING).
  * `_merge_partials`: called inside the attention kernel by the last program of each (q-block,
    kv head) to finish (`fused_merge`), which finds out through an arrival counter in a persistent
    per-device int32 buffer (`_split_counters`) and resets it to 0.
An empty split has lse -inf and weighs 0; all splits empty (seq_len 0, padding) gives zeros.
"""

import torch
import triton
import triton.language as tl

from pcg_engine.kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _merge_partials(part_out_ptr, part_lse_ptr, out_ptr, tok0, n_tok, head0, used,
                    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                    MERGE_CHUNK: tl.constexpr):
    """out rows (tok0 .. tok0+n_tok) x (head0 .. head0+GROUP) from the `used` splits that have
    keys, MERGE_CHUNK splits a load. A plain loop, small chunks: the kernel's register count is
    its largest part's, so a merge that held all partials at once would cut the occupancy of
    the main loop (an unrolled one made ptxas use 255 registers and spill; see kernel_variant).
    .cg reads them from L2, where the other programs wrote them, never from this SM's L1."""
    s = tl.arange(0, MERGE_CHUNK)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_ok = g < GROUP
    for t in range(0, n_tok):
        tok = (tok0 + t).to(tl.int64)
        m = tl.full((GROUP_PAD,), -1e30, tl.float32)
        w_sum = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
        for c in range(0, used, MERGE_CHUNK):
            ok = ((c + s) < used)[:, None] & g_ok[None, :]
            lse = tl.load(part_lse_ptr + (c + s)[:, None] * stride_ls + tok * stride_lt + head0 + g[None, :],
                          mask=ok, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(part_out_ptr + (c + s)[:, None, None] * stride_ps + tok * stride_pt
                        + (head0 + g)[None, :, None] * stride_ph + d[None, None, :],
                        mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, tl.max(lse, 0))  # stays finite: an empty split weighs exp2(-inf) = 0
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new[None, :])
            w_sum = w_sum * alpha + tl.sum(w, 0)
            acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 0)
            m = m_new
        res = acc / tl.where(w_sum > 0, w_sum, 1.0)[:, None]
        tl.store(out_ptr + tok * stride_ot + (head0 + g)[:, None] * stride_oh + d[None, :],
                 res.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits,
                         stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
                         SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # kernels/pdl.py
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(part_lse_ptr + s * stride_ls + t * stride_lt + h, mask=s < num_splits,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty -> weights 0, output 0
    w = tl.exp2(lse - m)
    o = tl.load(part_out_ptr + s[:, None] * stride_ps + t * stride_pt + h * stride_ph + d[None, :],
                mask=(s < num_splits)[:, None], other=0.0)
    w_sum = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(w_sum > 0, w_sum, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, res.to(out_ptr.dtype.element_ty))


_COUNTERS: dict = {}
_RETIRED: list = []  # outgrown counter buffers: a captured graph may still point at one


def _split_counters(device, n: int) -> torch.Tensor:
    """Arrival counters of the fused merge, one per (q-block program, kv head): zeros between
    launches (each launch's merging programs reset theirs), so one buffer per device serves every
    layer and step. Launches that share it must not overlap: one stream, as the engine runs.
    A graph capture must not be the call that first needs a larger one (allocation in capture)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf
