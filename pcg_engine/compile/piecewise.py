"""The compiled forward: one Dynamo trace with a symbolic token count, served to the runner.

`CompiledForward(model, split=...)` is what `runner.forward_fn` becomes in the compiled modes. It
marks dim 0 of input_ids and positions dynamic on the first call, so Dynamo traces once for
every T >= 2 and later batch sizes only evaluate guards. With `graphs` (a GraphPool) every compiled
piece is wrapped in a `GraphedPiece` and the forward tells the pool this call's token count, which
is the bucket: the runner pads each step to one.

With graphs, a forward at a captured bucket runs that bucket's replay program once its first
forward has recorded one (replay_program.py): the same graphs and launches without Dynamo's guard
evaluation and the split module's Python.

T = 1: Dynamo specialises sizes 0 and 1, so a one-token call would trigger a second trace. The
set-up never lets one reach this forward (the smallest token bucket it gives the runner is 2, so a
single decode is padded to two tokens); should one arrive anyway it runs the eager model.
"""

import time

import torch

from pcg_engine.compile import replay_program
from pcg_engine.compile.backend import PcgBackend
from pcg_engine.compile.cuda_graph import GraphedPiece, GraphPool
from pcg_engine.compile.replay_program import RecordingOp, ReplayProgram, Tape

MIN_TRACED_TOKENS = 2


def _raise_recompile_limit(at_least: int = 64):
    """Each runner's model is a new `self` for the same forward code object; tests and benchmarks
    build many runners in one process, and Dynamo's per-code limit (8) would silently fall back."""
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
                return GraphedPiece(compiled, index, graphs, buckets)
            if replay_program.ENABLED:
                def wrap_op(op):
                    return RecordingOp(op, graphs)
        # Replay programs need the recording ops (replay_program.py); the pool may also be shared
        # with graphs of another kind (the full decode graphs), which record nothing.
        self.programs = graphs is not None and wrap_op is not None
        self.backend = PcgBackend(splitting_ops=splitting_ops, split=split, wrap_piece=wrap,
                                  wrap_splitting=wrap_op)
        _raise_recompile_limit()
        self._compiled = torch.compile(model.forward, backend=self.backend, fullgraph=True, dynamic=False)
        self.first_call_s: float | None = None
        self.eager_calls = 0

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
            # Mark on the trace only: later calls pass the guards (2 <= T) without marks.
            torch._dynamo.mark_dynamic(input_ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
            t0 = time.perf_counter()
            try:
                out = self._compiled(input_ids, positions)
            finally:
                if self.graphs is not None:
                    self.graphs.num_tokens = None
            self.first_call_s = time.perf_counter() - t0
            return out
        if self.programs:
            return self._graphed(input_ids, positions, T)
        try:
            return self._compiled(input_ids, positions)
        finally:
            if self.graphs is not None:
                self.graphs.num_tokens = None

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
            out = self._compiled(input_ids, positions)
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
