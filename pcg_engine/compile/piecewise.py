"""The compiled forward: one Dynamo trace with a symbolic token count, served to the runner.

`CompiledForward(model, split=...)` is what `runner.forward_fn` becomes in the compiled modes. On
the first call it marks dim 0 of input_ids and positions *unbacked* (`mark_unbacked`), so Dynamo
traces once for every T >= 1 and later batch sizes pass its guards. With `graphs` (a GraphPool)
every compiled piece is wrapped in a `GraphedPiece` and the forward tells the pool this call's
token count, which is the bucket: the runner pads each step to one.

With graphs, a forward at a captured bucket runs that bucket's replay program once its first
forward has recorded one (replay_program.py): the same graphs and launches without Dynamo's guard
evaluation and the split module's Python.

Why unbacked rather than `mark_dynamic`: a dynamic (backed) size still gets Dynamo's 0/1
specialisation, so a trace at T >= 2 guards on T >= 2 and a one-token call traced a second graph;
the set-up used to pad every single decode to two tokens instead, which cost the projections a
2-row GEMM each (about 1 us apiece on the H200, 112 a Qwen3-0.6B step). An unbacked size is never
assumed 0 or 1 and gets no size guard, only a runtime assert T >= 0 in the graph. The price is
that the trace cannot branch on T (nothing of the model or its custom ops' fake kernels does: T
only flows into shapes) and that Inductor has no real value of T for its heuristics: the mark
passes the trace's own T (the largest bucket) as `hint_override`, the hint a backed size would
have had; without it Inductor would use `torch._inductor.config.unbacked_symint_fallback` (8192).

T = 0 never reaches the compiled graph (the runner has no empty step); it runs the eager model.
"""

import contextlib
import functools
import time
import types
import warnings

import torch

from pcg_engine.compile import replay_program, saved_trace
from pcg_engine.compile.backend import CompileStats, PcgBackend
from pcg_engine.compile.cuda_graph import GraphedPiece, GraphPool
from pcg_engine.compile.replay_program import RecordingOp, ReplayProgram, Tape

MIN_TRACED_TOKENS = 1     # the smallest T the compiled graph serves (the unbacked dim covers 1)


def _own_forward(model):
    """model.forward, as a method of a function with a copy of its code object of its own.

    Dynamo keeps what it compiles for a function on the code object (cache entries, guards, and
    through them the graph, its FakeTensors and the backend). With the class's own code object,
    every engine of a process compiled without the saved trace (compile_cache=False, PCG_SAVED_TRACE=0)
    added an entry there that closing the engine never removed: ~8,000 objects kept for each
    closed engine, and the 65th start failed with FailOnRecompileLimitHit (the limit raised below).
    A copy lives as long as its engine's CompiledForward, and its entries go with it."""
    bound = model.forward
    func = bound.__func__
    own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    own.__kwdefaults__, own.__qualname__, own.__module__ = func.__kwdefaults__, func.__qualname__, func.__module__
    return types.MethodType(own, model)


def _raise_recompile_limit(at_least: int = 64):
    """Each runner's model is a new `self` for the same forward code (_own_forward copies it per
    runner, but a runner may trace more than once: a saved trace that failed to load, then a plain
    trace); Dynamo's per-code limit (8) would silently fall back."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            if getattr(config, name) < at_least:
                setattr(config, name, at_least)
            return


class CompiledForward:
    def __init__(self, model, split: bool = True, graphs: GraphPool | None = None, buckets=(),
                 splitting_ops=None):
        self.model = model
        self.graphs = graphs
        wrap = wrap_op = None
        if graphs is not None and graphs.enabled:
            def wrap(compiled, index, key):
                return GraphedPiece(compiled, index, graphs, buckets, key)
            if replay_program.ENABLED:
                def wrap_op(op):
                    return RecordingOp(op, graphs)
        # Replay programs need the recording ops (replay_program.py); the pool may also be shared
        # with graphs of another kind (the full decode graphs), which record nothing.
        self.programs = graphs is not None and wrap_op is not None
        self.backend = PcgBackend(splitting_ops=splitting_ops, split=split, wrap_piece=wrap,
                                  wrap_splitting=wrap_op)
        _raise_recompile_limit()
        with saved_trace.aot_enabled() if saved_trace.enabled() else contextlib.nullcontext():
            self._compiled = torch.compile(_own_forward(model), backend=self.backend, fullgraph=True, dynamic=False,
                                           options={"guard_filter_fn": saved_trace.guard_filter})
        self._forward = self._compiled      # what a call after the first runs (a loaded trace: its function)
        self.first_call_s: float | None = None
        self.eager_calls = 0
        # Set by the set-up before the first call (compile cache on): (path of the cache entry's
        # saved trace, "load" on a cache hit or "save" on a miss); saved_trace.py.
        self.saved_trace: tuple | None = None
        self.saved_trace_loaded = False
        self.saved_trace_error: str | None = None
        self.saved_trace_written: str | None = None   # the file this start wrote (the cache signs it)

    @property
    def stats(self):
        return self.backend.stats

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[0]
        if T < MIN_TRACED_TOKENS:
            self.eager_calls += 1
            return self.model.forward(input_ids, positions)
        if self.graphs is not None:
            self.graphs.num_tokens = T
        if self.first_call_s is None:
            t0 = time.perf_counter()
            try:
                out = self._first_call(input_ids, positions)
            finally:
                if self.graphs is not None:
                    self.graphs.num_tokens = None
            self.first_call_s = time.perf_counter() - t0
            return out
        if self.programs:
            return self._graphed(input_ids, positions, T)
        try:
            return self._forward(input_ids, positions)
        finally:
            if self.graphs is not None:
                self.graphs.num_tokens = None

    def _first_call(self, input_ids, positions):
        """Dynamo's trace and the backend's compile; or, with a saved trace to load, its load.
        A failed load or save warns and the start goes on (compile/saved_trace.py)."""
        path, action = self.saved_trace or (None, None)
        # A failed attempt removes the graphed pieces it registered, from here on (_forget_load).
        pieces_before = len(self.graphs.pieces) if self.graphs is not None else 0
        if action == "load":
            out = self._load(path, input_ids, positions, pieces_before)
            if out is not None:
                return out
            action = "save"       # a fresh trace replaces the file that failed
        # Mark on the trace only: an unbacked dim installs no size guard, so later calls of any T
        # pass without marks (and a loaded trace's guards want none). Separate symbols for the
        # two tensors, as mark_dynamic gave: nothing in the model combines them outside a custom
        # op, so no equality is ever needed (a shared shape_id would only add a runtime assert).
        # (Imported here: the set-up times Dynamo's import as part of the compile.)
        from torch._dynamo.decorators import mark_unbacked
        T = input_ids.shape[0]
        mark_unbacked(input_ids, 0, hint_override=T)
        mark_unbacked(positions, 0, hint_override=T)
        if action == "save":
            traced = self._trace_to_save(path, input_ids, positions, pieces_before)
            if traced is not None:
                self._forward = functools.partial(traced.fn, self.model)
                return self._forward(input_ids, positions)
        return self._compiled(input_ids, positions)

    def _load(self, path, input_ids, positions, pieces_before: int):
        """The first forward through the saved trace at path, or None (nothing of it left) when
        it cannot be loaded or refuses this start's tensors."""
        try:
            traced = saved_trace.load(path, self.backend)
            out = traced(self.model, input_ids, positions)   # checks the guards, once
        except Exception as e:
            self._saved_trace_failed(f"saved trace {path} not loaded, tracing instead", e, pieces_before)
            return None
        self.saved_trace_loaded = True
        self._forward = functools.partial(traced.fn, self.model)
        return out

    def _trace_to_save(self, path, input_ids, positions, pieces_before: int):
        """Dynamo's AOT trace, written to path; None when it could not be made (the caller then
        traces as without a saved trace). A trace that cannot be written is used unsaved."""
        self.backend.saving = True
        try:
            traced = saved_trace.trace(self._compiled, (input_ids, positions))
        except Exception as e:
            self._saved_trace_failed("could not trace for a saved trace, tracing without", e, pieces_before)
            return None
        finally:
            self.backend.saving = False
        try:
            saved_trace.save(traced, path)
            self.saved_trace_written = path
        except Exception as e:
            saved_trace.remove(path)
            self.saved_trace_error = f"not saved: {type(e).__name__}: {e}"
            warnings.warn(f"saved trace not written to {path}: {e!r}")
        return traced

    def _saved_trace_failed(self, what: str, error: Exception, pieces_before: int) -> None:
        self.saved_trace_error = f"{type(error).__name__}: {error}"
        warnings.warn(f"{what}: {error!r}")
        self._forget_load(pieces_before)

    def _forget_load(self, pieces_before: int) -> None:
        """After a failed load or AOT trace, nothing of it for the trace that follows: the
        backend's artifacts, counters and split module, the graphed pieces it registered."""
        backend = self.backend
        backend.artifacts.clear()
        backend.stats = CompileStats()
        backend.split_module, backend.submodules = None, []
        if self.graphs is not None:
            del self.graphs.pieces[pieces_before:]

    def _graphed(self, input_ids, positions, T):
        """A forward with piecewise graphs: the bucket's replay program if it has one, else the
        traced forward, recorded into a program when every piece replays (replay_program.py)."""
        pool = self.graphs
        program = pool.programs.get(T)
        if program is not None and not (pool.capturing or pool.passthrough or pool.debug):
            pool.num_tokens = None
            if program.accepts(input_ids, positions):
                return program.run(pool)
            pool.num_tokens = T
        record = program is None and not (pool.capturing or pool.passthrough or pool.debug)
        if record:
            pool.tape = Tape()
        try:
            out = self._forward(input_ids, positions)
        finally:
            pool.num_tokens = None
            tape, pool.tape = pool.tape, None
        if record:
            program = ReplayProgram.build(tape, out, input_ids, positions)
            if program is not None:
                pool.programs[T] = program
        return out

    def dump_graph(self, directory):
        return self.backend.dump_graph(directory)
