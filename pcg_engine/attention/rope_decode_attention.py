"""Decode attention with the q/k RMSNorm, RoPE and KV write fused in: one launch instead of two.

A batch-1 decode step of Qwen3-0.6B in a full decode graph runs, per layer, `_rope_kv_kernel`
(rope_kv.py: ~3 us for one token) and then the split-KV attention kernel plus its merge. The
RoPE + KV write moves a few KB; its cost is a kernel boundary. Here the attention programs do it
themselves, so the full decode graphs lose one node a layer (28 a step for the 0.6B).

Work unit: (token t, kv head h, split s), grid (T, Hk, num_splits) with the split count of the
graphed decode launch (launch_config.graph_num_splits: bucket values only, so the launch is the
same on every replay whatever the contexts). Decode only, one token a request: request r is row r
(the full decode graphs' metadata: query_start_loc = arange); rows t >= num_reqs are padding.
Each program:
  * loads the raw q rows of its GQA group from the qkv output and applies the per-head RMSNorm and
    RoPE at positions[t] with rope_kv.py's own helper and expressions (fp32, the same roundings),
    so q is bit for bit what the two-kernel path would attend with;
  * the one program of (t, h) that owns the last key tile (its split's share holds position
    seq_len - 1; split 0 for a padding row) also normalises and rotates k, writes k and v into the
    cache at slot_mapping[t] (slot -1: the scratch block 0, as rope_kv does) and starts its online
    softmax from that new key, held in registers;
  * every program attends its share of the keys 0 .. seq_len - 2 from the cache: nobody reads the
    slot being written, so no program depends on another's write (no ordering between programs).
Shares of tiles are exactly the unified kernel's (cdiv(seq_len, TILE_N) tiles cut num_splits ways,
the new key counted), and the partials (normalised output, log2-sum-exp) go through the same merge
kernel: with fused_merge off, as the graphed decode launch has it. Programs with an empty share
write an empty partial without loading anything; seq_len 0 gives zeros.

k is normalised over all kv heads of the token ([HK_PAD, HALF], as rope_kv does) and the program
keeps its own head: the fp32 sum of squares then has rope_kv's shape, which is what decides the
order Triton sums it in on a GPU (the point: bit-identical k in the cache).
"""

import math

import torch
import triton
import triton.language as tl

from pcg_engine.attention.metadata import check_index_tensor
from pcg_engine.attention.launch_config import _clamp_splits, host_cdiv, kernel_variant
from pcg_engine.attention.rope_kv import _check_cache, _check_shapes, _head_rms_norm
from pcg_engine.attention.triton_attention import HEAD_DIMS, _INTERPRET, _attend_tiles, _merge_splits_kernel
from pcg_engine.kernels import pdl
from pcg_engine.kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _concat_halves(x1, x2, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[ROWS, HALF] x2 -> [ROWS, HEAD_DIM], x1 first (tl.dot wants one operand)."""
    return tl.reshape(tl.permute(tl.join(x1, x2), (0, 2, 1)), (ROWS, HEAD_DIM))


# Per-step integers stay unspecialised (triton_attention.py's reasoning: one binary per variant).
@triton.jit(do_not_specialize=["num_tokens", "num_reqs", "num_splits"])
def _rope_decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, slot_ptr, qn_ptr, kn_ptr,
    cache_ptr, out_ptr, seq_lens_ptr, bt_ptr, part_out_ptr, part_lse_ptr, q_out_ptr,
    num_tokens, num_reqs, num_splits, qk_scale, max_pos, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_qot, stride_qoh,
    stride_cs, stride_c_kv, stride_c_blk, stride_c_tok, stride_c_h, stride_bt,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    NUM_KV_HEADS: tl.constexpr, HK_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, NORM: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr, STORE_Q: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # kernels/pdl.py: q, k, v, positions, slots and the metadata come from earlier kernels
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    HALF: tl.constexpr = HEAD_DIM // 2
    tok = t.to(tl.int64)
    seq_len = tl.where(t < num_reqs, tl.load(seq_lens_ptr + tl.minimum(t, num_reqs - 1)), 0)

    # The unified kernel's shares (the new key counted), and the split that holds the last tile.
    num_tiles = tl.cdiv(seq_len, TILE_N)
    if SPLIT:
        per = tl.cdiv(num_tiles, num_splits)
        t_lo = split * per
        t_hi = tl.minimum(t_lo + per, num_tiles)
        owner = tl.where(num_tiles > 0, (num_tiles - 1) // tl.maximum(per, 1), 0)
    else:
        t_lo = 0
        t_hi = num_tiles
        owner = 0

    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < GROUP          # one token: rows are the GROUP query heads of kv head kvh
    head = kvh * GROUP + offs_m
    d = tl.arange(0, HEAD_DIM)
    if SPLIT:
        prow = split * stride_ps + tok * stride_pt + head * stride_ph
        if (split != owner) & (t_lo >= t_hi):
            # Nothing to attend and nothing to write: the merge kernel reads an empty partial.
            tl.store(part_out_ptr + prow[:, None] + d[None, :], tl.zeros((BLOCK_M, HEAD_DIM), tl.float32),
                     mask=row_ok[:, None])
            tl.store(part_lse_ptr + split * stride_ls + tok * stride_lt + head,
                     tl.full((BLOCK_M,), float("-inf"), tl.float32), mask=row_ok)
            return

    # q: rope_kv's norm and rotation, in its halves and with its roundings (see rope_kv.py).
    d2 = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)  # a padding row's stray position stays in bounds
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d2)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d2)[None, :]
    src = q_ptr + tok * stride_qt + head[:, None] * stride_qh + d2[None, :]
    x1 = tl.load(src, mask=row_ok[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=row_ok[:, None], other=0.0).to(tl.float32)
    if NORM:
        x1, x2 = _head_rms_norm(x1, x2, qn_ptr, d2, eps, q_ptr.dtype.element_ty, HEAD_DIM, HALF)
    q_ty = q_ptr.dtype.element_ty
    q1 = (x1 * cos - x2 * sin).to(q_ty)
    q2 = (x2 * cos + x1 * sin).to(q_ty)
    q = _concat_halves(q1, q2, BLOCK_M, HEAD_DIM)
    if IEEE:
        q = q.to(tl.float32)

    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    m_i = tl.full((BLOCK_M,), -1e30, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    if split == owner:
        if STORE_Q:  # tests only: the rotated q, to compare with rope_kv's bit for bit
            dst = q_out_ptr + tok * stride_qot + head[:, None] * stride_qoh + d2[None, :]
            tl.store(dst, q1, mask=row_ok[:, None])
            tl.store(dst + HALF, q2, mask=row_ok[:, None])
        # k of every kv head normalised and rotated exactly as rope_kv does; this head's row written.
        hk = tl.arange(0, HK_PAD)[:, None]
        k_src = k_ptr + tok * stride_kt + hk * stride_kh + d2[None, :]
        y1 = tl.load(k_src, mask=hk < NUM_KV_HEADS, other=0.0).to(tl.float32)
        y2 = tl.load(k_src + HALF, mask=hk < NUM_KV_HEADS, other=0.0).to(tl.float32)
        if NORM:
            y1, y2 = _head_rms_norm(y1, y2, kn_ptr, d2, eps, k_ptr.dtype.element_ty, HEAD_DIM, HALF)
        k_ty = k_ptr.dtype.element_ty
        cache_ty = cache_ptr.dtype.element_ty
        r1 = (y1 * cos - y2 * sin).to(k_ty).to(cache_ty)
        r2 = (y2 * cos + y1 * sin).to(k_ty).to(cache_ty)
        slot = tl.maximum(tl.load(slot_ptr + t).to(tl.int64), 0)  # -1 -> scratch block 0, offset 0
        base = cache_ptr + (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_tok
        mine = hk == kvh
        tl.store(base + hk * stride_c_h + d2[None, :], r1, mask=mine)
        tl.store(base + hk * stride_c_h + HALF + d2[None, :], r2, mask=mine)
        vv = tl.load(v_ptr + tok * stride_vt + kvh * stride_vh + d).to(cache_ty)
        tl.store(base + stride_c_kv + kvh * stride_c_h + d, vv)
        if seq_len > 0:
            # The new key (position seq_len - 1) from registers, as the tile loop would score it
            # (k in q's dtype, fp32 products): the online softmax starts from it.
            k1 = tl.sum(tl.where(mine, r1.to(tl.float32), 0.0), 0)  # exact: one term, zeros
            k2 = tl.sum(tl.where(mine, r2.to(tl.float32), 0.0), 0)
            kk = tl.reshape(tl.permute(tl.join(k1, k2), (1, 0)), (HEAD_DIM,)).to(cache_ty).to(q.dtype)
            m_i = tl.sum(q.to(tl.float32) * kk.to(tl.float32)[None, :], 1) * qk_scale
            l_i = tl.full((BLOCK_M,), 1.0, tl.float32)
            acc += vv.to(tl.float32)[None, :]

    # The cached keys 0 .. seq_len - 2 of this share; the new key's slot is never read.
    kv_end = tl.maximum(seq_len - 1, 0)
    num_full = kv_end // TILE_N
    hi = tl.minimum(t_hi, tl.cdiv(kv_end, TILE_N))
    q_pos = offs_m * 0 + kv_end   # decode: every cached key is visible (the mask is kv_end's only)
    k_base = cache_ptr + kvh * stride_c_h
    v_base = k_base + stride_c_kv
    bt_row = bt_ptr + tl.minimum(t, num_reqs - 1).to(tl.int64) * stride_bt
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_base, v_base, bt_row, q_pos,
                                  t_lo, tl.minimum(hi, num_full), kv_end,
                                  stride_c_blk, stride_c_tok, qk_scale,
                                  TILE_N, BLOCK_SIZE, HEAD_DIM, False, IEEE)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_base, v_base, bt_row, q_pos,
                                  tl.maximum(t_lo, num_full), hi, kv_end,
                                  stride_c_blk, stride_c_tok, qk_scale,
                                  TILE_N, BLOCK_SIZE, HEAD_DIM, True, IEEE)

    # l == 0: no key (seq_len 0, a padding row) -> zeros, not 0/0.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_out_ptr + prow[:, None] + d[None, :], o, mask=row_ok[:, None])
        tl.store(part_lse_ptr + split * stride_ls + tok * stride_lt + head, lse, mask=row_ok)
    else:
        dst = out_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def rope_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          cos_sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          out: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, num_reqs: int,
                          scale: float, num_splits: int = 1, q_norm: torch.Tensor | None = None,
                          k_norm: torch.Tensor | None = None, eps: float = 1e-6, *, tuning=None,
                          q_out: torch.Tensor | None = None) -> None:
    """rope_and_write_kv (rope_kv.py) then decode unified_attention, in one launch (+ the merge).

    q [T, Hq, D], k and v [T, Hk, D] raw from the qkv projection (last dim contiguous; rows may be
    strided views), positions and slot_mapping [T]; kv_cache [2, NB, BS, Hk, D]; out [T, Hq, D];
    seq_lens [>=R] (the new token counted), block_table [>=R, W]. Decode only: request r is row r,
    1 <= num_reqs <= T, rows from num_reqs on are padding (zeros out, k/v to their slots). q_norm,
    k_norm [D]: per-head RMSNorm first (both or neither). num_splits and tuning as unified_attention's
    (the merge kernel: a fused merge is not supported). q_out [T, Hq, D] (tests): the rotated q.
    """
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm, k_norm: give both per-head norm weights or neither")
    # The kernel indexes everything with q's T and head_dim and num_reqs (as rope_kv's and
    # unified_attention's launchers check): a mismatch would be read or written out of bounds.
    _check_shapes(q, k, v, positions, cos_sin, slot_mapping, q_out, q_norm, k_norm)
    _check_cache(kv_cache, k.shape[1], q.shape[2])   # a one-plane cache had v written past its end
    T, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    assert head_dim in HEAD_DIMS, f"head_dim {head_dim} must be a power of two in 16..256"
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads, {num_kv_heads} kv heads"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and out.stride(2) == 1
    if not 1 <= num_reqs <= T:
        raise ValueError(f"num_reqs: {num_reqs} must be in 1..{T} (one decode token a request)")
    if out.shape != q.shape:
        raise ValueError(f"out: expected q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    check_index_tensor("seq_lens", seq_lens, 1, num_reqs)
    check_index_tensor("block_table", block_table, 2, num_reqs)
    assert kv_cache.stride(4) == 1 and block_table.stride(1) == 1
    v_ = kernel_variant(num_heads, num_kv_heads, head_dim, 1, num_splits, tuning)
    if v_.fused_merge:
        raise ValueError("rope_decode_attention merges splits with the merge kernel: tuning.fused_merge must be off")
    num_splits = _clamp_splits(num_splits)
    if v_.split:  # unified_attention's partial buffers (token dim rounded up to 16: one stride class)
        t_pad = host_cdiv(T, 16) * 16
        part_out = torch.empty((num_splits, t_pad, num_heads, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_splits, t_pad, num_heads), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    if q_out is None:
        q_out = q  # unused (STORE_Q off)
    assert q_out.shape == q.shape and q_out.stride(2) == 1
    _rope_decode_attention_kernel[(T, num_kv_heads, num_splits)](
        q, k, v, positions, cos_sin, slot_mapping,
        q if q_norm is None else q_norm, k if k_norm is None else k_norm,
        kv_cache, out, seq_lens, block_table, part_out, part_lse, q_out,
        T, num_reqs, num_splits, scale * math.log2(math.e), cos_sin.shape[0], eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), q_out.stride(0), q_out.stride(1), cos_sin.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        NUM_KV_HEADS=num_kv_heads, HK_PAD=triton.next_power_of_2(num_kv_heads), GROUP=num_heads // num_kv_heads,
        BLOCK_M=v_.block_m, TILE_N=v_.tile_n, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        NORM=q_norm is not None, SPLIT=v_.split,
        IEEE=q.dtype == torch.float32 or (_INTERPRET and q.dtype == torch.bfloat16),
        STORE_Q=q_out is not q,
        num_warps=v_.num_warps, num_stages=v_.num_stages, **pdl.launch_kwargs(q.device),
    )
    if v_.split:
        _merge_splits_kernel[(T, num_heads)](
            part_out, part_lse, out, num_splits,
            part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            SPLITS_PAD=v_.splits_pad, HEAD_DIM=head_dim,
            num_warps=4 if head_dim >= 128 else 2, **pdl.launch_kwargs(q.device),
        )
