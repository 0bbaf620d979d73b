"""Fused RoPE + paged KV write: one launch rotates q and k and stores k, v into the cache.

With q_norm / k_norm weights, the launch also applies Qwen3's per-head RMSNorm to q and k before
rotating them (two launches fewer per layer: 56 of ~350 kernels of a Qwen3-0.6B decode step). The
norm rounds like kernels/norm.py's kernel and the reference: normalise in fp32, round to the
input's dtype, scale by the weight, round again; RoPE then reads that rounded value.

Unfused, this is four kernels (rotate q, rotate k, write k, write v) and two temporaries per
layer per step; fused, each token's q, k and v are read once and written once. The grid is one
program per flat token (T, a bucket value), and nothing is read back to the host, so the launch
is the same on every replay of a CUDA graph.

Contracts kept (see rope.py / torch_backend.py): rotate-half RoPE computed in fp32 with
cos_sin [max_pos, D] (cos in the first half, sin in the second); the cache is
[2, num_blocks, block_size, Hk, D]; slot -1 (a padding token) is written to slot 0 of the scratch
block 0, exactly as write_kv's clamp does, so a padding row never needs a branch on the host.
"""

import torch
import triton
import triton.language as tl

from pcg_engine.kernels import pdl
from pcg_engine.kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _head_rms_norm(x1, x2, w_ptr, d, eps, dtype: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    """RMSNorm of each row [heads, HEAD_DIM] given as its two halves (fp32), rounded as norm.py does."""
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
    w1 = tl.load(w_ptr + d).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + d).to(tl.float32)[None, :]
    y1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return y1, y2


@triton.jit
def _rope_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, slot_ptr, cache_ptr, q_out_ptr, qn_ptr, kn_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_cs,
    stride_c_kv, stride_c_blk, stride_c_tok, stride_c_h,
    max_pos, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # kernels/pdl.py: every input but the weights comes from earlier kernels of the step
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0)
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HALF)

    # A padding row may carry any position; clamping keeps the cos/sin read in bounds (its
    # result lands in scratch and is never attended to), so a stray value cannot fault a replay.
    pos = tl.load(pos_ptr + t).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d)[None, :]

    # q: all heads of the token at once, [HQ_PAD, HALF] per half.
    hq = tl.arange(0, HQ_PAD)[:, None]
    mq = hq < NUM_HEADS
    src = q_ptr + t * stride_qt + hq * stride_qh + d[None, :]
    x1 = tl.load(src, mask=mq, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mq, other=0.0).to(tl.float32)
    if NORM:
        x1, x2 = _head_rms_norm(x1, x2, qn_ptr, d, eps, q_ptr.dtype.element_ty, HEAD_DIM, HALF)
    dst = q_out_ptr + t * stride_ot + hq * stride_oh + d[None, :]
    out_ty = q_out_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ty), mask=mq)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ty), mask=mq)

    # k rotated and v as-is, straight into the paged cache at this token's slot.
    slot = tl.load(slot_ptr + t).to(tl.int64)
    slot = tl.maximum(slot, 0)  # -1 -> scratch block 0, offset 0 (write_kv's clamp)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    base = cache_ptr + blk * stride_c_blk + off * stride_c_tok
    hk = tl.arange(0, HK_PAD)[:, None]
    mk = hk < NUM_KV_HEADS
    cache_ty = cache_ptr.dtype.element_ty

    src = k_ptr + t * stride_kt + hk * stride_kh + d[None, :]
    x1 = tl.load(src, mask=mk, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mk, other=0.0).to(tl.float32)
    if NORM:
        x1, x2 = _head_rms_norm(x1, x2, kn_ptr, d, eps, k_ptr.dtype.element_ty, HEAD_DIM, HALF)
    # Round to k's own dtype first, like the reference (apply_rope then write_kv's cast).
    k_ty = k_ptr.dtype.element_ty
    r1 = (x1 * cos - x2 * sin).to(k_ty).to(cache_ty)
    r2 = (x2 * cos + x1 * sin).to(k_ty).to(cache_ty)
    kdst = base + hk * stride_c_h + d[None, :]
    tl.store(kdst, r1, mask=mk)
    tl.store(kdst + HALF, r2, mask=mk)

    dfull = tl.arange(0, HEAD_DIM)[None, :]
    vv = tl.load(v_ptr + t * stride_vt + hk * stride_vh + dfull, mask=mk, other=0.0)
    tl.store(base + stride_c_kv + hk * stride_c_h + dfull, vv.to(cache_ty), mask=mk)


def _check_shapes(q, k, v, positions, cos_sin, slot_mapping, q_out, q_norm, k_norm) -> None:
    """The kernel indexes k, v, positions, slots, cos_sin, q_out and the norm weights with q's T and
    head_dim: a shorter or narrower one was read or written out of bounds without an error."""
    if q.dim() != 3:
        raise ValueError(f"q: expected [T, Hq, D], got {tuple(q.shape)}")
    T, _, D = q.shape
    if k.dim() != 3 or k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k: expected [{T}, Hk, {D}] (q's T and head_dim), got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.shape != (T,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected [{T}] int32/int64, got {tuple(t.shape)} {t.dtype}")
    if cos_sin.dim() != 2 or cos_sin.shape[0] < 1 or cos_sin.shape[1] != D or cos_sin.stride(1) != 1:
        raise ValueError(f"cos_sin: expected [max_pos >= 1, {D}] (last dim contiguous), got {tuple(cos_sin.shape)}")
    # The kernel writes q_out's head_dim at unit stride (only its row and head strides are passed):
    # a q_out with a strided last dim (a permuted view) was filled in the wrong places, no error.
    if q_out is not None and (q_out.shape != q.shape or q_out.stride(2) != 1):
        raise ValueError(f"q_out: expected q's shape {tuple(q.shape)} with the last dim contiguous, "
                         f"got {tuple(q_out.shape)} stride {q_out.stride()}")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and (w.shape != (D,) or w.stride(0) != 1):
            raise ValueError(f"{name}: expected [{D}] (head_dim) contiguous, got {tuple(w.shape)} "
                             f"stride {w.stride()}")


def _check_cache(kv_cache, num_kv_heads: int, head_dim: int) -> None:
    """The kernels write v at k's address + stride(0) and take the heads and head_dim from k: a
    cache with one plane ([1, NB, BS, Hk, D]) had v written past its end, and another head count or
    layout failed a bare assert (an AssertionError with no message, no check under python -O)."""
    if (kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3] != num_kv_heads
            or kv_cache.shape[4] != head_dim or kv_cache.stride(4) != 1):
        raise ValueError(f"kv_cache: expected [2, num_blocks, block_size, {num_kv_heads}, {head_dim}] (k's heads "
                         f"and head_dim, last dim contiguous), got {tuple(kv_cache.shape)} stride {kv_cache.stride()}")


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      q_out: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
                      k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """q [T, Hq, D], k and v [T, Hk, D] (last dim contiguous; rows may be strided views of a fused
    qkv), positions [T], slot_mapping [T]; kv_cache [2, NB, BS, Hk, D].

    Writes rotated k and v into kv_cache and returns rotated q (into q_out [T, Hq, D] if given,
    which may be q itself: each element is read before it is written by the same program).
    q_norm, k_norm [D] (both or neither): per-head RMSNorm of q and k (eps) before the rotation.
    """
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm, k_norm: give both per-head norm weights or neither")
    _check_shapes(q, k, v, positions, cos_sin, slot_mapping, q_out, q_norm, k_norm)
    T, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert head_dim % 2 == 0 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "head_dim must be contiguous"
    _check_cache(kv_cache, num_kv_heads, head_dim)
    if q_out is None:
        q_out = torch.empty_like(q)
    if T == 0:
        return q_out
    _rope_kv_kernel[(T,)](
        q, k, v, positions, cos_sin, slot_mapping, kv_cache, q_out,
        q if q_norm is None else q_norm, k if k_norm is None else k_norm,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), cos_sin.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        cos_sin.shape[0], eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        HQ_PAD=triton.next_power_of_2(num_heads), HK_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, BLOCK_SIZE=kv_cache.shape[2], NORM=q_norm is not None,
        num_warps=4 if num_heads * head_dim >= 2048 else 1, **pdl.launch_kwargs(q.device),
    )
    return q_out
