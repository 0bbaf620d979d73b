"""Greedy sampling's argmax over the vocabulary, one launch whose programs split each row.

torch.argmax reduces each row in one thread block. At batch 1 that is one SM reading Qwen3's
151,936 logits (8.7 µs on the H200, session 5's piecewise profile, ~1% of a 0.93 ms step); at
batch 256 the rows fill the GPU, but the reduction kernel still runs well under the copy bandwidth.
Here each program takes a CHUNK of one row (grid rows x chunks: 75 programs at batch 1) and
writes that chunk's maximum and the index of its first occurrence; the row's last program to
finish (an atomic counter a row, in the caller's ArgmaxWorkspace) picks the first chunk holding the
row's maximum. (Until session 24 a second launch, one program a row, did that: on the P4 host path
it cost a launch and a scratch allocation a step.) Chunks are in index order, so ties resolve to the
lowest index, as torch.argmax documents. NaN counts as larger than every number (torch.argmax
returns a NaN's index too); a row holding both NaN and +inf may name either.

The engine calls this once a step outside any CUDA graph, so its host cost is on the step's path:
two launches through Triton's JIT cost ~50 µs on the H200's host (P4, session 6: the host-only step
at 16 requests went 0.12 -> 0.19 ms when they replaced torch.argmax). A repeated call therefore
re-issues the launch the first call of its shape recorded (kernels/fast_launch.py), its six
pointers passed per call, keyed on everything else the launch takes (device, dtype, rows, width,
row stride, whether it writes host memory). The pointers must be 16-byte aligned, the class the
record was made with; an unaligned x goes through the JIT. The engine has the kernel write the
tokens into the read-back's pinned host buffer as well (engine/readback.py): the step then needs no
device-to-host copy of them, one torch call fewer on its host path.
"""

import ctypes

import torch
import triton
import triton.language as tl

from pcg_engine import switches
from pcg_engine.kernels import fast_launch

CHUNK = 2048
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)   # exact in the kernel's fp32 compare
# PCG_TRITON_ARGMAX=0: greedy steps take torch.argmax (an A/B switch for benchmarks, read at import).
ENABLED = switches.read("PCG_TRITON_ARGMAX", "1") != "0"


@triton.jit
def _argmax_kernel(x_ptr, val_ptr, idx_ptr, count_ptr, out_ptr, host_ptr, V, stride_x, num_chunks,
                   CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr, HOST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN first, as torch.argmax has it
    best, where = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, chunk * CHUNK + where)
    # The row's last program to get here picks its chunk. The barrier puts every thread's stores
    # before the atomic, whose release makes them visible to the program that acquires after it.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")
    if arrived == num_chunks - 1:
        c = tl.arange(0, CHUNKS_PAD)
        # .cg: read from L2, where the other programs' stores are, never a stale L1 line.
        vals = tl.load(val_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"),
                       cache_modifier=".cg")
        _, first = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
        index = tl.load(idx_ptr + row * num_chunks + first, cache_modifier=".cg")
        tl.store(out_ptr + row, index.to(tl.int64))
        if HOST:                           # pinned host memory too: the read-back needs no copy
            tl.store(host_ptr + row, index.to(tl.int64))
        tl.store(count_ptr + row, 0)       # zero again for the next launch


class ArgmaxWorkspace:
    """What the kernel keeps between its programs, for up to max_rows rows of up to `width`
    logits: each chunk's maximum and its index, and one arrival counter a row, zero between
    launches (the row's last program resets it). An engine keeps one, so that a step allocates
    nothing: its launches are ordered on one stream, and two launches sharing the counters at once
    (two engines, two streams) would break them, so the workspace is not shared.

    It also keeps two output buffers, taken in turn by calls with kept_out (the engine's steps):
    a result then stays valid until the second call after it. An engine step's tokens are read by
    the next step's inputs, on the device, enqueued before that step samples, so two suffice; a
    fresh torch.empty a step cost 2-4 µs of the H200 host's time at its normal speed, ~10 when
    slow (scripts/bench_host_calls.py, docs/PERF.md session 25)."""

    def __init__(self, max_rows: int, width: int, device):
        self.max_rows, self.width = max_rows, width
        chunks = max(max_rows, 1) * -(-max(width, 1) // CHUNK)
        self.vals = torch.empty(chunks, dtype=torch.float32, device=device)
        self.idx = torch.empty(chunks, dtype=torch.int32, device=device)
        self.counts = torch.zeros(max(max_rows, 1), dtype=torch.int32, device=device)
        # Made on the first next_out: a workspace made for one call (argmax_rows without a fitting
        # one) never takes them.
        self._outs: list[torch.Tensor] | None = None
        self._out_views: list[dict] = [{}, {}]
        self._flip = 0

    def next_out(self, rows: int) -> torch.Tensor:
        """The next of the two output buffers, its first `rows` entries (views kept per size)."""
        i = self._flip
        self._flip ^= 1
        view = self._out_views[i].get(rows)
        if view is None:
            with torch.inference_mode(False):    # usable in and out of inference mode
                if self._outs is None:
                    # Two allocations, not one [2, max_rows] tensor: each starts aligned, as the
                    # recorded launch wants.
                    self._outs = [torch.empty(max(self.max_rows, 1), dtype=torch.int64, device=self.counts.device)
                                  for _ in range(2)]
                view = self._out_views[i][rows] = self._outs[i][:rows]
        return view

    def fits(self, x: torch.Tensor) -> bool:
        return x.shape[0] <= self.max_rows and x.shape[1] <= self.width and x.device == self.counts.device


def argmax_rows(x: torch.Tensor, workspace: ArgmaxWorkspace | None = None, host_out: torch.Tensor | None = None,
                host_address: int | None = None, kept_out: bool = False) -> torch.Tensor:
    """x [R, V] (last dim contiguous) -> int64 [R]: the index of each row's first maximum.

    A row of only -inf gives 0, as torch.argmax does. workspace: the caller's (see
    ArgmaxWorkspace); without one, or one too small, a fresh one is made for the call.
    kept_out: the result is written into the workspace's output buffers (valid until the second
    call after this one; see ArgmaxWorkspace) rather than a fresh tensor, where the workspace fits.
    host_out: pinned host memory (int64, >= R entries, CUDA x only) that the kernel writes the
    result into as well, at host_address, the address a kernel reaches it by (engine/readback.py
    finds it); the caller waits for the kernel (an event) before reading it."""
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"argmax_rows: expected [R, V] with V > 0, got {tuple(x.shape)}")
    # The kernel compares in fp32: float64 (or integer) values that differ below fp32's precision
    # became ties and the first of them won (float64 [[1, 1 + 1e-12]] gave 0, torch.argmax 1).
    if x.dtype not in _DTYPES:
        raise ValueError(f"argmax_rows: expected float32, float16 or bfloat16 logits, got {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    R, V = x.shape
    if R == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    if workspace is not None and workspace.fits(x):
        out = workspace.next_out(R) if kept_out else torch.empty(R, dtype=torch.int64, device=x.device)
    else:
        workspace = ArgmaxWorkspace(R, V, x.device)
        out = torch.empty(R, dtype=torch.int64, device=x.device)
    host = host_out is not None
    if host and (host_out.dtype != torch.int64 or len(host_out) < R or host_address is None):
        raise ValueError(f"argmax_rows: host_out must be int64 with >= {R} entries, with its kernel address")
    num_chunks = -(-V // CHUNK)
    ptrs = (x.data_ptr(), workspace.vals.data_ptr(), workspace.idx.data_ptr(), workspace.counts.data_ptr(),
            out.data_ptr(), host_address if host else out.data_ptr())
    key = None
    if fast_launch.ENABLED and not (ptrs[0] | ptrs[4] | ptrs[5]) & 15:     # the workspace's are aligned
        key = (fast_launch.current_device(), x.dtype, R, V, x.stride(0), host)
        plan = _PLANS.get(key)
        if plan is not None and not fast_launch.jit_only():
            plan(fast_launch.current_stream(key[0]), ptrs)
            return out
    # The JIT takes the pinned tensor itself (it finds its kernel address); the record, its address.
    args = (x, workspace.vals, workspace.idx, workspace.counts, out, host_out if host else out, V, x.stride(0),
            num_chunks)
    kw = dict(CHUNK=CHUNK, CHUNKS_PAD=triton.next_power_of_2(num_chunks), HOST=host, num_warps=4)
    if key is None:
        _argmax_kernel[(R, num_chunks)](*args, **kw)
        return out
    compiled = _argmax_kernel[(R, num_chunks)](*args, **kw)
    plan = fast_launch.record(_argmax_kernel, compiled, (R, num_chunks), (*args[:5], out, *args[6:]), kw, slots=6)
    if plan is not None:
        _PLANS.put(key, plan)
    return out


# (device, dtype, R, V, row stride, writes host memory) -> the recorded launch. R is the step's row
# count: a few dozen live values in a serving run.
_PLANS = fast_launch.LaunchCache(256)


def greedy_tokens(logits: torch.Tensor, workspace: ArgmaxWorkspace | None = None) -> torch.Tensor:
    """The engine's all-greedy sampling: this kernel for CUDA logits, torch.argmax elsewhere."""
    if ENABLED and logits.is_cuda and logits.dim() == 2 and logits.dtype in _DTYPES:
        return argmax_rows(logits, workspace)
    return logits.argmax(dim=-1)


def workspace_for(max_rows: int, width: int, device: torch.device, dtype: torch.dtype) -> ArgmaxWorkspace | None:
    """An engine's workspace for its [R <= max_rows, width] logits of `dtype`: None where
    greedy_tokens takes torch.argmax for them, so a workspace means this kernel serves them."""
    if ENABLED and torch.device(device).type == "cuda" and dtype in _DTYPES:
        return ArgmaxWorkspace(max_rows, width, device)
    return None


def warm_up(width: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compile the kernel at start-up for the LM head's [R, width] logits (two variants a model:
    with and without the host write; R sets only the grid), so the first greedy step does not
    stall on a compile."""
    if ENABLED and device.type == "cuda":
        x = torch.zeros((1, width), dtype=dtype, device=device)
        argmax_rows(x)
        host = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        address = pinned_address(host)
        if address is not None:
            argmax_rows(x, host_out=host, host_address=address)


def pinned_address(buf: torch.Tensor) -> int | None:
    """The address at which a CUDA kernel reaches pinned host tensor `buf` (with unified
    addressing, its own), or None where the driver cannot say."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        address = ctypes.c_uint64()
        # CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 2; CUDA_SUCCESS = 0
        if cuda.cuPointerGetAttribute(ctypes.byref(address), 2, ctypes.c_uint64(buf.data_ptr())) != 0:
            return None
        return address.value
    except (OSError, AttributeError):
        return None
