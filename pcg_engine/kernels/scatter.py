"""flat[index[i]] = value[i] for the first k pairs: the block-table appends of a decode step, one launch.

A run of decode steps at batch 256 appends a block to ~16 rows of the device block table every step
(engine/device_block_table.py), sent as (flat index, block id) pairs in the step's one copy.
`Tensor.index_copy_` wrote them before: correct, but on the P4 host path (no model, one step's
host work) it is one of the few torch calls a step makes, and ATen's argument checks and
TensorIterator set-up cost several µs of host time per call on the H200's host. Here the same write
is a Triton kernel whose launch is recorded once per grid and re-issued directly
(kernels/fast_launch.py), the three pointers and k passed per call.

k is not specialised (`do_not_specialize`): a launch recorded at k = 16 must serve k = 7, and a
Triton kernel specialised for k = 1 or k % 16 == 0 would not. The pairs must not repeat an index
(they do not: one append per row and column), or which value lands is undefined.
"""

import torch
import triton
import triton.language as tl

from pcg_engine.kernels import fast_launch

BLOCK = 256


@triton.jit(do_not_specialize=["k"])
def _scatter_kernel(flat_ptr, index_ptr, value_ptr, k, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < k
    where = tl.load(index_ptr + i, mask=mask, other=0)
    value = tl.load(value_ptr + i, mask=mask, other=0)
    tl.store(flat_ptr + where, value, mask=mask)


def scatter_(flat: torch.Tensor, index: torch.Tensor, value: torch.Tensor, k: int) -> None:
    """flat (1-D, contiguous) [index[:k]] = value[:k]: index int64, value flat's dtype; CUDA
    tensors take this kernel, others index_copy_ (the same result)."""
    if not flat.is_cuda:
        flat.index_copy_(0, index[:k], value[:k])
        return
    if k <= 0:
        return
    if not (flat.dim() == index.dim() == value.dim() == 1 and flat.is_contiguous()
            and index.dtype == torch.int64 and value.dtype == flat.dtype and len(index) >= k and len(value) >= k):
        raise ValueError(f"scatter_: expected 1-D contiguous flat, int64 index and {flat.dtype} value of at least "
                         f"k={k} entries; got {tuple(flat.shape)} {flat.dtype}, {tuple(index.shape)} {index.dtype}, "
                         f"{tuple(value.shape)} {value.dtype}")
    grid = -(-k // BLOCK)
    ptrs = (flat.data_ptr(), index.data_ptr(), value.data_ptr(), k)
    args, kw = (flat, index, value, k), dict(BLOCK=BLOCK, num_warps=4)
    if not fast_launch.ENABLED:
        _scatter_kernel[(grid,)](*args, **kw)
        return
    # Pointer alignment is part of what the JIT specialised the recorded launch on.
    key = (fast_launch.current_device(), flat.dtype, grid, not (ptrs[0] | ptrs[1] | ptrs[2]) & 15)
    plan = _PLANS.get(key)
    if plan is not None and not fast_launch.jit_only():
        plan(fast_launch.current_stream(key[0]), ptrs)
        return
    plan = fast_launch.jit_launch(_scatter_kernel, (grid,), args, kw, slots=4)
    if plan is not None:
        _PLANS.put(key, plan)


# (device, dtype, grid, pointers 16-byte aligned) -> the recorded launch.
_PLANS = fast_launch.LaunchCache(64)


def warm_up(device: torch.device) -> None:
    """Compile the kernel at start-up (its one variant: int32 table, aligned pointers), so that the
    first decode step that appends blocks does not stall on a compile."""
    if torch.device(device).type == "cuda":
        flat = torch.zeros(BLOCK, dtype=torch.int32, device=device)
        scatter_(flat, torch.zeros(1, dtype=torch.int64, device=device), torch.ones(1, dtype=torch.int32, device=device), 1)
