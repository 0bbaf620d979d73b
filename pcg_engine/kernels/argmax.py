"""Greedy sampling's argmax over the vocabulary, in two passes that spread a row over many programs.

torch.argmax reduces each row in one thread block. At batch 1 that is one SM reading Qwen3's
151,936 logits (8.7 µs on the H200, session 5's piecewise profile, ~1% of a 0.93 ms step); at
batch 256 the rows fill the GPU, but the reduction kernel still runs well under the copy bandwidth.
Here pass 1 gives each program a CHUNK of one row (grid rows x chunks: 75 programs at batch 1)
and writes that chunk's maximum and the index of its first occurrence; pass 2, one program a row,
picks the first chunk holding the row's maximum. Chunks are in index order, so ties resolve to the
lowest index, as torch.argmax documents. NaN counts as larger than every number (torch.argmax
returns a NaN's index too); a row holding both NaN and +inf may name either.

The engine calls this once a step outside any CUDA graph, so its host cost is on the step's path:
two launches through Triton's JIT cost ~50 µs on the H200's host (P4, session 6: the host-only step
at 16 requests went 0.12 -> 0.19 ms when this replaced torch.argmax). A repeated call therefore
re-issues the launches the first call of its shape recorded (kernels/fast_launch.py), the three
pointers of each passed per call, keyed on everything else the launches take (device, dtype, rows,
width, row stride). The pointers must be 16-byte aligned, the class the record was made with; an
unaligned x goes through the JIT.
"""

import os

import torch
import triton
import triton.language as tl

from pcg_engine.kernels import fast_launch

CHUNK = 2048
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)   # exact in the kernel's fp32 compare
# PCG_TRITON_ARGMAX=0: greedy steps take torch.argmax (an A/B switch for benchmarks, read at import).
ENABLED = os.environ.get("PCG_TRITON_ARGMAX", "1") != "0"


@triton.jit
def _chunk_max_kernel(x_ptr, val_ptr, idx_ptr, V, stride_x, num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN first, as torch.argmax has it
    best, where = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, chunk * CHUNK + where)


@triton.jit
def _pick_chunk_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, CHUNKS_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_PAD)
    vals = tl.load(val_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    _, first = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    index = tl.load(idx_ptr + row * num_chunks + first)
    tl.store(out_ptr + row, index.to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] (last dim contiguous) -> int64 [R]: the index of each row's first maximum.

    A row of only -inf gives 0, as torch.argmax does."""
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"argmax_rows: expected [R, V] with V > 0, got {tuple(x.shape)}")
    # The kernel compares in fp32: float64 (or integer) values that differ below fp32's precision
    # became ties and the first of them won (float64 [[1, 1 + 1e-12]] gave 0, torch.argmax 1).
    if x.dtype not in _DTYPES:
        raise ValueError(f"argmax_rows: expected float32, float16 or bfloat16 logits, got {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    R, V = x.shape
    out = torch.empty(R, dtype=torch.int64, device=x.device)
    if R == 0:
        return out
    num_chunks = -(-V // CHUNK)
    # One scratch allocation: the chunk maxima (fp32), then their indices (int32) from a 16-byte
    # boundary, so both keep the alignment class their recorded launch was made with.
    idx_at = -(-R * num_chunks // 4) * 4
    scratch = torch.empty(idx_at + R * num_chunks, dtype=torch.float32, device=x.device)
    x_p, s_p, o_p = x.data_ptr(), scratch.data_ptr(), out.data_ptr()
    i_p = s_p + idx_at * 4
    key = None
    if fast_launch.ENABLED and not (x_p | s_p | o_p) & 15:
        key = (fast_launch.current_device(), x.dtype, R, V, x.stride(0))
        plan = _PLANS.get(key)
        if plan is not None and not fast_launch.jit_only():
            stream = fast_launch.current_stream(key[0])
            plan[0](stream, (x_p, s_p, i_p))
            plan[1](stream, (s_p, i_p, o_p))
            return out
    vals = scratch[:R * num_chunks].view(R, num_chunks)
    idx = scratch[idx_at:].view(torch.int32).view(R, num_chunks)
    args1 = (x, vals, idx, V, x.stride(0), num_chunks)
    kw1 = dict(CHUNK=CHUNK, num_warps=4)
    args2 = (vals, idx, out, num_chunks)
    kw2 = dict(CHUNKS_PAD=triton.next_power_of_2(num_chunks), num_warps=1)
    if key is None:
        _chunk_max_kernel[(R, num_chunks)](*args1, **kw1)
        _pick_chunk_kernel[(R,)](*args2, **kw2)
        return out
    first = fast_launch.jit_launch(_chunk_max_kernel, (R, num_chunks), args1, kw1, slots=3)
    second = fast_launch.jit_launch(_pick_chunk_kernel, (R,), args2, kw2, slots=3)
    if first is not None and second is not None:
        _PLANS.put(key, (first, second))
    return out


# (device, dtype, R, V, row stride) -> the two recorded launches. R is the step's row count: a
# few dozen live values in a serving run.
_PLANS = fast_launch.LaunchCache(256)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The engine's all-greedy sampling: these kernels for CUDA logits, torch.argmax elsewhere."""
    if ENABLED and logits.is_cuda and logits.dim() == 2 and logits.dtype in _DTYPES:
        return argmax_rows(logits)
    return logits.argmax(dim=-1)


def warm_up(width: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compile both kernels at start-up for the LM head's [R, width] logits (one variant a model:
    R sets only the grids), so the first greedy step does not stall on a compile."""
    if ENABLED and device.type == "cuda":
        argmax_rows(torch.zeros((1, width), dtype=dtype, device=device))
