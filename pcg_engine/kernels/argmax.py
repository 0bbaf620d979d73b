"""Greedy sampling's argmax over the vocabulary, in two passes that spread a row over many programs.

torch.argmax reduces each row in one thread block. At batch 1 that is one SM reading Qwen3's
151,936 logits (8.7 µs on the H200, session 5's piecewise profile, ~1% of a 0.93 ms step); at
batch 256 the rows fill the GPU, but the reduction kernel still runs well under the copy bandwidth.
Here pass 1 gives each program a CHUNK of one row (grid rows x chunks: 75 programs at batch 1)
and writes that chunk's maximum and the index of its first occurrence; pass 2, one program a row,
picks the first chunk holding the row's maximum. Chunks are in index order, so ties resolve to the
lowest index, as torch.argmax documents. NaN counts as larger than every number (torch.argmax
returns a NaN's index too); a row holding both NaN and +inf may name either.
"""

import os

import torch
import triton
import triton.language as tl

CHUNK = 2048
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
    if x.stride(1) != 1:
        x = x.contiguous()
    R, V = x.shape
    out = torch.empty(R, dtype=torch.int64, device=x.device)
    if R == 0:
        return out
    num_chunks = triton.cdiv(V, CHUNK)
    vals = torch.empty((R, num_chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((R, num_chunks), dtype=torch.int32, device=x.device)
    _chunk_max_kernel[(R, num_chunks)](x, vals, idx, V, x.stride(0), num_chunks, CHUNK=CHUNK, num_warps=4)
    _pick_chunk_kernel[(R,)](vals, idx, out, num_chunks, CHUNKS_PAD=triton.next_power_of_2(num_chunks),
                             num_warps=1)
    return out


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The engine's all-greedy sampling: these kernels for CUDA logits, torch.argmax elsewhere."""
    if ENABLED and logits.is_cuda and logits.dim() == 2:
        return argmax_rows(logits)
    return logits.argmax(dim=-1)


def warm_up(width: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compile both kernels at start-up for the LM head's [R, width] logits (one variant a model:
    R sets only the grids), so the first greedy step does not stall on a compile."""
    if ENABLED and device.type == "cuda":
        argmax_rows(torch.zeros((1, width), dtype=dtype, device=device))
