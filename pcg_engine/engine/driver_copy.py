"""A step's copies to the device issued to the CUDA driver directly, without `Tensor.copy_`.

A decode step of the persistent batch makes two copies on its host path: its staged words from
pinned host memory to the device buffer (step_buffers.py) and, with async scheduling, the previous
step's sampled tokens into its input ids, device to device (input_batch.py). Through
`Tensor.copy_` each costs ATen's dispatch, its TensorIterator set-up and, from pinned memory, the
pinned allocator's event record: ~10-20 µs of host time on the H200's host (session 24's P4
parts: prepare 71 µs of a 354 µs step), where the driver's own `cuMemcpyHtoDAsync` /
`cuMemcpyDtoDAsync` take a few. Here the engine calls those through ctypes, with addresses it
computed once (the buffers never move).

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


def _driver_functions():
    """cuMemcpyHtoDAsync_v2 and cuMemcpyDtoDAsync_v2 with their argument types, or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        h2d, d2d = lib.cuMemcpyHtoDAsync_v2, lib.cuMemcpyDtoDAsync_v2
    except (OSError, AttributeError):
        return None
    # (CUdeviceptr dst, const void* / CUdeviceptr src, size_t bytes, CUstream stream) -> CUresult
    h2d.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    d2d.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    h2d.restype = d2d.restype = ctypes.c_int
    return h2d, d2d


class DriverCopy:
    """Copies on the current stream of one CUDA device, by the driver. Each method returns
    whether it issued everything; False means the caller must copy by torch (what was issued,
    if anything, is repeated by that copy, so nothing is lost)."""

    def __init__(self, index: int, functions):
        self.index = index
        self._h2d, self._d2d = functions

    def _stream(self):
        """The current raw stream, or None where the thread's current device is another."""
        if _get_device() != self.index:
            return None
        return _get_stream(self.index)

    def host_to_device(self, spans) -> bool:
        """spans: (device address, pinned host address, bytes) for each copy."""
        stream = self._stream()
        if stream is None:
            return False
        h2d = self._h2d
        for dst, src, n in spans:
            if h2d(dst, src, n, stream):
                return False
        return True

    def device_to_device(self, dst: int, src: int, nbytes: int) -> bool:
        stream = self._stream()
        return stream is not None and self._d2d(dst, src, nbytes, stream) == 0


def for_device(device: torch.device) -> DriverCopy | None:
    """The device's driver copies, or None where copies go through torch (see the module text)."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("PCG_DRIVER_COPY", "1") == "0":
        return None
    if _get_device is None or _get_stream is None:
        return None
    functions = _driver_functions()
    if functions is None:
        return None
    return DriverCopy(device.index if device.index is not None else torch.cuda.current_device(), functions)
