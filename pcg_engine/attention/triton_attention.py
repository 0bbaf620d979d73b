"""One Triton paged-attention kernel for a flat batch of prefill chunks and decodes mixed.

Work unit: (q-block, kv head). A q-block is up to BLOCK_Q consecutive query tokens of ONE request;
its M dimension packs those tokens times the GQA group (all query heads that share the kv head),
so each K/V tile is loaded once for the whole group: for decode the group fills the tl.dot's M
dim (padded to 16) and the kernel is a pure stream over the KV cache.

Grid: (cdiv(T, BLOCK_Q) + num_reqs + 1, Hk, num_splits). Request r's q-blocks get the virtual ids
qsl[r] // BLOCK_Q + r + j; those ranges never overlap and stay below the grid size, so a program
searches query_start_loc for its request and leaves if it has no block. The extra id range after
the last request covers rows qsl[R]..T, which are zeroed (padding rows). Decode-only steps
(max_query_len <= 1) use (num_reqs + cdiv(T, BLOCK_Q), Hk, num_splits): program r < R is request
r, no search; the rest zero the padding rows. T, num_reqs, max_query_len and the shapes decide
the grid; everything read from the device (query_start_loc, seq_lens, block_table) only decides
what a program does, so the launch is CUDA-graph safe.

Split-KV (flash-decoding): with few programs and long contexts, a third grid axis cuts each
program's key range into num_splits equal parts computed on the device from seq_len; partial
results (normalized output + log2-sum-exp) are merged by a second small kernel, or, with
fused_merge, by the last program of each (q-block, kv head) to finish: an atomic arrival counter
in a persistent per-device int32 buffer (split_merge._split_counters) that this program resets to 0, which
saves a launch and its tail; blocks with no key at all (padding) then skip partials and counter.
The kernels are graph-safe for any fixed num_splits; the caller chooses num_splits from host
values: choose_num_splits (the step's max_seq_len) for eager launches, graph_num_splits (the
bucket only, fused merge) for launches a CUDA graph holds (the backend's capturing()).

Decode launch choices (tile size, warps, pipeline stages, fused merge) are a DecodeTuning: one
module default for steps without split-KV, one for steps with it; scripts/bench_kernels.py sweeps
them per call (unified_attention's `tuning`) so that one GPU run can pick the defaults.

Compiled variants: Triton compiles one binary per distinct set of constexprs and per
specialisation class of each integer argument (equal to 1, divisible by 16, other). Every such
variant a step meets for the first time costs a JIT compile (~0.1-1 s) in the middle of serving,
so the per-step values stay out of the key: the split count is a runtime argument (only whether
the step splits, the merge kernel's power-of-two pad and the tuning are constexprs), T, num_reqs
and num_splits are not specialised, and the partial buffers' token dimension is rounded up to 16
so their strides keep one class. What is left, `kernel_variant` (launch_config.py, with the other
host-side choices), is a handful of tuples that engine/warmup.py compiles at start-up.

Contract (torch_backend.paged_attention_reference): causal within the chunk, request r's queries
are the last n of its seq_len positions; seq_len 0 -> zeros; query_start_loc[0] == 0.
"""

import math

import torch
import triton
import triton.language as tl

from pcg_engine.attention import launch_plan
from pcg_engine.attention.metadata import check_index_tensor
from pcg_engine.kernels import fast_launch, pdl, triton_interpreting
from pcg_engine.attention.split_merge import (  # noqa: F401  (re-exported: tests, rope_decode_attention)
    _COUNTERS, _merge_partials, _merge_splits_kernel, _split_counters)
from pcg_engine.kernels.pdl import gdc_launch_dependents, gdc_wait, prefetch_l2

# The launch's host-side choices live in launch_config.py; re-exported here, where callers look.
from pcg_engine.attention.launch_config import (  # noqa: F401
    DECODE_TUNING, GRAPH_SPLIT_DECODE_TUNING, MAX_GRAPH_SPLITS, MAX_SPLITS, PDL_PREFETCH_TILES, SPLIT_DECODE_TUNING,
    SPLIT_PROGRAMS_PER_SM, DecodeTuning, KernelVariant, _clamp_splits, choose_num_splits, graph_num_splits,
    host_cdiv, host_next_pow2, kernel_variant)

SEARCH_BLOCK = 128  # requests per vector load when a program looks up its request
HEAD_DIMS = (16, 32, 64, 128, 256)   # a head is one power-of-two tile (TritonAttentionBackend refuses others)
# Triton's CPU interpreter computes bf16 tl.dot on the raw bits (garbage); there, and only there,
# bf16 operands are upcast to fp32 so the CPU tests still check the kernel's logic in bf16.
_INTERPRET = triton_interpreting()


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, k_base, v_base, bt_row, q_pos, tile_lo, tile_hi, kv_end,
                  stride_blk, stride_tok, qk_scale,
                  TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                  MASKED: tl.constexpr, IEEE: tl.constexpr):
    """Online softmax over key tiles [tile_lo, tile_hi). MASKED=False only for tiles that lie
    entirely below every query position of the block and below kv_end (no compare needed)."""
    d = tl.arange(0, HEAD_DIM)
    for tile in range(tile_lo, tile_hi):
        n = tile * TILE_N + tl.arange(0, TILE_N)
        in_seq = n < kv_end
        if BLOCK_SIZE % TILE_N == 0:  # the whole tile sits in one paged block: one scalar lookup
            blk = tl.load(bt_row + (tile * TILE_N) // BLOCK_SIZE).to(tl.int64)
            tok_off = blk * stride_blk + (n % BLOCK_SIZE).to(tl.int64) * stride_tok
        else:  # several paged blocks per tile: a per-token gather of block ids (L1-resident)
            if MASKED:
                blk = tl.load(bt_row + n // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
            else:
                blk = tl.load(bt_row + n // BLOCK_SIZE).to(tl.int64)
            tok_off = blk * stride_blk + (n % BLOCK_SIZE).to(tl.int64) * stride_tok
        if MASKED:
            k = tl.load(k_base + tok_off[None, :] + d[:, None], mask=in_seq[None, :], other=0.0)
            v = tl.load(v_base + tok_off[:, None] + d[None, :], mask=in_seq[:, None], other=0.0)
        else:
            k = tl.load(k_base + tok_off[None, :] + d[:, None])  # [D, TILE_N]
            v = tl.load(v_base + tok_off[:, None] + d[None, :])  # [TILE_N, D]
        k = k.to(q.dtype)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * qk_scale
        if MASKED:
            s = tl.where((n[None, :] <= q_pos[:, None]) & in_seq[None, :], s, float("-inf"))
        # m_i starts finite (-1e30), so a fully masked row gives p = exp2(-inf) = 0, never NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


# Per-step integers: specialising on them would buy nothing (they bound loops and masks) and would
# multiply the compiled variants by three each (see the module docstring).
@triton.jit(do_not_specialize=["num_tokens", "num_reqs", "num_splits"])
def _unified_attention_kernel(
    q_ptr, cache_ptr, out_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
    num_tokens, num_reqs, num_splits, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_blk, stride_c_tok, stride_c_h, stride_bt,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr, SEARCH: tl.constexpr,
    DECODE: tl.constexpr, FUSED_MERGE: tl.constexpr, MERGE_CHUNK: tl.constexpr, PDL: tl.constexpr,
    PREFETCH_TILES: tl.constexpr = 0, PREFETCH_LINES: tl.constexpr = 1,
):
    # PDL (kernels/pdl.py): this kernel waits below the metadata reads, then lets the next launch.
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    if DECODE:
        # Every request has at most one query (<= BLOCK_Q): program pid < R is request pid, the
        # rest cover the padding rows after the last request. No search, so the loads of q,
        # seq_len and the block table do not wait on one another.
        r = tl.minimum(pid, num_reqs)
    else:
        # r = the largest request in [0, num_reqs] whose first virtual q-block id
        # qsl[r] // BLOCK_Q + r is <= pid. Those ids strictly increase with r, so r + 1 = how
        # many of them are <= pid: a vector load and a count (one memory round trip for up to
        # SEARCH requests), not a chain of log2(R) dependent loads as a binary search would be.
        count = num_reqs * 0
        for c in range(0, num_reqs + 1, SEARCH):
            idx = c + tl.arange(0, SEARCH)
            first = tl.load(qsl_ptr + idx, mask=idx <= num_reqs, other=0) // BLOCK_Q + idx
            count += tl.sum(((first <= pid) & (idx <= num_reqs)).to(tl.int32), 0)
        r = count - 1
    is_req = r < num_reqs  # r == num_reqs: the padding rows after the last request
    q_begin = tl.load(qsl_ptr + r)
    q_end = tl.where(is_req, tl.load(qsl_ptr + tl.minimum(r + 1, num_reqs)), num_tokens)
    seq_len = tl.where(is_req, tl.load(seq_lens_ptr + tl.minimum(r, num_reqs - 1)), 0)
    q_len = q_end - q_begin
    if DECODE:
        j = tl.maximum(pid - num_reqs, 0)
    else:
        j = pid - (q_begin // BLOCK_Q + r)

    # Causal key range of the block, and the prefix below its first query that needs no mask.
    context = seq_len - q_len  # KV positions before this chunk
    kv_end = tl.maximum(tl.minimum(seq_len, context + tl.minimum(q_len, (j + 1) * BLOCK_Q)), 0)
    full_end = tl.maximum(tl.minimum(context + j * BLOCK_Q + 1, kv_end), 0)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    num_full = full_end // TILE_N
    if SPLIT:  # num_splits equal shares of this request's tiles, decided on the device
        per = tl.cdiv(num_tiles, num_splits)
        t_lo = split * per
        t_hi = tl.minimum(t_lo + per, num_tiles)
    else:
        t_lo = 0
        t_hi = num_tiles
    k_base = cache_ptr + kvh * stride_c_h
    v_base = k_base + stride_c_kv
    bt_row = bt_ptr + tl.minimum(r, num_reqs - 1).to(tl.int64) * stride_bt
    if PDL:
        # Everything above is metadata (kernels/pdl.py). Before waiting for q and this step's KV
        # slot, ask L2 for the first K/V tiles of the share: their block ids are metadata, and the
        # lines are re-read after the wait, so the one the wait protects is never used stale.
        if PREFETCH_TILES > 0:
            lines = tl.arange(0, PREFETCH_LINES) * (HEAD_DIM // PREFETCH_LINES)
            for tile in range(t_lo, tl.minimum(t_hi, t_lo + PREFETCH_TILES)):
                n = tile * TILE_N + tl.arange(0, TILE_N)
                blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n < kv_end, other=0).to(tl.int64)
                rows = blk * stride_c_blk + (n % BLOCK_SIZE).to(tl.int64) * stride_c_tok
                prefetch_l2(k_base + rows[:, None] + lines[None, :])
                prefetch_l2(v_base + rows[:, None] + lines[None, :])
        gdc_wait()   # every program, before any exit (kernels/pdl.py)
        gdc_launch_dependents()
    if DECODE and FUSED_MERGE:
        if pid >= num_reqs and split > 0:
            return  # padding rows have no keys: split 0 alone zeroes them
    if j * BLOCK_Q >= q_len:
        return

    # Rows: BLOCK_Q tokens x GROUP_PAD heads of this kv head.
    offs_m = tl.arange(0, BLOCK_M)
    tok_local = j * BLOCK_Q + offs_m // GROUP_PAD
    head = kvh * GROUP + offs_m % GROUP_PAD
    row_ok = (tok_local < q_len) & (offs_m % GROUP_PAD < GROUP)
    tok = (q_begin + tok_local).to(tl.int64)
    q_pos = context + tok_local
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if IEEE:
        q = q.to(tl.float32)

    if FUSED_MERGE:
        if kv_end == 0:  # no key for any row (padding, seq_len 0): zeros, no partials, no counter
            if split == 0:
                dst = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
                tl.store(dst, tl.zeros((BLOCK_M, HEAD_DIM), out_ptr.dtype.element_ty), mask=row_ok[:, None])
            return

    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    m_i = tl.full((BLOCK_M,), -1e30, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_base, v_base, bt_row, q_pos,
                                  t_lo, tl.minimum(t_hi, num_full), kv_end,
                                  stride_c_blk, stride_c_tok, qk_scale,
                                  TILE_N, BLOCK_SIZE, HEAD_DIM, False, IEEE)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_base, v_base, bt_row, q_pos,
                                  tl.maximum(t_lo, num_full), t_hi, kv_end,
                                  stride_c_blk, stride_c_tok, qk_scale,
                                  TILE_N, BLOCK_SIZE, HEAD_DIM, True, IEEE)

    # l == 0: no key at all (seq_len 0, padding rows, an empty split) -> zeros, not 0/0.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        if FUSED_MERGE:  # the merging program reads only the splits that have keys
            keep = row_ok & (t_lo + offs_m * 0 < t_hi)  # (a vector compare: the interpreter wants one)
        else:  # the merge kernel reads every split
            keep = row_ok
        prow = split * stride_ps + tok * stride_pt + head * stride_ph
        tl.store(part_out_ptr + prow[:, None] + d[None, :], o, mask=keep[:, None])
        tl.store(part_lse_ptr + split * stride_ls + tok * stride_lt + head, lse, mask=keep)
        if FUSED_MERGE:
            # The last of the num_splits programs of this (q-block, kv head) to arrive merges.
            # The barrier orders every thread's partial stores before the one-thread release
            # (the pattern CUTLASS's semaphores use); acq_rel makes them visible to that last
            # program. It resets the counter, so the buffer is all zeros again after the launch.
            tl.debug_barrier()
            cnt = counter_ptr + pid * tl.num_programs(1) + kvh
            if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
                per_split = tl.cdiv(num_tiles, num_splits)
                _merge_partials(part_out_ptr, part_lse_ptr, out_ptr, q_begin + j * BLOCK_Q,
                                tl.minimum(q_len - j * BLOCK_Q, BLOCK_Q), kvh * GROUP,
                                tl.cdiv(num_tiles, per_split),
                                stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
                                GROUP, GROUP_PAD, HEAD_DIM, MERGE_CHUNK)
    else:
        dst = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def unified_attention(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                      num_reqs: int, max_query_len: int, scale: float, num_splits: int = 1, *,
                      tuning: DecodeTuning | None = None) -> None:
    """q, out [T, Hq, D] (last dim contiguous); kv_cache [2, NB, BS, Hk, D]; query_start_loc [>=R+1],
    seq_lens [>=R], block_table [>=R, W] int32 on the device. Writes every row of out.

    A call with the same host values, shapes, strides and dtypes as an earlier one re-issues that
    call's recorded launches with this call's addresses (launch_plan.py); the first goes through
    the JIT and records them. Same kernels, grids and arguments either way."""
    if fast_launch.ENABLED and num_reqs > 0:
        ptrs = (q.data_ptr(), kv_cache.data_ptr(), out.data_ptr(), query_start_loc.data_ptr(),
                seq_lens.data_ptr(), block_table.data_ptr())
        # The JIT specialises pointers on 16-byte alignment: plans serve the aligned case only.
        if not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4] | ptrs[5]) & 15:
            key = launch_plan.plan_key(q, kv_cache, out, query_start_loc, seq_lens, block_table, num_reqs,
                                       max_query_len, scale, num_splits, tuning, SEARCH_BLOCK)
            plan = launch_plan.PLANS.get(key)
            if plan is not None:
                if plan(*ptrs):
                    return
            else:
                plan = _launch(q, kv_cache, out, query_start_loc, seq_lens, block_table, num_reqs, max_query_len,
                               scale, num_splits, tuning, record=True)
                if plan is not None:
                    launch_plan.PLANS.put(key, plan)
                return
    _launch(q, kv_cache, out, query_start_loc, seq_lens, block_table, num_reqs, max_query_len, scale,
            num_splits, tuning)


def cached_plan(q, kv_cache, out, query_start_loc, seq_lens, block_table, num_reqs: int, max_query_len: int,
                scale: float, num_splits: int = 1, tuning: DecodeTuning | None = None):
    """The recorded plan that unified_attention would re-issue for these arguments (addresses
    aside), or None: none recorded yet, or a call the plans do not serve. For callers that launch
    one plan for several layers (the backend's layer_calls, for replay programs: the plan's
    for_layers binds it to their addresses)."""
    if not fast_launch.ENABLED or num_reqs <= 0:
        return None
    return launch_plan.PLANS.get(launch_plan.plan_key(q, kv_cache, out, query_start_loc, seq_lens, block_table,
                                                      num_reqs, max_query_len, scale, num_splits, tuning,
                                                      SEARCH_BLOCK))


def _launch(q, kv_cache, out, query_start_loc, seq_lens, block_table, num_reqs, max_query_len, scale,
            num_splits, tuning, record: bool = False):
    """unified_attention through the JIT; with `record`, returns its AttentionPlan (or None)."""
    _check_args(q, kv_cache, out, query_start_loc, seq_lens, block_table, num_reqs)
    T, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    assert head_dim in HEAD_DIMS, f"head_dim {head_dim} must be a power of two in 16..256"
    if T == 0:
        return None
    if num_reqs == 0:  # nothing but padding rows
        out.zero_()
        return None
    group = num_heads // num_kv_heads
    v = kernel_variant(num_heads, num_kv_heads, head_dim, max_query_len, num_splits, tuning)
    num_splits = _clamp_splits(num_splits)
    # grid: decode has R request programs, then the padding-row programs (module docstring)
    grid = (host_cdiv(T, v.block_q) + num_reqs + (0 if v.decode else 1), num_kv_heads, num_splits)
    part_numel = n_out = 0
    if v.split:
        # Token dim rounded up to 16: the strides then stay divisible by 16 for every T, one
        # specialisation class, so a new T never means a new compile. One allocation for both
        # (part_lse starts 64-byte aligned after part_out): one torch.empty per call on a plan.
        t_pad = host_cdiv(T, 16) * 16
        n_out = num_splits * t_pad * num_heads * head_dim
        part_numel = n_out + num_splits * t_pad * num_heads
        part = torch.empty(part_numel, dtype=torch.float32, device=q.device)
        part_out = part[:n_out].view(num_splits, t_pad, num_heads, head_dim)
        part_lse = part[n_out:].view(num_splits, t_pad, num_heads)
    else:
        part_out = part_lse = out  # unused
    # Without the fused merge the counter argument is unused: `out` then, which adds no
    # specialisation class (alignment) of its own.
    counters = _split_counters(q.device, grid[0] * grid[1]) if v.fused_merge else out
    group_pad = host_next_pow2(group)
    pdl_kwargs = pdl.launch_kwargs(q.device)
    args = (q, kv_cache, out, query_start_loc, seq_lens, block_table, part_out, part_lse, counters,
            T, num_reqs, num_splits, scale * math.log2(math.e),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            block_table.stride(0),
            part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1))
    kwargs = dict(
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=v.block_m, BLOCK_Q=v.block_q,
        TILE_N=v.tile_n, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, SPLIT=v.split,
        IEEE=q.dtype == torch.float32 or (_INTERPRET and q.dtype == torch.bfloat16), SEARCH=SEARCH_BLOCK,
        DECODE=v.decode, FUSED_MERGE=v.fused_merge,
        MERGE_CHUNK=v.merge_chunk,
        num_warps=v.num_warps, num_stages=v.num_stages, **pdl_kwargs,
    )
    if pdl_kwargs["PDL"] and v.decode and PDL_PREFETCH_TILES:
        kwargs.update(PREFETCH_TILES=PDL_PREFETCH_TILES,
                      PREFETCH_LINES=max(1, head_dim * kv_cache.element_size() // 128))
    main = _jit(_unified_attention_kernel, grid, args, kwargs, 9, record)
    merge = None
    if v.split and not v.fused_merge:
        merge_grid = (T, num_heads)
        margs = (part_out, part_lse, out, num_splits,
                 part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
                 out.stride(0), out.stride(1))
        mkwargs = dict(SPLITS_PAD=v.splits_pad, HEAD_DIM=head_dim,
                       num_warps=4 if head_dim >= 128 else 2, **pdl_kwargs)
        merge = _jit(_merge_splits_kernel, merge_grid, margs, mkwargs, 3, record)
        if merge is None:
            return None
    if main is None:
        return None
    return launch_plan.AttentionPlan(main, merge, part_numel, n_out * 4, q.device,
                                     counters.data_ptr() if v.fused_merge else None)


def _check_args(q, kv_cache, out, query_start_loc, seq_lens, block_table, num_reqs: int) -> None:
    """Shapes and dtypes the kernel takes on trust: out is written at q's row and head strides for
    q's shape, and the cache is read with q's head_dim, so a mismatch wrote out of bounds or
    attended garbage without an error. Runs on the JIT path only: a plan's key (shapes included)
    can only match a call whose first occurrence passed here."""
    if q.dim() != 3:
        raise ValueError(f"q: expected [T, Hq, D], got {tuple(q.shape)}")
    if out.shape != q.shape:
        raise ValueError(f"out: expected q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[4] != q.shape[2]:
        raise ValueError(f"kv_cache: expected [2, num_blocks, block_size, Hk, {q.shape[2]}] (q's head_dim), "
                         f"got {tuple(kv_cache.shape)}")
    check_index_tensor("query_start_loc", query_start_loc, 1, num_reqs + 1)
    check_index_tensor("seq_lens", seq_lens, 1, num_reqs)
    check_index_tensor("block_table", block_table, 2, num_reqs)
    # The kernel walks head_dim (q, out, the cache) and a block-table row at unit stride: these were
    # bare asserts (an AssertionError with no message, and no check at all under python -O, where
    # the kernel then read and wrote the wrong elements), now errors that name the argument.
    if q.shape[1] % kv_cache.shape[3]:
        raise ValueError(f"kv_cache: expected a kv head count that divides q's {q.shape[1]} heads, "
                         f"got {kv_cache.shape[3]}")
    for name, t, dim in (("q", q, 2), ("out", out, 2), ("kv_cache", kv_cache, 4), ("block_table", block_table, 1)):
        if t.stride(dim) != 1:
            raise ValueError(f"{name}: expected a contiguous last dim, got strides {t.stride()}")


def _jit(kernel, grid, args, kwargs, slots: int, record: bool):
    """kernel[grid](*args, **kwargs); with `record`, the RecordedLaunch of it (or None)."""
    if record:
        return fast_launch.jit_launch(kernel, grid, args, kwargs, slots)
    kernel[grid](*args, **kwargs)
    return None
