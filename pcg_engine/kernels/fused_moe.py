"""Fused MoE: device-only routing alignment plus one grouped-GEMM launch per projection.

A per-expert loop launches two matmuls per active expert and must learn each expert's token
count on the host (a sync a CUDA graph cannot contain). Here `moe_align` groups the N*k
(token, slot) assignments by expert with device ops only, padding each expert's group to a
multiple of BLOCK_M, and every program of the grouped GEMM multiplies one BLOCK_M block of rows
by its expert's weight tiles. All shapes and grids depend on (N, k, E, BLOCK_M), never on the
routing, so a graph captured for a bucket replays correctly for any routing. A few tokens take
kernels/moe_gemv.py instead: two GEMV launches, no alignment (fused_moe's `path`).

  gate_up launch: act[a] = silu(x[a // k] @ Wg[e].T) * (x[a // k] @ Wu[e].T)   (SiLU fused in)
  down launch:    y[a]   = topk_weight[a] * (act[a] @ W2[e].T)
  result:         out[t] = sum over slots of y[t * k + slot]                (deterministic, no atomics)

Weights are [E, out, in] with `in` unit-stride (the checkpoint layout); x, w13, w2 share one
dtype; topk_weights may be any float dtype (it is applied in fp32).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pcg_engine.kernels import moe_gemv, pdl
from pcg_engine.kernels.pdl import gdc_launch_dependents, gdc_wait


def _align_shapes(total: int, num_experts: int, block_m: int) -> int:
    # At most min(E, N*k) experts are non-empty, each adding fewer than block_m padding rows.
    return triton.cdiv(total + min(num_experts, total) * (block_m - 1), block_m) * block_m


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """moe_align as a dozen torch ops; the readable reference and the path for large batches."""
    # Clamped: every op below indexes with the ids, and in the start-up's compile-only pass
    # (engine/precompile.py) they are whatever the skipped routing kernel's output buffer held.
    flat = topk_ids.reshape(-1).long().clamp(0, num_experts - 1)
    total = flat.numel()
    device = flat.device
    m_max = _align_shapes(total, num_experts, block_m)
    # bincount would size its result from the largest id, a value the host would have to read.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts                 # expert's first position, unpadded
    order = torch.sort(flat, stable=True).indices            # assignments, expert by expert
    expert_of = torch.gather(flat, 0, order)
    rank = torch.arange(total, device=device) - torch.gather(start, 0, expert_of)
    dest = torch.gather(padded_end - padded, 0, expert_of) + rank
    sorted_ids = torch.full((m_max,), total, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, m_max, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).clamp_max_(num_experts - 1)
    return sorted_ids, block_expert.to(torch.int32), padded_end[-1:].to(torch.int32)


@triton.jit
def _expert_histogram_kernel(ids_ptr, hist_ptr, total, CHUNK: tl.constexpr, E_PAD: tl.constexpr,
                             PDL: tl.constexpr):
    """hist[c, e] = how many of chunk c's assignments go to expert e."""
    if PDL:  # kernels/pdl.py: the routing comes from the kernel before
        gdc_wait()
        gdc_launch_dependents()
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < total, other=-1).to(tl.int32)
    experts = tl.arange(0, E_PAD)
    tl.store(hist_ptr + c * E_PAD + experts, tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0))


@triton.jit
def _align_scatter_kernel(ids_ptr, hist_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                          total, num_experts, num_chunks, m_max, ONE_CHUNK: tl.constexpr,
                          BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr, C_PAD: tl.constexpr,
                          PDL: tl.constexpr):
    """Program c places chunk c's assignments; program 0 also writes the block table and padding.

    From the whole histogram every program derives each expert's padded start and how many of
    the expert's assignments earlier chunks hold; a column-wise running sum over the chunk's
    [CHUNK, E_PAD] one-hot ranks its own. Padding rows and real rows never share an address, so
    no program waits for another. ONE_CHUNK (a decode step): the histogram is the one-hot's own
    column sums and the histogram launch is skipped.
    """
    if PDL:  # kernels/pdl.py
        gdc_wait()
        gdc_launch_dependents()
    c = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < total, other=-1).to(tl.int32)
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
    if ONE_CHUNK:
        counts = tl.sum(onehot, axis=0)
        earlier = tl.zeros_like(counts)
    else:
        chunks = tl.arange(0, C_PAD)
        hist = tl.load(hist_ptr + chunks[:, None] * E_PAD + experts[None, :],
                       mask=(chunks < num_chunks)[:, None], other=0)
        counts = tl.sum(hist, axis=0)
        earlier = tl.sum(tl.where((chunks < c)[:, None], hist, 0), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    start = padded_end - padded
    dest = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1 + (start + earlier)[None, :]), axis=1)
    tl.store(sorted_ptr + dest, offs, mask=offs < total)
    if c == 0:
        num_padded = tl.sum(padded, axis=0)
        tl.store(num_padded_ptr, num_padded)
        # Each expert's group ends in fewer than BLOCK_M padding rows.
        j = tl.arange(0, BLOCK_M)
        pad_at = (start + counts)[:, None] + j[None, :]
        tl.store(sorted_ptr + pad_at, tl.zeros_like(pad_at) + total, mask=j[None, :] < (padded - counts)[:, None])
        # Block b belongs to the expert whose padded range holds row b * BLOCK_M.
        for b0 in range(0, m_max // BLOCK_M, CHUNK):
            blocks = b0 + tl.arange(0, CHUNK)
            owner = tl.sum((padded_end[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + blocks, tl.minimum(owner, num_experts - 1), mask=blocks < m_max // BLOCK_M)
        for r0 in range(0, m_max, 1024):  # the idle tail past the last group
            rows = r0 + tl.arange(0, 1024)
            tl.store(sorted_ptr + rows, tl.zeros_like(rows) + total, mask=(rows >= num_padded) & (rows < m_max))


# The scatter kernel holds the whole [chunks, experts] histogram in registers; past this many
# elements (2K tokens at top-8 of 128 experts, i.e. prefill, where the GEMMs take milliseconds)
# the torch ops take over.
_ALIGN_KERNEL_MAX_HIST = 16384


def _align_tiling(total: int, num_experts: int) -> tuple[int, int, int]:
    e_pad = triton.next_power_of_2(num_experts)
    # A decode step's few assignments get a small one-hot: the kernel is latency, not work.
    chunk = max(16, min(128, 16384 // e_pad, triton.next_power_of_2(total)))
    return e_pad, chunk, max(2, triton.next_power_of_2(triton.cdiv(total, chunk)))


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Group assignments by expert, each group padded to a multiple of block_m rows.

    topk_ids [N, k] -> (sorted_ids int32 [M], block_expert int32 [M // block_m], num_padded int32 [1]).
    sorted_ids[i] is the assignment (token * k + slot) that grouped-GEMM row i computes, or N * k
    for a padding row; within an expert assignments keep their order. M is the worst case over
    all routings, so every shape depends only on (N, k, E, block_m) and nothing is read back to
    the host: a CUDA graph can capture this. Blocks at or past num_padded are idle.
    One or two small launches up to ~2K tokens, torch ops (moe_align_torch) above.
    """
    total = topk_ids.numel()
    e_pad, chunk, c_pad = _align_tiling(total, num_experts)
    if total == 0 or c_pad * e_pad > _ALIGN_KERNEL_MAX_HIST:
        return moe_align_torch(topk_ids, num_experts, block_m)
    m_max = _align_shapes(total, num_experts, block_m)
    device = topk_ids.device
    ids = topk_ids.reshape(-1).contiguous()
    num_chunks = triton.cdiv(total, chunk)
    hist = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=device)
    sorted_ids = torch.empty(m_max, dtype=torch.int32, device=device)
    block_expert = torch.empty(m_max // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    num_warps = 8 if chunk * e_pad >= 8192 else 4
    if num_chunks > 1:
        _expert_histogram_kernel[(num_chunks,)](ids, hist, total, CHUNK=chunk, E_PAD=e_pad, num_warps=num_warps,
                                                **pdl.launch_kwargs(device))
    _align_scatter_kernel[(num_chunks,)](ids, hist, sorted_ids, block_expert, num_padded,
                                         total, num_experts, num_chunks, m_max, num_chunks == 1,
                                         BLOCK_M=block_m, CHUNK=chunk, E_PAD=e_pad, C_PAD=c_pad,
                                         num_warps=num_warps, **pdl.launch_kwargs(device))
    return sorted_ids, block_expert, num_padded


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, c_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, scale_ptr,
                         N, K, num_valid, top_k, stride_am, stride_we, stride_wn, stride_cm,
                         GATED: tl.constexpr, A_PER_TOKEN: tl.constexpr, MUL_SCALE: tl.constexpr,
                         EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr):
    """C[a] = A[src(a)] @ W[expert].T for this program's BLOCK_M assignments a and BLOCK_N columns.

    GATED: W holds 2N rows (gate then up); C gets silu(gate) * up, N wide.
    A_PER_TOKEN: A has a row per token (src = a // top_k), else a row per assignment.
    MUL_SCALE: scale row a by scale[a] (the router weight) before the single rounding.
    UPCAST: the tiles are converted to fp32 before the dots (bf16 under the CPU interpreter).
    """
    if PDL:  # kernels/pdl.py: the alignment, A and the router weights come from earlier kernels
        gdc_wait()
        gdc_launch_dependents()
    # Axis 0 is the fastest-launched: neighbouring programs are consecutive row blocks of the
    # same expert and N tile, so a weight tile is fetched from HBM once and then hit in L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    assignment = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = assignment < num_valid
    if A_PER_TOKEN:
        src = assignment // top_k
    else:
        src = assignment
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Wrapping the weight rows keeps every load in bounds without a mask; the store masks.
    wn = cols % N
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + src[:, None] * stride_am + rk[None, :]
    w_ptrs = w_ptr + expert * stride_we + wn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up_offset = N.to(tl.int64) * stride_wn
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs)
            if GATED:
                w_up = tl.load(w_ptrs + up_offset)
        else:
            k_ok = rk < K - k0 * BLOCK_K
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            if GATED:
                w_up = tl.load(w_ptrs + up_offset, mask=k_ok[:, None], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
            if GATED:
                w_up = w_up.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:
            acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_SCALE:
        acc = acc * tl.load(scale_ptr + assignment, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + assignment[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (cols < N)[None, :])


@dataclass(frozen=True)
class MoEConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# (max average rows per expert, block_m, block_n, block_k, num_warps, num_stages), for bf16 on
# H100/H200-class GPUs. Few rows per expert is a weight-streaming problem: small M tiles, long K
# tiles and deep pipelines; many rows is a compute problem: large square tiles. The gated launch
# loads two weight tiles per step, so it halves block_n to keep the same shared memory per stage.
_TUNING = [
    (16, 16, 64, 128, 4, 4),
    (64, 32, 64, 128, 4, 3),
    (256, 64, 128, 64, 4, 3),
    (float("inf"), 128, 128, 64, 8, 3),
]


def moe_config(num_tokens: int, top_k: int, num_experts: int, n: int, k: int, gated: bool) -> MoEConfig:
    """Block sizes for one launch; depends only on shapes, so a captured graph's grid is stable."""
    rows_per_expert = num_tokens * top_k / num_experts
    for limit, bm, bn, bk, warps, stages in _TUNING:
        if rows_per_expert <= limit:
            break
    if gated:
        bn //= 2
    # Never tile wider than the (power-of-two-rounded) matrix; 16 is tl.dot's minimum.
    bn = min(bn, max(16, triton.next_power_of_2(n)))
    bk = min(bk, max(16, triton.next_power_of_2(k)))
    return MoEConfig(bm, bn, bk, warps, stages)


def _grouped_gemm(a, w, c, align, scale, top_k, gated, per_token, cfg: MoEConfig):
    sorted_ids, block_expert, num_padded = align
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2]
    grid = (sorted_ids.numel() // cfg.block_m, triton.cdiv(n, cfg.block_n))
    # Triton's CPU interpreter (the only way a kernel launches on CPU tensors, however
    # TRITON_INTERPRET is spelt) computes a bf16 tl.dot on the operands' raw bits: garbage, the tiny
    # MoE model answered one token at every step. There, and only there, bf16 tiles go to fp32 first.
    upcast = a.device.type == "cpu" and a.dtype == torch.bfloat16
    _grouped_gemm_kernel[grid](
        a, w, c, sorted_ids, block_expert, num_padded, scale,
        n, k, c.shape[0], top_k, a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        GATED=gated, A_PER_TOKEN=per_token, MUL_SCALE=scale is not None, EVEN_K=k % cfg.block_k == 0,
        # fp32 stays exact (tf32 would lose 13 mantissa bits); bf16/fp16 dots ignore the setting.
        PRECISION="ieee" if a.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_kwargs(a.device))


def _check(x, w13, w2, topk_weights, topk_ids):
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"x, w13, w2: expected [N, D], [E, 2I, D], [E, D, I], got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    e, two_i, d = w13.shape
    if two_i % 2 or x.shape[1] != d or w2.shape != (e, d, two_i // 2):
        raise ValueError(f"w13, w2: expected [E, 2I, {x.shape[1]}] and [E, {x.shape[1]}, I], "
                         f"got {tuple(w13.shape)}, {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights, topk_ids: expected [{x.shape[0]}, k] each, got "
                         f"{tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise ValueError(f"topk_ids, topk_weights: expected int32/int64 and float, got "
                         f"{topk_ids.dtype}, {topk_weights.dtype}")
    if not x.is_floating_point():  # an integer x failed inside Triton's dot with an obscure error
        raise ValueError(f"x: expected a floating-point dtype, got {x.dtype}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"w13, w2: expected x's dtype {x.dtype}, got {w13.dtype}, {w2.dtype}")
    devices = {t.device for t in (x, w13, w2, topk_weights, topk_ids)}
    if len(devices) != 1:
        raise ValueError(f"x, w13, w2, topk_weights, topk_ids: expected one device, got {devices}")


def _unit_stride_inner(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, configs: tuple[MoEConfig, MoEConfig] | None = None,
              path: str = "auto") -> torch.Tensor:
    """x [N, D]; w13 [E, 2I, D] (rows :I gate, I: up); w2 [E, D, I]; topk_* [N, k] -> [N, D] in x.dtype.

    path: "auto" takes kernels/moe_gemv.py's two GEMV launches for a few tokens (moe_gemv.takes_gemv)
    and the grouped GEMM otherwise; "grouped" or "gemv" force one (tests, benchmarks).
    configs: (up, down) block sizes instead of the tables' (the kernel benchmark's sweeps): MoEConfig
    for the grouped GEMM, where both must have the same block_m, since the two GEMMs share one
    alignment; moe_gemv.GemvConfig for the GEMV path."""
    _check(x, w13, w2, topk_weights, topk_ids)
    n, top_k = topk_ids.shape
    e, two_i, d = w13.shape
    if path not in ("auto", "grouped", "gemv"):
        raise ValueError(f"path: expected 'auto', 'grouped' or 'gemv', got {path!r}")
    if n == 0:
        return x.new_empty((0, d))
    x, w13, w2 = _unit_stride_inner(x), _unit_stride_inner(w13), _unit_stride_inner(w2)
    gemv = path == "gemv" or (path == "auto" and configs is None and moe_gemv.takes_gemv(n, top_k))
    wanted = moe_gemv.GemvConfig if gemv else MoEConfig
    if configs is not None and not all(isinstance(c, wanted) for c in configs):
        raise ValueError(f"configs: the {'GEMV' if gemv else 'grouped GEMM'} path takes two {wanted.__name__}, "
                         f"got {configs!r}")
    if gemv:
        return moe_gemv.fused_moe_gemv(x, w13, w2, topk_weights, topk_ids, configs)
    if configs is None:
        cfg_up = moe_config(n, top_k, e, two_i // 2, d, gated=True)
        cfg_down = moe_config(n, top_k, e, d, two_i // 2, gated=False)  # same block_m: one alignment
    else:
        cfg_up, cfg_down = configs
        if cfg_up.block_m != cfg_down.block_m:
            raise ValueError(f"configs: block_m {cfg_up.block_m} and {cfg_down.block_m} differ; "
                             "the two GEMMs share one alignment")
    align = moe_align(topk_ids, e, cfg_up.block_m)
    act = torch.empty((n * top_k, two_i // 2), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, act, align, None, top_k, True, True, cfg_up)
    y = torch.empty((n * top_k, d), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, y, align, topk_weights.reshape(-1).contiguous(), top_k, False, False, cfg_down)
    return y.view(n, d) if top_k == 1 else y.view(n, top_k, d).sum(1)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The unfused path: a Python loop over experts (one host sync for the counts, two matmuls
    per active expert), accumulated in fp32."""
    n, top_k = topk_ids.shape
    e, two_i, d = w13.shape
    flat = topk_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=e).tolist()
    weights = topk_weights.reshape(-1).float()
    out = torch.zeros((n, d), dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        idx = order[start:start + count]
        start += count
        tokens = idx // top_k
        gate_up = x[tokens] @ w13[expert].T
        act = F.silu(gate_up[:, :two_i // 2]) * gate_up[:, two_i // 2:]
        out.index_add_(0, tokens, (act @ w2[expert].T).float() * weights[idx, None])
    return out.to(x.dtype)
