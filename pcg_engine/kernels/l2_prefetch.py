"""L2 prefetch: start pulling a projection's weight into the GPU's L2 before the GEMM that reads it.

Why: a batch-1 decode step of Qwen3-8B reads 16 GB of weights in GEMMs that run near the copy
ceiling, but between them sit ~15 µs a layer of small latency-bound kernels (norms, RoPE + KV write,
attention and its merge, SiLU-and-mul) during which the memory bus is idle: ~0.6 ms of a 4.56 ms
token (docs/PERF.md, session 19's kernel table). A prefetch issued when the small kernels start
lets DRAM fill L2 (50 MB on an H200) with the next weight meanwhile, so the GEMM reads part of it
from L2. The kernel only issues the requests: prefetch instructions hold no register and wait for
nothing, so its programs exit at once and the fill goes on behind the kernels after it.

Two ways to ask, by `mode`:
- "line": one `prefetch.global.L2::evict_last` per 128-byte line (many instructions, any size);
- "bulk": one `cp.async.bulk.prefetch.L2` (Hopper's copy engine, sm_90+) per CHUNK bytes.

No reference to test against: a prefetch changes no value. What a test can check is that it leaves
every tensor as it was and runs inside a CUDA graph; the figures are in docs/PERF.md. Off (a no-op)
on the CPU, under Triton's interpreter (inline PTX) and below sm_90.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pcg_engine.kernels import pdl
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
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


_sinks: dict[torch.device, torch.Tensor] = {}


def _sink(device: torch.device) -> torch.Tensor:
    if device not in _sinks:
        _sinks[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _sinks[device]


def prefetch(t: torch.Tensor, nbytes: int | None = None, mode: str = "bulk", chunk: int = CHUNK,
             pdl_ok: bool = True) -> None:
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
                              **(pdl.launch_kwargs(t.device) if pdl_ok else {"PDL": False}))


# Where the model asks (models/qwen3.py), an A/B switch read at import while it is measured:
# PCG_L2_PREFETCH= (off) | o (the first O_BYTES of o_proj's weight before RoPE + attention) | all
# (also the first GAP_BYTES of gate_up before the norm, of down before SiLU, of qkv before the
# layer's input norm). The requests go on a side stream, joined before the GEMM (`join`): on the
# GEMMs' stream a prefetch kernel lasts as long as its transfer (session 20, call 1).
PLAN = os.environ.get("PCG_L2_PREFETCH", "").replace("0", "")
PLAN_MODE = os.environ.get("PCG_L2_PREFETCH_MODE", "line")
O_BYTES = int(float(os.environ.get("PCG_L2_PREFETCH_O_MB", "16")) * (1 << 20))
# what the bus moves in the gap: the norm's ~2.8 µs and SiLU's ~1.6 µs at ~4 TB/s
GAP_BYTES = {"norm": 12 << 20, "silu": 6 << 20}
_side: dict[torch.device, torch.cuda.Stream] = {}
_pending: list[torch.cuda.Stream] = []


def ahead(weight: torch.Tensor, gap: str) -> None:
    """Prefetch (part of) the weight of the projection after the small kernels of `gap`
    ("attention", "norm" or "silu"), as PLAN says. Eager forwards only: never traced."""
    if not PLAN or torch.compiler.is_compiling() or not weight.is_cuda or not available(weight.device):
        return
    if gap != "attention" and PLAN != "all":
        return
    size = weight.numel() * weight.element_size()
    nbytes = min(size, O_BYTES if gap == "attention" else GAP_BYTES[gap])
    main = torch.cuda.current_stream(weight.device)
    side = _side.setdefault(weight.device, torch.cuda.Stream(weight.device))
    side.wait_stream(main)
    with torch.cuda.stream(side):
        prefetch(weight, nbytes, mode=PLAN_MODE, pdl_ok=False)
    _pending.append(side)


def join() -> None:
    """The current stream waits for the prefetches asked since the last join (before a GEMM)."""
    if not PLAN or torch.compiler.is_compiling():
        return
    while _pending:
        torch.cuda.current_stream().wait_stream(_pending.pop())
