"""Launching a captured CUDA graph with less host work than `CUDAGraph.replay()`, for replay programs.

Why: a piecewise batch-1 step of Qwen3-0.6B replays 29 piece graphs and is bound by the host's
launch path, not by the GPU: on the H200, 0.88 ms of kernels a step against 1.17-1.21 ms a token
(session 9's `pcg bench profile --requests 1 --kernel-table`, `docs/PERF.md`). `replay()` reaches
cudaGraphLaunch through pybind11 (the GIL released and taken back), a device guard, a driver-version
query and each captured generator's replay prologue; the launch itself is the only part a
replay program needs.

`launcher(graph)` returns a no-argument callable that calls the driver's `cuGraphLaunch` on the
graph's executable and the current stream (ctypes over libcuda.so.1, which every CUDA process has
loaded). Where that is not possible (no `raw_cuda_graph_exec` in this torch, no driver library, an
object that is not a CUDAGraph, PCG_RAW_GRAPH_LAUNCH=0) it returns `graph.replay`.

Contract: the graph holds no random ops. The generator prologue that replay() runs (advancing the
Philox offset of RNG ops captured in the graph) is skipped, so a graph with dropout or sampling
inside would draw the same numbers every launch. Replay programs hold only the model's piece graphs
(the sampler runs outside them), and `launcher` is used nowhere else.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

ENABLED = os.environ.get("PCG_RAW_GRAPH_LAUNCH", "1") != "0"


@functools.lru_cache(maxsize=None)
def _cu_graph_launch():
    """The driver's cuGraphLaunch(CUgraphExec, CUstream) -> CUresult, or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuGraphLaunch
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn


def launcher(graph):
    """A callable that launches `graph` (captured and instantiated) on the current stream."""
    raw_exec = getattr(graph, "raw_cuda_graph_exec", None)
    get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    cu_launch = _cu_graph_launch() if ENABLED and raw_exec is not None and get_stream is not None else None
    if cu_launch is None:
        return graph.replay
    handle = raw_exec()
    if not handle:   # not instantiated (a graph kept for a later instantiate): replay() does that
        return graph.replay
    device = torch.cuda.current_device()

    def launch() -> None:
        rc = cu_launch(handle, get_stream(device))
        if rc:
            raise RuntimeError(f"cuGraphLaunch failed with CUresult {rc} (PCG_RAW_GRAPH_LAUNCH=0 uses "
                               "CUDAGraph.replay instead)")
    launch.graph = graph   # keeps the executable alive as long as its launcher
    return launch
