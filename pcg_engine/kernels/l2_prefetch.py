"""L2 prefetch: ask the GPU's L2 for a tensor's bytes ahead of the kernel that reads them.

Why it was built: a batch-1 decode step of Qwen3-8B reads 16 GB of weights in GEMMs that run near
the copy ceiling, but between them sit ~15 µs a layer of small latency-bound kernels (norms, RoPE +
KV write, attention and its merge, SiLU-and-mul) during which the memory bus is idle: ~0.6 ms of a
4.56 ms token (docs/PERF.md, session 19's kernel table). Prefetching the next weight in those gaps
should have let its GEMM read part of it from L2 (50 MB on an H200).

What the H200 said (session 20, scripts/bench_l2_prefetch.py and P1 8B full_decode, docs/PERF.md):
- on the GEMMs' stream a prefetch kernel lasts about as long as its transfer (it stalls issuing
  until the memory system takes the requests), so it only moves time around: +3.5 to +34 µs a layer;
- on a side stream joined before the GEMM, prefetching o_proj's weight gained nothing (its split-K
  GEMM is not bound by DRAM), and the first MBs of gate_up / down / qkv gained ~3 µs a layer in the
  stand-in; but in the model the fork and join cost more: 4.544 -> 4.699 ms (o) and 4.758 ms (all).
So the model does not use it. It stays as the bench's tool, for a later attempt that folds the
requests into an existing kernel's spare programs instead of a kernel or a stream of their own.

Two ways to ask, by `mode`:
- "line": one `prefetch.global.L2::evict_last` per 128-byte line (many instructions, any size);
- "bulk" / "bulk_evict_last": one `cp.async.bulk.prefetch.L2` (sm_90+) per `chunk` bytes. With few
  programs this was the slowest (each SM's copy engine takes its share in turn).

No reference to test against: a prefetch changes no value. What a test can check is that it leaves
every tensor as it was and runs inside a CUDA graph. Off (a no-op) on the CPU, under Triton's
interpreter (inline PTX) and below sm_90.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pcg_engine.kernels import pdl, triton_interpreting
from pcg_engine.kernels.pdl import gdc_launch_dependents, gdc_wait

LINE = 128            # bytes a line prefetch asks for
CHUNK = 64 * 1024     # bytes a bulk prefetch asks for
PER_PROGRAM = 128     # requests a program issues (one a thread at 4 warps)
MODES = ("line", "bulk", "bulk_evict_last")

_LINE_ASM = tl.constexpr("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;")
_BULK_ASM = tl.constexpr("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;")
# evict_last: the weight should outlive whatever the small kernels read before its GEMM
_BULK_EL_ASM = tl.constexpr("{ .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                             "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }")


@triton.jit
def _l2_prefetch_kernel(base, nbytes, sink, STEP: tl.constexpr, PER_PROGRAM: tl.constexpr,
                        MODE: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # kernels/pdl.py: wait so that the stream's order stays transitive, then let the next start
        gdc_wait()
        gdc_launch_dependents()
    offs = (tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)).to(tl.int64) * STEP
    # inline asm has no mask: requests past the end repeat the last one, which lies inside
    offs = tl.minimum(offs, nbytes - STEP)
    ptrs = base + offs
    if MODE == 0:
        done = tl.inline_asm_elementwise(_LINE_ASM, "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
    elif MODE == 1:
        size = tl.full([PER_PROGRAM], STEP, tl.int32)
        done = tl.inline_asm_elementwise(_BULK_ASM, "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        size = tl.full([PER_PROGRAM], STEP, tl.int32)
        done = tl.inline_asm_elementwise(_BULK_EL_ASM, "=r,l,r", [ptrs, size], dtype=tl.int32,
                                         is_pure=False, pack=1)
    # Never stores (every `done` is 0); it keeps the asm's result used in any compiler.
    total = tl.sum(done, axis=0)
    tl.store(sink, total, mask=total != 0)


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def available(device: torch.device) -> bool:
    """Whether prefetch() does anything on `device`."""
    if device.type != "cuda" or triton_interpreting():
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


_sinks: dict[torch.device, torch.Tensor] = {}


def _sink(device: torch.device) -> torch.Tensor:
    if device not in _sinks:
        _sinks[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _sinks[device]


def prefetch(t: torch.Tensor, nbytes: int | None = None, mode: str = "line", chunk: int = CHUNK) -> None:
    """Ask L2 for the first `nbytes` (all by default) of t's bytes in memory order. t must be
    contiguous, or the transpose of a contiguous 2-D tensor (models/fuse.py's store_transposed)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if not t.is_contiguous() and t.dim() == 2 and t.t().is_contiguous():
        t = t.t()
    if not t.is_contiguous():
        raise ValueError(f"t: expected a contiguous tensor or its transpose, got strides {t.stride()}")
    size = t.numel() * t.element_size()
    nbytes = size if nbytes is None else nbytes
    if not 0 <= nbytes <= size:
        raise ValueError(f"nbytes: expected 0..{size} (t's bytes), got {nbytes}")
    if mode != "line":   # a bulk request's address and size are multiples of 16 bytes
        if chunk % 16 or chunk <= 0:
            raise ValueError(f"chunk: expected a positive multiple of 16 bytes, got {chunk}")
        nbytes -= nbytes % 16
    step = LINE if mode == "line" else chunk
    if nbytes < step or not available(t.device):
        return
    grid = (triton.cdiv(nbytes, step * PER_PROGRAM),)
    _l2_prefetch_kernel[grid](t.view(-1).view(torch.uint8), nbytes, _sink(t.device), STEP=step,
                              PER_PROGRAM=PER_PROGRAM, MODE=MODES.index(mode), num_warps=4,
                              **pdl.launch_kwargs(t.device))
