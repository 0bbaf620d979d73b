"""A decode step's inputs to the device in one kernel: its staged words and its block-table appends.

A step's inputs are one range of int64 words in pinned host staging (engine/step_buffers.py), sent
by one `Tensor.copy_`, and, in a run of decode steps, a few (flat index, block id) appends to the
device block table, written after it (kernels/scatter.py). On the P4 host path (one step's host
work, no model) the copy_ was among the dearest calls a step makes: ATen's copy set-up, the pinned
allocator's event and the driver's memcpy cost ~10-20 µs of host time on the H200's host, where a
launch recorded by kernels/fast_launch.py costs a few. Here one kernel reads the words straight
from the pinned staging (a kernel reaches pinned memory at the address kernels/argmax.pinned_address
gives) and writes them to the device buffer, and applies the appends, reading their pairs from the
staging too: the device copy of the pairs is written by the same launch, with no order between
programs, so they cannot be read from there.

Stream order is what it was with the copy: the kernel reads the staging when it runs, as the copy
engine did, and the staging stays double-buffered for that (step_buffers.py). The copied words and
the appended table entries never overlap: a step that sends its block table whole has no appends.
n and k are not specialised (`do_not_specialize`): one recorded launch a grid serves every step.
"""

import torch
import triton
import triton.language as tl

from pcg_engine.kernels import fast_launch

BLOCK = 512


@triton.jit(do_not_specialize=["n", "k"])
def _upload_kernel(dst_ptr, src_ptr, n, table_ptr, index_ptr, value_ptr, k, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    words = i < n
    tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=words), mask=words)
    pairs = i < k
    where = tl.load(index_ptr + i, mask=pairs, other=0)
    tl.store(table_ptr + where, tl.load(value_ptr + i, mask=pairs, other=0), mask=pairs)


def upload(dst: torch.Tensor, src: torch.Tensor, table: torch.Tensor, index: torch.Tensor, value: torch.Tensor,
           k: int, addresses: tuple[int, int, int]) -> None:
    """dst[:] = src (int64 words: a CUDA buffer, its pinned staging), then table[index[:k]] =
    value[:k] (a flat CUDA int32 table, the pairs in pinned staging). addresses: the kernel
    addresses of src, index and value (argmax.pinned_address)."""
    n = dst.numel()
    if not (src.numel() == n and dst.dtype == src.dtype == index.dtype == torch.int64 and value.dtype == table.dtype
            and len(index) >= k and len(value) >= k and dst.is_cuda and table.is_cuda):
        raise ValueError("step_upload.upload: expected CUDA int64 dst, pinned int64 src of its size, a CUDA table "
                         f"and at least k={k} pairs")
    grid = max(-(-n // BLOCK), -(-k // BLOCK), 1)
    ptrs = (dst.data_ptr(), addresses[0], n, table.data_ptr(), addresses[1], addresses[2], k)
    key = (fast_launch.current_device(), table.dtype, grid, not (ptrs[0] | ptrs[1] | ptrs[3] | ptrs[4] | ptrs[5]) & 15)
    if fast_launch.ENABLED:
        plan = _PLANS.get(key)
        if plan is not None and not fast_launch.jit_only():
            plan(fast_launch.current_stream(key[0]), ptrs)
            return
    # The JIT takes the pinned tensors themselves (it finds their kernel addresses); the record, the
    # addresses, passed per call.
    args, kw = (dst, src, n, table, index, value, k), dict(BLOCK=BLOCK, num_warps=4)
    compiled = _upload_kernel[(grid,)](*args, **kw)
    if fast_launch.ENABLED:
        plan = fast_launch.record(_upload_kernel, compiled, (grid,), (dst, dst, n, table, dst, table, k), kw, slots=7)
        if plan is not None:
            _PLANS.put(key, plan)


# (device, table dtype, grid, pointers 16-byte aligned) -> the recorded launch.
_PLANS = fast_launch.LaunchCache(64)


def warm_up(device: torch.device) -> None:
    """Compile the kernel at start-up (its one variant: int32 table, aligned pointers), so that the
    first decode step does not stall on a compile."""
    from pcg_engine.kernels.argmax import pinned_address
    if torch.device(device).type != "cuda":
        return
    src = torch.zeros(2 * BLOCK, dtype=torch.int64, pin_memory=True)
    address = pinned_address(src)
    if address is None:
        return                                   # step_buffers.py then copies as before
    table = torch.zeros(BLOCK, dtype=torch.int32, device=device)
    pairs = src[BLOCK:]                          # index 0, value 0 (its int32 view)
    upload(torch.zeros(BLOCK, dtype=torch.int64, device=device), src[:BLOCK], table, pairs, pairs.view(torch.int32), 1,
           (address, address + 8 * BLOCK, address + 8 * BLOCK))
