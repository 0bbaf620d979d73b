"""Skinny GEMM: y = x @ w.T for a few rows of x (decode steps), streaming the weight at full bandwidth.

At batch 1..16 a projection is a weight-streaming problem: every weight byte is read once and used
for at most 16 multiply-adds. cuBLAS picks tiles made for compute on these shapes; on the H200 its
batch-1 kernels read Qwen3-0.6B's projection weights at 0.8-1.6 TB/s of the 4.25 TB/s the card can
copy (docs/PERF.md, the batch-1 kernel list), and the four projections of a layer are most of a
decode step's GPU time.

Each program owns BLOCK_N output columns for all rows and walks K in BLOCK_K slices, so the grid
is cdiv(N, BLOCK_N) programs with no reduction across programs (no split-K, no second kernel, no
atomics): the launch depends only on the shapes. Two inner products:
- USE_DOT: tl.dot on a [BLOCK_M >= 16, BLOCK_K] x [BLOCK_K, BLOCK_N] tile (tensor cores, rows
  padded to 16 and masked); needs BLOCK_N >= 16.
- otherwise a broadcast multiply and a sum over K on the CUDA cores: any power-of-two BLOCK_M and
  BLOCK_N down to 1, which lets narrow matrices (N = 1024) spread over more programs than SMs.
Accumulation in fp32, one rounding at the store.

Which configuration runs for a shape comes from `TUNED` (measured on the H200 by
scripts/bench_skinny_gemm.py against F.linear); a shape that is not there, or where cuBLAS won,
keeps F.linear. The kernel serves only CUDA: the CPU path is F.linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pcg_engine import switches
from pcg_engine.kernels import pdl
from pcg_engine.kernels.activation import silu_and_mul
from pcg_engine.kernels.pdl import gdc_launch_dependents, gdc_wait
from pcg_engine.kernels.norm import add_rms_norm

MAX_M = 16   # more rows than this and the projection is no longer weight-bound enough to matter
# With PDL, a program loads the first k-slices of its weight rows before gdc_wait, so that much of
# its weight stream may overlap the kernel before it: as many slices as hold at most
# PRELOAD_PER_THREAD weight elements a thread (registers: 64 bf16 are 32), at most MAX_PRELOAD (the
# kernel has four slots). Session 5 preloaded only single-slice rows (K <= BLOCK_K: 0.6B's qkv and
# gate_up); o_proj (2 slices of 1024) and down_proj (3) waited first. Measured on the H200 (session 6,
# call 1, P1 0.6B full_decode, same call): 0.915 -> 0.860 ms a token. PCG_SKINNY_PRELOAD=0 restores
# session 5's rule (an A/B switch for benchmarks, read at import).
MAX_PRELOAD = 4
PRELOAD_PER_THREAD = 64
_PRELOAD_WIDE = switches.read("PCG_SKINNY_PRELOAD", "1") != "0"


def preload_slices(block_n: int, block_k: int, k: int, num_warps: int) -> int:
    """How many k-slices of weight a program loads before gdc_wait (kernels with PDL only)."""
    if k % block_k:
        return 0
    slices = k // block_k
    if not _PRELOAD_WIDE:
        return 1 if slices == 1 else 0
    fit = PRELOAD_PER_THREAD * 32 * num_warps // (block_n * block_k)
    return max(0, min(slices, MAX_PRELOAD, fit))


@triton.jit
def _k_slice(acc, w, x_ptr, res_ptr, nw_ptr, rm, rk, m_ok, k0, K, stride_xm, stride_rm, rstd,
             GATED: tl.constexpr, NORM: tl.constexpr, USE_DOT: tl.constexpr, EVEN_K: tl.constexpr,
             PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += (the prologue of x's k-slice k0) @ w.T, w being that slice of the weight rows."""
    dtype = x_ptr.dtype.element_ty
    kk = k0 * BLOCK_K + rk
    if EVEN_K:
        x_ok = m_ok[:, None]
    else:
        x_ok = m_ok[:, None] & (kk < K)[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + kk[None, :]
    x = tl.load(x_ptrs, mask=x_ok, other=0.0)
    if NORM:
        r = tl.load(res_ptr + rm[:, None] * stride_rm + kk[None, :], mask=x_ok, other=0.0)
        xs = (x.to(tl.float32) + r.to(tl.float32)).to(dtype).to(tl.float32)
        nw = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
        x = (nw * (xs * rstd).to(dtype).to(tl.float32)).to(dtype)
    if GATED:
        gate = x.to(tl.float32)
        up = tl.load(x_ptrs + K, mask=x_ok, other=0.0).to(tl.float32)
        x = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)
    if USE_DOT:
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    else:
        prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        acc += tl.sum(prod, axis=2)
    return acc


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, res_ptr, nw_ptr, res_out_ptr, M, N, K,
                        stride_xm, stride_wn, stride_ym, stride_rm, stride_rom, eps,
                        GATED: tl.constexpr, NORM: tl.constexpr, USE_DOT: tl.constexpr,
                        EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRELOAD: tl.constexpr, PDL: tl.constexpr):
    # GATED: x rows are [gate | up] (2K wide) and the GEMM's input is silu(gate) * up, computed
    # on the fly and rounded to x's dtype exactly as kernels/activation.py's kernel stores it, so
    # the fused MLP tail equals SiLU-and-mul followed by this GEMM bit for bit.
    # NORM: the input is rmsnorm(x + residual) * nw, rounded as kernels/norm.py's kernel does; a
    # first pass over the (few, L2-resident) rows finds each row's scale, and program 0 also
    # stores the new residual x + residual. The decoder layer's add + RMSNorm then costs no launch.
    # PRELOAD (with PDL only, 0..4): the first PRELOAD k-slices of the program's weight rows are
    # loaded before gdc_wait, so that much of the weight stream overlaps the kernel before.
    tl.static_assert(PDL or PRELOAD == 0, "PRELOAD needs PDL: the k loop starts after the preloaded slices")
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    dtype = x_ptr.dtype.element_ty
    # Wrapping the weight rows keeps every weight load in bounds without a mask; the store masks.
    wn = (rn % N).to(tl.int64)
    w_ptrs = w_ptr + wn[:, None] * stride_wn + rk[None, :]
    if PDL:  # kernels/pdl.py: weights before the wait (no kernel writes them), all else after
        if PRELOAD >= 1:
            w0 = tl.load(w_ptrs)
        if PRELOAD >= 2:
            w1 = tl.load(w_ptrs + BLOCK_K)
        if PRELOAD >= 3:
            w2 = tl.load(w_ptrs + 2 * BLOCK_K)
        if PRELOAD >= 4:
            w3 = tl.load(w_ptrs + 3 * BLOCK_K)
        gdc_wait()
        gdc_launch_dependents()
    rstd = tl.zeros((BLOCK_M, 1), dtype=tl.float32)
    if NORM:
        sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, tl.cdiv(K, BLOCK_K)):
            kk = k0 * BLOCK_K + rk
            ok = m_ok[:, None] & (kk < K)[None, :]
            xs = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=ok, other=0.0).to(tl.float32)
            rs = tl.load(res_ptr + rm[:, None] * stride_rm + kk[None, :], mask=ok, other=0.0).to(tl.float32)
            xs = (xs + rs).to(dtype)
            if pid == 0:
                tl.store(res_out_ptr + rm[:, None] * stride_rom + kk[None, :], xs, mask=ok)
            xs = xs.to(tl.float32)
            sq += tl.sum(xs * xs, axis=1)
        rstd = tl.rsqrt(sq / K + eps)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PDL:  # the preloaded slices first (four slots: Triton has no array of register tiles)
        if PRELOAD >= 1:
            acc = _k_slice(acc, w0, x_ptr, res_ptr, nw_ptr, rm, rk, m_ok, 0, K, stride_xm, stride_rm, rstd,
                           GATED, NORM, USE_DOT, EVEN_K, PRECISION, BLOCK_K)
        if PRELOAD >= 2:
            acc = _k_slice(acc, w1, x_ptr, res_ptr, nw_ptr, rm, rk, m_ok, 1, K, stride_xm, stride_rm, rstd,
                           GATED, NORM, USE_DOT, EVEN_K, PRECISION, BLOCK_K)
        if PRELOAD >= 3:
            acc = _k_slice(acc, w2, x_ptr, res_ptr, nw_ptr, rm, rk, m_ok, 2, K, stride_xm, stride_rm, rstd,
                           GATED, NORM, USE_DOT, EVEN_K, PRECISION, BLOCK_K)
        if PRELOAD >= 4:
            acc = _k_slice(acc, w3, x_ptr, res_ptr, nw_ptr, rm, rk, m_ok, 3, K, stride_xm, stride_rm, rstd,
                           GATED, NORM, USE_DOT, EVEN_K, PRECISION, BLOCK_K)
    for k0 in range(PRELOAD, tl.cdiv(K, BLOCK_K)):   # the launcher passes PRELOAD 0 without PDL
        if EVEN_K:
            w = tl.load(w_ptrs + k0 * BLOCK_K)
        else:
            w = tl.load(w_ptrs + k0 * BLOCK_K, mask=(k0 * BLOCK_K + rk < K)[None, :], other=0.0)
        acc = _k_slice(acc, w, x_ptr, res_ptr, nw_ptr, rm, rk, m_ok, k0, K, stride_xm, stride_rm, rstd,
                       GATED, NORM, USE_DOT, EVEN_K, PRECISION, BLOCK_K)
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (rn < N)[None, :])


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    use_dot: bool
    num_warps: int = 4
    num_stages: int = 3


# (rows bucket, N, K) -> config, for bf16 on the H200. Rows are bucketed to the next power of two.
# Only the CUDA-core configs the model was measured with are kept: the narrow Qwen3-0.6B matrices
# at 1-4 rows (o_proj and down_proj, N = 1024: 3.3x / 1.5x faster than cuBLAS at one row in
# `scripts/bench_skinny_gemm.py`, commit 779222f), and the 0.6B qkv / gate_up projections at one
# row, at parity with cuBLAS but folding the add + RMSNorm before them into the launch. In the
# model (0.6B, batch-1 full_decode) the step went 1,375 -> 1,031 us of GPU. The sweep's tensor-core
# winners (8B shapes, 8-16 rows, 1.02-1.2x in the sweep) are left out: the last H200 call measured
# 8B batch-1 decode at 12.9 ms with them and their prologues (4.97 ms before), and no call was left
# to tell which part did it (docs/PERF.md, session 3).
TUNED: dict[tuple[int, int, int], SkinnyConfig] = {
    (1, 1024, 2048): SkinnyConfig(2, 1024, False, 4, 3),
    (2, 1024, 2048): SkinnyConfig(2, 1024, False, 4, 3),
    (4, 1024, 2048): SkinnyConfig(2, 1024, False, 4, 3),
    (1, 1024, 3072): SkinnyConfig(2, 1024, False, 4, 3),
    (2, 1024, 3072): SkinnyConfig(2, 1024, False, 4, 3),
    (4, 1024, 3072): SkinnyConfig(2, 1024, False, 4, 3),
    (1, 4096, 1024): SkinnyConfig(4, 1024, False, 4, 3),
    (1, 6144, 1024): SkinnyConfig(4, 1024, False, 4, 3),
    # Two rows: the piecewise graphs' smallest token bucket (compile/setup.py pads a single decode
    # to two tokens), where cuBLAS plus a separate add + RMSNorm ran qkv and gate_up (56 nvjet
    # kernels and 56 norms a step in session 5's piecewise batch-1 profile). The one-row configs,
    # for the fold; expected -3 us a layer of GPU time there (the norm's launch).
    (2, 4096, 1024): SkinnyConfig(4, 1024, False, 4, 3),
    (2, 6144, 1024): SkinnyConfig(4, 1024, False, 4, 3),
    # Qwen3-30B-A3B's MoE router (N = 128 experts, K = 2048): cuBLAS's tile leaves most SMs idle,
    # 5.1 µs at 1-4 rows against 2.2 / 2.4 / 2.8 here (session 35, `--shapes "30B router"`).
    (1, 128, 2048): SkinnyConfig(2, 1024, False, 4, 3),
    (2, 128, 2048): SkinnyConfig(2, 1024, False, 4, 3),
    (4, 128, 2048): SkinnyConfig(2, 1024, False, 4, 3),
    # Qwen3-30B-A3B's qkv at one row: at parity with cuBLAS in the sweep (8.10 vs 7.89 µs, session 35),
    # taken for the input add + RMSNorm that folds into it, as 0.6B's qkv above.
    (1, 5120, 2048): SkinnyConfig(8, 1024, False, 4, 3),
}

# Qwen3-8B at one row on the CUDA-core path (the session 3 sweep's best CUDA-core tiles, with the
# add + RMSNorm and SiLU-and-mul folds and the PDL preload: qkv (8, 1024), o (4, 1024), gate_up
# (8, 1024), down (4, 1024)) measured slower in the model too: P1 8B full_decode 5.11 vs 4.68 ms,
# full_and_piecewise 5.11 vs 4.80 (session 6, call 2, same call), so 8B stays on cuBLAS. Without the
# folds, o_proj and down_proj alone on the kernel (4, 1024) still lost: 4.682 / 4.683 vs 4.647 ms
# (session 6, final call, alternated), although cuBLAS runs both split-K with a reduce kernel.
# Tensor-core configs for Qwen3-8B (o_proj at 1-16 rows, down_proj at one row; 1.08-1.18x cuBLAS
# in the sweep, no prologue) measured slower in the model: P1 8B 4.91 ms vs 4.74 (session 4,
# call 3, docs/PERF.md), so 8B stays on cuBLAS.

# PCG_SKINNY_GEMM=0 keeps F.linear everywhere (an A/B switch for benchmarks, read at fuse time).
ENABLED = switches.read("PCG_SKINNY_GEMM", "1") != "0"


def row_bucket(m: int) -> int:
    return 1 << max(m - 1, 0).bit_length()


def has_tuned(n: int, k: int) -> bool:
    """Whether some row count of weight shape [n, k] takes the kernel."""
    return ENABLED and any(key[1:] == (n, k) for key in TUNED)


def tuned_config(m: int, n: int, k: int) -> SkinnyConfig | None:
    if m > MAX_M:
        return None
    return TUNED.get((row_bucket(m), n, k))


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, config: SkinnyConfig, gated: bool = False,
                out: torch.Tensor | None = None, norm: tuple | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_M, rows may be strided), w [N, K] contiguous -> y [M, N] in x.dtype.

    gated: x is [M, 2K] = [gate | up] and y = (silu(gate) * up) @ w.T (the MLP's down projection
    with the SiLU-and-mul folded in).
    norm: (residual [M, K], norm_weight [K], eps, residual_out [M, K]): y = rmsnorm(x + residual) *
    norm_weight @ w.T, and residual_out receives x + residual (the decoder layer's fused add + norm
    folded into the projection after it)."""
    M, K = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    N = w.shape[0]
    if M > MAX_M or w.shape[1] != K or (gated and x.shape[1] != 2 * K):
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} and w {tuple(w.shape)}: expected x [M <= {MAX_M}, "
                         f"{'2K' if gated else 'K'}] and w [N, K]")
    if gated and norm is not None:
        raise ValueError("skinny_gemm: gated and norm do not combine")
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    if norm is not None:
        residual, norm_weight, eps, residual_out = norm
        if residual.shape != x.shape or residual_out.shape != x.shape or norm_weight.shape != (K,):
            raise ValueError(f"skinny_gemm norm: residual {tuple(residual.shape)}, residual_out "
                             f"{tuple(residual_out.shape)} and norm weight {tuple(norm_weight.shape)} must match x "
                             f"{tuple(x.shape)}")
        # The kernel reads the norm weight at unit stride and writes residual_out [M, K] at its row
        # stride with unit columns: a strided weight view was read as the wrong elements, and a
        # column-strided residual_out was written in the wrong places, both without an error.
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
        norm_weight = norm_weight if norm_weight.stride(0) == 1 else norm_weight.contiguous()
        if residual_out.stride(1) != 1 or residual_out.device != x.device:
            raise ValueError(f"skinny_gemm norm: residual_out must be on {x.device} with unit-stride columns, "
                             f"got stride {residual_out.stride()} on {residual_out.device}")
    else:
        residual, norm_weight, eps, residual_out = x, x, 0.0, x
    # out is written at [M, N] with its row stride and unit columns: an out of another shape was
    # written out of bounds (heap corruption on the CPU), a column-strided one scrambled.
    if out is not None and (out.shape != (M, N) or out.stride(1) != 1 or out.device != x.device):
        raise ValueError(f"skinny_gemm: out: expected [{M}, {N}] with unit-stride columns on {x.device}, "
                         f"got {tuple(out.shape)} stride {out.stride()} on {out.device}")
    y = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    if M == 0:
        return y
    block_m = max(16, triton.next_power_of_2(M)) if config.use_dot else triton.next_power_of_2(M)
    block_k = min(config.block_k, max(16, triton.next_power_of_2(K)))
    grid = (triton.cdiv(N, config.block_n),)
    pdl_kwargs = pdl.launch_kwargs(x.device)
    even_k = K % block_k == 0
    preload = preload_slices(config.block_n, block_k, K, config.num_warps) if pdl_kwargs["PDL"] else 0
    _skinny_gemm_kernel[grid](
        x, w, y, residual, norm_weight, residual_out, M, N, K,
        x.stride(0), w.stride(0), y.stride(0), residual.stride(0), residual_out.stride(0), eps,
        GATED=gated, NORM=norm is not None, USE_DOT=config.use_dot, EVEN_K=even_k,
        # fp32 stays exact (tf32 would lose 13 mantissa bits); bf16/fp16 dots ignore the setting.
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, PRELOAD=preload,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_kwargs)
    return y


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear, except for few-row CUDA inputs of a tuned shape, which take the skinny kernel."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] > 0:
        config = tuned_config(x.shape[0], w.shape[0], w.shape[1])
        if config is not None and x.dtype == w.dtype:
            return skinny_gemm(x, w, config)
    return torch.nn.functional.linear(x, w)


def prologue_config(m: int, n: int, k: int) -> SkinnyConfig | None:
    """The tuned config if a prologue (GATED, NORM) may fold into it: CUDA-core configs only.

    The prologues were measured in the model on the CUDA-core path only (Qwen3-0.6B at one row:
    1,070 -> 1,031 us of GPU a step). With tensor-core configs they made Qwen3-8B's batch-1 step
    2.6x slower (P1 full_decode 4.97 -> 12.9 ms, docs/PERF.md session 3, last call), and batch
    2-16 steps of 0.6B slower too; there the two-kernel path runs (projection still skinny)."""
    config = tuned_config(m, n, k)
    return config if config is not None and not config.use_dot else None


def silu_mul_linear(gate_up: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, then @ w.T: one skinny launch for few-row CUDA inputs of a tuned shape,
    else kernels/activation.py's SiLU-and-mul and `linear` (the same numbers either way)."""
    if gate_up.is_cuda and gate_up.dim() == 2 and gate_up.shape[0] > 0:
        config = prologue_config(gate_up.shape[0], w.shape[0], w.shape[1])
        if config is not None and gate_up.dtype == w.dtype:
            return skinny_gemm(gate_up, w, config, gated=True)
    return linear(silu_and_mul(gate_up), w)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * norm_weight @ w.T, x + residual): one skinny launch for few-row CUDA
    inputs of a tuned shape, else kernels/norm.py's fused add + norm and F.linear."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] > 0:
        config = prologue_config(x.shape[0], w.shape[0], w.shape[1])
        if config is not None and x.dtype == w.dtype == residual.dtype:
            residual_out = torch.empty_like(x)
            y = skinny_gemm(x, w, config, norm=(residual, norm_weight, eps, residual_out))
            return y, residual_out
    h, residual_out = add_rms_norm(x, residual, norm_weight, eps)
    return linear(h, w), residual_out
