"""Programmatic dependent launch (PDL): let a decode kernel start while the one before it finishes.

A batch-1 decode step is ~190 small kernels back to back, and each boundary costs the GPU time:
the next grid is scheduled only when the last block of the previous one has exited, and then its
first loads still have to travel to DRAM and back. With PDL (sm_90+), a kernel launched with the
programmatic-serialisation attribute may start as soon as every block of the previous kernel has
signalled `gdc_launch_dependents` (or exited). Correctness then rests on one rule, kept by every
kernel that opts in:

    nothing that depends on an earlier kernel is read, and nothing at all is written,
    before `gdc_wait()`, which returns when the previous grid has completed and its writes are
    visible.

What may come before the wait is what no kernel of the forward writes: the weights, and the step's
metadata (positions, slot mapping, seq_lens, query_start_loc, block table), written before the
forward starts (the input copy and the block-table scatter, ahead of the graph's launch). The skinny
GEMM loads its weight tile there, so a projection's weight stream overlaps the kernel before it.
Decode attention loads its seq_len and block ids there, and asks L2 for its first K/V tiles
(`prefetch_l2`; session 23 measured -1 us a layer): a prefetch keeps no value and no L1 line, and
the KV slot that the RoPE + KV write before it stores lands in L2, the point of coherence, so a
line fetched early is never stale. Data written two launches back is also safe to read early when
the launch in between waits first thing: the MoE GEMV's down launch reads the routing's ids and
weights, and its expert rows, before its wait (kernels/moe_gemv.py), since it is launched only after
every up program has passed its own wait on the routing kernel. The other kernels wait first thing
and gain only the launch. The wait is executed by every program before any early exit, so a kernel
never completes before its predecessor has, and the ordering is transitive along the stream. CUDA
graphs capture the attribute as programmatic edges.

Where: only inside `scope()`, which the full decode graphs' capture enters (compile/full_graph.py),
and since session 14 each piece graph's capture (compile/cuda_graph.py, PIECE_PDL): piecewise
batch-1 decode 1.17-1.23 -> 1.05-1.06 ms a token on the H200.
Measured on the H200 (session 4, call 2, P1 batch-1 decode, with graph split-KV): Qwen3-0.6B
full_decode 1.048 -> 0.965 ms a token, full_and_piecewise 1.049 -> 0.958, and the CUDA-graph
equivalence tests pass with it. With PDL in every launch (call 3), the host-bound modes got slower
instead: piecewise 2.38 -> 3.63 ms (29 piece-graph launches and 28 eager attention launches a
step), eager 11.7 -> 13.0, so launches outside CUDA graphs stay plain.
Off in Triton's CPU interpreter (the instructions are inline PTX), below sm_90, and with PCG_PDL=0
(an A/B switch for benchmarks, read at import). Kernels take a PDL constexpr and their launchers
pass `**launch_kwargs(device)`, so both halves always agree.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pcg_engine import switches
from pcg_engine.kernels import triton_interpreting

__all__ = ["active", "enabled", "launch_kwargs", "scope", "gdc_wait", "gdc_launch_dependents", "prefetch_l2"]

_WANTED = switches.read("PCG_PDL", "1") != "0" and not triton_interpreting()


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the cache line of each pointer (a tensor of them); returns nothing to use. Inline
    PTX: for PDL kernels only (never in Triton's CPU interpreter). is_pure=False keeps the
    compiler from dropping it for its unused result."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


_depth = 0   # scope() nesting: the engine is single-threaded, like the graphs it captures


@contextmanager
def scope():
    """Launches inside use PDL (where it is wanted and the GPU has it)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def active() -> bool:
    """Wanted and inside scope(): all of enabled() but the device, which is fixed per device (the
    cached attention launches key on it, attention/launch_plan.py)."""
    return bool(_WANTED and _depth)


def enabled(device: torch.device) -> bool:
    """Whether kernels launched on `device` now use PDL."""
    if not _WANTED or not _depth or device.type != "cuda":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_kwargs(device: torch.device) -> dict:
    """Extra keyword arguments of a Triton launch: the PDL constexpr and the launch attribute."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}
