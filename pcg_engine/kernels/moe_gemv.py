"""Fused MoE for a few tokens: each routed (token, expert) pair is a GEMV, with no alignment.

At decode batch sizes most experts get no token and the chosen ones one each, so the MoE layer is
a weight-streaming problem. The grouped GEMM (kernels/fused_moe.py) pays for its generality there:
two alignment kernels, a 16-row block for each single real row, programs for the empty blocks that
only exit, and a third kernel that sums the top-k outputs. At Qwen3-30B-A3B's shapes and one token
it took 35.6 µs against the 17.8 µs that reading the 8 experts' weights once takes (docs/PERF.md,
session 4), and no tile choice moved it (session 3's sweep). Here, two launches:

  up   grid (N*k, cdiv(I, BLOCK_N)): program (a, j) reads expert ids[a]'s gate and up rows of
       block j and writes act[a] = silu(x[a // k] @ Wg.T) * (x[a // k] @ Wu.T)  (rounded once)
  down grid (N, cdiv(D, BLOCK_N)): program (t, j) sums weight[t, s] * (act[t*k + s] @ W2[e].T)
       over the token's k slots in fp32 and rounds once: the top-k sum needs no kernel of its own

Both grids depend on (N, k, I, D) only, never on the routing, so a captured graph replays for any
routing. The products run on the CUDA cores (a broadcast multiply and a sum over K, as the skinny
GEMM's one-row configs do): with one row a tensor-core tile would be 15/16 padding.

What it gives up: an expert chosen by several tokens has its weights read once per token (from
L2 when their programs run together), so it pays only while N*k is small against the number of
experts; `fused_moe` takes this path up to GEMV_MAX_ASSIGNMENTS routed pairs. Compared with the
grouped GEMM, the down projection's output is rounded once after the top-k sum instead of once
per slot and again after the sum: closer to the fp32 reference, not bit-equal to the other path.
So the switch should fall on a token bucket: eager steps run their real token count and graphed
steps their bucket's, and a step on either side of the switch would take different paths in the
two (as the grouped GEMM's own tile table does at its rows-per-expert limits). At the default
buckets (1, 2, 4, 8, 16, ...) it does: 8 tokens at top-8, 32 at top-2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pcg_engine import switches
from pcg_engine.kernels import pdl, triton_interpreting
from pcg_engine.kernels.pdl import gdc_launch_dependents, gdc_wait

# Routed pairs (tokens x top_k) up to which fused_moe takes this path. Measured on the H200 at
# Qwen3-30B-A3B's shapes (128 experts, top-8; docs/PERF.md, session 34, call 3): the grouped GEMM
# takes 1.27x / 1.15x / 1.08x this path's time at 1 / 4 / 8 tokens, 0.95x at 16.
GEMV_MAX_ASSIGNMENTS = 64
# PCG_MOE_GEMV=0: the grouped GEMM at every size (an A/B switch for benchmarks, read at import; the
# compile cache's key covers PCG_* switches).
ENABLED = switches.read("PCG_MOE_GEMV", "1") != "0"
# With PDL, the k-slices of expert rows the down launch loads before gdc_wait (0-2; see its kernel):
# its weight stream then overlaps the up launch's tail. Qwen3-30B-A3B's first 8 layers, P1
# full_decode on the H200 (docs/PERF.md, session 36, call 2), ms a token, alternated twice:
# 0 slices 0.574 / 0.571, one 0.569 / 0.568, two 0.574 / 0.577 (86 registers against 72: fewer
# programs resident). PCG_MOE_DOWN_PRELOAD is the A/B switch (read at import).
DOWN_PRELOAD = max(0, min(2, int(switches.read("PCG_MOE_DOWN_PRELOAD", "1"))))


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# (up, down) for bf16 on the H200, from scripts/bench_kernels.py's sweep of each launch alone at 1
# and 4 tokens of Qwen3-30B-A3B (session 34, call 2): up 19.0 / 51.6 µs (1.6x / 1.2x its floor; the
# other tiles 18.9-23.8 / 51.6-60.4), down 11.0 / 31.4 µs (1.9x / 1.5x; others 12.5-26.1 / 33.3-66.4).
UP = GemvConfig(2, 1024, 4, 3)
DOWN = GemvConfig(2, 256, 4, 3)


# Under Triton's CPU interpreter: column blocks as wide as the matrix (at most 64). There the cost
# follows the number of programs, and the table's 2-column blocks made the tiny MoE model's CPU
# tests 8x slower than the grouped GEMM.
INTERPRETED = GemvConfig(64, 64, 4, 1)


def gemv_configs(inter: int, hidden: int) -> tuple[GemvConfig, GemvConfig]:
    """Tiles for the up launch ([I, D] per gate / up) and the down launch ([D, I]): the table's (or
    INTERPRETED's), shrunk to the power-of-two-rounded matrices. Depends on the weights' shapes
    only (the token count sets only the grids)."""
    up, down = (INTERPRETED, INTERPRETED) if triton_interpreting() else (UP, DOWN)
    return _fit(up, inter, hidden), _fit(down, hidden, inter)


def _fit(cfg: GemvConfig, n: int, k: int) -> GemvConfig:
    p2 = triton.next_power_of_2
    return GemvConfig(min(cfg.block_n, p2(n)), min(cfg.block_k, p2(k)), cfg.num_warps, cfg.num_stages)


def takes_gemv(num_tokens: int, top_k: int) -> bool:
    return ENABLED and 0 < num_tokens * top_k <= GEMV_MAX_ASSIGNMENTS


@triton.jit
def _moe_gemv_up_kernel(x_ptr, w_ptr, ids_ptr, act_ptr, N, K, top_k, stride_xm, stride_we, stride_wn, stride_am,
                        EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """act[a, cols] = silu(x[t] @ W[e, cols].T) * (x[t] @ W[e, N + cols].T), t = a // top_k, e = ids[a]."""
    if PDL:  # kernels/pdl.py: the expert comes from the router, x from the norm: nothing before the wait
        gdc_wait()
        gdc_launch_dependents()
    a = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + a).to(tl.int64)
    token = a // top_k
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Wrapping the weight rows keeps every weight load in bounds without a row mask; the store masks.
    wn = (cols % N).to(tl.int64)
    w_ptrs = w_ptr + expert * stride_we + wn[:, None] * stride_wn + rk[None, :]
    up_offset = N.to(tl.int64) * stride_wn
    x_ptrs = x_ptr + token.to(tl.int64) * stride_xm + rk
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs).to(tl.float32)
            wg = tl.load(w_ptrs)
            wu = tl.load(w_ptrs + up_offset)
        else:
            k_ok = rk < K - k0 * BLOCK_K
            x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            wg = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            wu = tl.load(w_ptrs + up_offset, mask=k_ok[None, :], other=0.0)
        gate += tl.sum(wg.to(tl.float32) * x[None, :], axis=1)
        up += tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + a.to(tl.int64) * stride_am + cols, act.to(act_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _slots_dot(acc, w, x):
    """acc [slot, column] += one k-slice's products: w [slot, column, k], x [slot, k]."""
    return acc + tl.sum(w.to(tl.float32) * x.to(tl.float32)[:, None, :], axis=2)


@triton.jit
def _moe_gemv_down_kernel(act_ptr, w_ptr, ids_ptr, scale_ptr, y_ptr, N, K, top_k, stride_am, stride_we, stride_wn,
                          stride_ym, EVEN_K: tl.constexpr, TOP_K_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, PRELOAD: tl.constexpr, PDL: tl.constexpr):
    """y[t, cols] = sum over slots s of scale[t*k + s] * (act[t*k + s] @ W[ids[t*k + s], cols].T).

    With PDL the ids and weights (the routing's, two launches back) and the first PRELOAD k-slices
    of the experts' rows load before gdc_wait; only the act rows (the up launch's) wait. This keeps
    kernels/pdl.py's rule, transitively: this grid is launched only once every program of the up
    launch has signalled, and each signals after its own gdc_wait, which returns once the routing
    kernel has completed and its writes are visible (at L2: the loads are .cg, past L1)."""
    tl.static_assert(PDL or PRELOAD == 0, "PRELOAD needs PDL: the k loop starts after the preloaded slices")
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    wn = (cols % N).to(tl.int64)
    # All k slots in one [slot, column, k] tile: a loop over the slots (one expert's few rows at a
    # time) kept too few bytes in flight, each program waiting for memory k times as often
    # (docs/PERF.md, session 34: 42 against 37 us for the grouped GEMM at one token).
    slots = tl.arange(0, TOP_K_PAD)
    slot_ok = slots < top_k
    assignment = t * top_k + slots
    experts = tl.load(ids_ptr + assignment, mask=slot_ok, other=0, cache_modifier=".cg").to(tl.int64)
    scales = tl.load(scale_ptr + assignment, mask=slot_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    a_ptrs = act_ptr + assignment[:, None] * stride_am + rk[None, :]
    w_ptrs = w_ptr + experts[:, None, None] * stride_we + wn[None, :, None] * stride_wn + rk[None, None, :]
    w_ok = slot_ok[:, None, None]
    if PRELOAD >= 1:   # the launcher passes PRELOAD only for EVEN_K and at most K's slices
        w0 = tl.load(w_ptrs, mask=w_ok, other=0.0)
    if PRELOAD >= 2:
        w1 = tl.load(w_ptrs + BLOCK_K, mask=w_ok, other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros((TOP_K_PAD, BLOCK_N), dtype=tl.float32)
    if PRELOAD >= 1:
        acc = _slots_dot(acc, w0, tl.load(a_ptrs, mask=slot_ok[:, None], other=0.0))
    if PRELOAD >= 2:
        acc = _slots_dot(acc, w1, tl.load(a_ptrs + BLOCK_K, mask=slot_ok[:, None], other=0.0))
    a_ptrs += PRELOAD * BLOCK_K
    w_ptrs += PRELOAD * BLOCK_K
    for k0 in range(PRELOAD, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(a_ptrs, mask=slot_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=w_ok, other=0.0)
        else:
            k_ok = rk < K - k0 * BLOCK_K
            x = tl.load(a_ptrs, mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=w_ok & k_ok[None, None, :], other=0.0)
        acc = _slots_dot(acc, w, x)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = tl.sum(acc * scales[:, None], axis=0)
    tl.store(y_ptr + t * stride_ym + cols, out.to(y_ptr.dtype.element_ty), mask=cols < N)


def fused_moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, configs: tuple[GemvConfig, GemvConfig] | None = None) -> torch.Tensor:
    """fused_moe's contract (x [N, D], w13 [E, 2I, D], w2 [E, D, I], topk_* [N, k]; inputs checked
    and made unit-stride there) through the two GEMV launches."""
    n, top_k = topk_ids.shape
    _, two_i, d = w13.shape
    up, down = configs or gemv_configs(two_i // 2, d)
    # Both made contiguous before the up launch: a copy kernel between the two launches would end
    # the chain that lets the down launch read them before its gdc_wait (its kernel says why).
    ids, scales = topk_ids.reshape(-1).contiguous(), topk_weights.reshape(-1).contiguous()
    act = launch_up(x, w13, ids, top_k, up)
    return launch_down(act, w2, ids, scales, top_k, down)


def launch_up(x, w13, ids, top_k: int, cfg: GemvConfig) -> torch.Tensor:
    """The up launch alone (the kernel benchmark times each): act [N*k, I] for flat ids [N*k]."""
    _, two_i, d = w13.shape
    inter = two_i // 2
    act = torch.empty((ids.numel(), inter), dtype=x.dtype, device=x.device)
    _moe_gemv_up_kernel[(ids.numel(), triton.cdiv(inter, cfg.block_n))](
        x, w13, ids, act, inter, d, top_k, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        EVEN_K=d % cfg.block_k == 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_kwargs(x.device))
    return act


def launch_down(act, w2, ids, scales, top_k: int, cfg: GemvConfig) -> torch.Tensor:
    """The down launch alone: y [N, D] from act [N*k, I], flat ids and router weights [N*k]."""
    _, d, inter = w2.shape
    n = ids.numel() // top_k
    y = torch.empty((n, d), dtype=act.dtype, device=act.device)
    pdl_kwargs = pdl.launch_kwargs(act.device)
    even_k = inter % cfg.block_k == 0
    preload = min(DOWN_PRELOAD, inter // cfg.block_k) if pdl_kwargs["PDL"] and even_k else 0
    _moe_gemv_down_kernel[(n, triton.cdiv(d, cfg.block_n))](
        act, w2, ids, scales, y, d, inter, top_k, act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        EVEN_K=even_k, TOP_K_PAD=triton.next_power_of_2(top_k), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRELOAD=preload, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs)
    return y
