"""A step's staged inputs sent to the device by the CUDA driver directly, without `Tensor.copy_`.

Every step sends its staged words from pinned host memory to the device buffer (step_buffers.py).
Through `Tensor.copy_` that costs ATen's dispatch, its TensorIterator set-up and the pinned
allocator's event record besides the driver's own `cuMemcpyHtoDAsync`; here the engine calls that
through ctypes, with addresses computed once per view size (the buffers never move). Measured on
the H200's host (scripts/bench_host_calls.py, docs/PERF.md session 25): 3.9-4.0 µs a call by
copy_ against 2.6-4.3 by the driver at the host's normal speed, 8.5-17.9 against 4.9-14.7 when the
host runs slow: a few µs of a ~240 µs P4 step, most where the host is slow. (Device-to-device
copies gained nothing this way, ~0.5 µs, the driver running a copy kernel there: they stay copy_.)

What copy_ gave and this keeps: the copy is ordered on the current stream of the buffers' device,
and a copy from pinned memory is an asynchronous DMA. What it drops is the pinned allocator's
event, which keeps a *freed* pinned block from reuse while a copy still reads it: the staging is
the engine's for its lifetime (double-buffered against the steps in flight, step_buffers.py), and
a copy still in flight when an engine is dropped writes only into device buffers dropped with it
(their blocks go back to the caching allocator on the same stream, after the copy).

Where this cannot serve, the caller copies with copy_ as before: not CUDA, no driver library, the
thread's current device is not the buffers' (the driver copies within the current context), or
the driver refused the call (a non-zero return; copy_ then raises the device's error in torch's
words if there is one). PCG_DRIVER_COPY=0 turns it off (an A/B switch, read at construction).
"""

from __future__ import annotations

import ctypes
import os

import torch

_get_device = getattr(torch._C, "_cuda_getDevice", None)
_get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _driver_function():
    """cuMemcpyHtoDAsync_v2 with its argument types, or None."""
    try:
        h2d = ctypes.CDLL("libcuda.so.1").cuMemcpyHtoDAsync_v2
    except (OSError, AttributeError):
        return None
    # (CUdeviceptr dst, const void* src, size_t bytes, CUstream stream) -> CUresult
    h2d.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    h2d.restype = ctypes.c_int
    return h2d


class DriverCopy:
    """Host-to-device copies on the current stream of one CUDA device, by the driver."""

    def __init__(self, index: int, h2d):
        self.index = index
        self._h2d = h2d

    def host_to_device(self, spans) -> bool:
        """spans: (device address, pinned host address, bytes) for each copy. Returns whether it
        issued every copy; False means the caller must copy by torch (what was issued, if
        anything, is repeated by that copy, so nothing is lost)."""
        if _get_device() != self.index:        # the driver copies within the current context
            return False
        stream, h2d = _get_stream(self.index), self._h2d
        for dst, src, n in spans:
            if h2d(dst, src, n, stream):
                return False
        return True


def for_device(device: torch.device) -> DriverCopy | None:
    """The device's driver copies, or None where copies go through torch (see the module text)."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("PCG_DRIVER_COPY", "1") == "0":
        return None
    if _get_device is None or _get_stream is None:
        return None
    h2d = _driver_function()
    if h2d is None:
        return None
    return DriverCopy(device.index if device.index is not None else torch.cuda.current_device(), h2d)
