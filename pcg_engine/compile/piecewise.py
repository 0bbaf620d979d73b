"""The compiled forward: one Dynamo trace with a symbolic token count, served to the runner.

`CompiledForward(model, split=...)` is what `runner.forward_fn` becomes in the compiled modes. It
marks dim 0 of input_ids and positions dynamic on the first call, so Dynamo traces once for
every T >= 2 and later batch sizes only evaluate guards. With `graphs` (a GraphPool) every compiled
piece is wrapped in a `GraphedPiece` and the forward tells the pool this call's token count, which
is the bucket: the runner pads each step to one.

T = 1: Dynamo specialises sizes 0 and 1, so a one-token call would trigger a second trace. The
set-up never lets one reach this forward (the smallest token bucket it gives the runner is 2, so a
single decode is padded to two tokens); should one arrive anyway it runs the eager model.
"""

import time

import torch

from pcg_engine.compile.backend import PcgBackend
from pcg_engine.compile.cuda_graph import GraphedPiece, GraphPool

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
        wrap = None
        if graphs is not None and graphs.enabled:
            def wrap(compiled, index, key):
                return GraphedPiece(compiled, index, graphs, buckets)
        self.backend = PcgBackend(splitting_ops=splitting_ops, split=split, wrap_piece=wrap)
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
        try:
            return self._compiled(input_ids, positions)
        finally:
            if self.graphs is not None:
                self.graphs.num_tokens = None

    def dump_graph(self, directory):
        return self.backend.dump_graph(directory)
