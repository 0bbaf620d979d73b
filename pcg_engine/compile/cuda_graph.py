"""CUDA graphs of the compiled pieces, one per token-count bucket, all in one memory pool.

Each compiled piece is wrapped in a `GraphedPiece`. During the capture pass (`GraphPool.capture_phase`,
driven by the set-up running one dummy forward per bucket, largest first) the first call at a
bucket size warms the piece up and records it into a `torch.cuda.CUDAGraph`; afterwards a call at
that size replays the graph. Any other size, any call outside a capture pass for a size without a
graph, and anything on the CPU runs the compiled piece directly.

Warm-ups: identical layers share one compiled piece (the backend's piece key), so at a bucket the
27 middle pieces of Qwen3-0.6B run the same code on the same shapes, with other weights. What a
warm-up is for (compiles, per-stream workspaces, lazy module loads: see `capture`) depends on the
code and the shapes only, so the first piece of a key warms up at a bucket and the others of that
key are captured straight away (`GraphPool.warmed`). Measured before this (session 12,
scripts/bench_capture.py --engine): 406 piece warm-ups, 0.41 s of a warm start's capture.

Why replays need no input copies: piece 0 reads views of the runner's static buffers
(`batch.input_ids[:T]`, same address every step), and every later piece reads outputs of the piece
before it or the attention output it allocated, all of which live in graph-owned memory that the
replay rewrites in place. The other inputs are fixed for the runner's life: the weights, each
layer's KV cache (allocated once; the KV write inside each piece writes it in place, at the slots
of `batch.slot_mapping`, another static buffer, read through the step's metadata) and
`batch.positions[:T]`. `GraphPool.debug` (env PCG_CUDAGRAPH_DEBUG=1) checks that on every replay.

Memory: the graph keeps only non-owning views of its outputs. While one forward runs, the outputs
it still needs are held by the split module's locals, so the allocator cannot hand them to a later
piece's capture; once the forward is over the memory returns to the shared pool, and the next
(smaller) bucket's graphs reuse it. That is safe because forwards never overlap on the stream and
the runner consumes a forward's output before launching the next one. PCG_CUDAGRAPH_STRONG_OUTPUTS=1
keeps the outputs alive instead (every bucket then holds its own activations).
"""

import contextlib
import os
from collections import Counter
from dataclasses import dataclass

import torch

from pcg_engine import switches
from pcg_engine.kernels import pdl

# PDL inside the piece graphs (kernels/pdl.py): the kernels of a piece (o_proj, add + norm + gate_up,
# SiLU + down, add + norm + qkv, RoPE + KV write at decode sizes) are captured with programmatic
# edges, as the full decode graphs' are. Outside the graphs (attention between pieces, the eager
# sizes) launches stay plain. Measured on the H200 (session 14, P1 Qwen3-0.6B piecewise, alternated):
# 1.229 / 1.167 ms a token without, 1.054 / 1.064 with. PCG_PIECE_PDL=0 turns it off (A/B switch,
# read at import).
PIECE_PDL = switches.read("PCG_PIECE_PDL", "1") != "0"


class GraphPool:
    """State shared by every graph of one runner: pool, capture stream, phase, this forward's T."""

    def __init__(self, device: torch.device, debug: bool | None = None):
        self.device = device
        self.enabled = device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.stream = torch.cuda.Stream(device) if self.enabled else None
        self.capturing = False       # graphs are recorded only inside capture_phase()
        self.passthrough = False     # inside a whole-forward capture: pieces run ungraphed
        self.num_tokens: int | None = None   # set by the compiled forward before every call
        self.debug = os.environ.get("PCG_CUDAGRAPH_DEBUG") == "1" if debug is None else debug
        # Keep graph outputs alive instead of non-owning views (more memory; a debugging aid).
        self.strong_outputs = os.environ.get("PCG_CUDAGRAPH_STRONG_OUTPUTS") == "1"
        self.captures: Counter = Counter()   # (piece index, bucket) -> captures (must stay 1)
        self.replays = 0
        # replay_program.py: the tape of the forward being recorded, and each bucket's program
        self.tape = None
        self.programs: dict = {}
        self.pieces: list = []               # every GraphedPiece of this pool (release() empties them)
        self.warmed: set = set()             # (piece key, bucket) already warmed up (module docstring)
        self.warmups = 0                     # piece warm-ups run by captures

    @contextlib.contextmanager
    def capture_phase(self):
        self.programs.clear()   # a program holds the graphs it was recorded with
        self.capturing = True
        try:
            yield self
        finally:
            self.capturing = False

    def release(self) -> None:
        """Drop the graphs and the replay programs (which hold the tensors their ops take, the KV
        caches among them). Dynamo's cache keeps the split module, and through it the pieces and
        this pool, after the runner and its model are gone (checked on the CPU: a weak reference
        to the split module survives LLM.close()), so without this a closed engine would keep its
        graphs' memory and its KV caches. ModelRunner.close() calls it."""
        self.programs.clear()
        self.tape = None
        for piece in self.pieces:
            piece.entries.clear()
        self.pieces.clear()

    @contextlib.contextmanager
    def no_graphs(self):
        """Pieces run compiled but neither capture nor replay (e.g. inside a full-graph capture)."""
        previous, self.passthrough = self.passthrough, True
        try:
            yield
        finally:
            self.passthrough = previous

    def captured_buckets(self) -> Counter:
        """bucket -> number of pieces captured at that size."""
        out = Counter()
        for (_, bucket), n in self.captures.items():
            out[bucket] += n
        return out


def capture(pool: GraphPool, fn, *args, warmups: int = 1):
    """Warm fn up, then record fn(*args) into a new graph in the shared pool; returns (graph, outputs).

    The warm-up runs first, on the capture stream itself: Triton autotuning, lazy cuBLAS handle and
    workspace creation and anything else that syncs or allocates per stream must happen outside
    the capture. capture_begin/end instead of the torch.cuda.graph context: the context runs
    gc.collect() and empty_cache() per capture, which is seconds over hundreds of piece captures
    and would give the shared pool's cached blocks back to the driver between captures.
    """
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream(pool.device)
    pool.stream.wait_stream(current)
    with torch.cuda.stream(pool.stream):
        for _ in range(warmups):
            fn(*args)
        graph.capture_begin(pool=pool.pool)
        try:
            outputs = fn(*args)
        finally:
            graph.capture_end()
    current.wait_stream(pool.stream)
    return graph, outputs


_INT_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}


class _Interface:
    def __init__(self, iface):
        self.__cuda_array_interface__ = iface


def non_owning(t):
    """A tensor at t's address that does not keep t's memory alive (see the module docstring).

    Built through the public __cuda_array_interface__ protocol as a same-width integer tensor and
    reinterpreted, since the protocol has no type string for bfloat16. Anything it cannot express
    is returned as is (a strong reference: correct, only costs memory).
    """
    if not isinstance(t, torch.Tensor) or not t.is_cuda or t.numel() == 0:
        return t
    size = t.element_size()
    if size not in _INT_TYPESTR or t.is_complex():
        return t
    iface = {"shape": tuple(t.shape), "strides": tuple(s * size for s in t.stride()),
             "typestr": _INT_TYPESTR[size], "data": (t.data_ptr(), False), "version": 2}
    try:
        view = torch.as_tensor(_Interface(iface), device=t.device)
        view = view.view(t.dtype)
    except Exception:  # pragma: no cover - keep the strong reference
        return t
    return view if view.data_ptr() == t.data_ptr() else t


def _map(fn, value):
    if isinstance(value, (list, tuple)):
        return type(value)(_map(fn, v) for v in value)
    return fn(value)


def _pointers(args) -> list:
    return [a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args]


@dataclass
class _Entry:
    graph: "torch.cuda.CUDAGraph"
    outputs: object
    input_ptrs: list


class GraphedPiece:
    """A compiled piece with one CUDA graph per bucket of the runtime token count."""

    def __init__(self, compiled, index: int, pool: GraphPool, buckets, key=None):
        self.compiled = compiled
        self.index = index
        self.key = key             # the backend's piece key: pieces with one key run the same code
        self.pool = pool
        self.buckets = set(buckets)
        self.entries: dict[int, _Entry] = {}
        pool.pieces.append(self)

    def __call__(self, *args):
        pool = self.pool
        T = pool.num_tokens
        if not pool.enabled or pool.passthrough or T is None:
            if pool.tape is not None:
                pool.tape.other()
            return self.compiled(*args)
        entry = self.entries.get(T)
        if entry is not None:
            if pool.debug:
                self._check(entry, args, T)
            entry.graph.replay()
            pool.replays += 1
            if pool.tape is not None:
                pool.tape.replayed(entry.graph, entry.outputs)
            return entry.outputs
        if pool.tape is not None:
            pool.tape.other()
        if not (pool.capturing and T in self.buckets):
            return self.compiled(*args)
        warm = self.key is None or (self.key, T) not in pool.warmed
        with pdl.scope() if PIECE_PDL else contextlib.nullcontext():
            graph, outputs = capture(pool, self.compiled, *args, warmups=1 if warm else 0)
        if warm:
            pool.warmups += 1
            if self.key is not None:
                pool.warmed.add((self.key, T))
        graph.replay()  # capture only records: produce this dummy forward's real outputs
        kept = outputs if pool.strong_outputs else _map(non_owning, outputs)
        self.entries[T] = _Entry(graph, kept, _pointers(args))
        pool.captures[(self.index, T)] += 1
        return outputs

    def _check(self, entry, args, T):
        now = _pointers(args)
        if now != entry.input_ptrs:
            bad = [i for i, (a, b) in enumerate(zip(now, entry.input_ptrs)) if a != b]
            raise RuntimeError(f"piece {self.index}, bucket {T}: inputs {bad} are not at the addresses the graph "
                               "was captured with; the runner must pass views of its static buffers")
