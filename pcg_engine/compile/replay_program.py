"""Replay programs: a piecewise forward at a captured bucket as a flat list of graph replays and op calls.

Why: at a captured bucket a piecewise forward does nothing on the host but replay 2L+1 graphs and
launch L attention kernels, yet it reaches them through Dynamo's guards, the split module's
forward, a wrapper per piece and the attention op's per-layer key and plan lookup. On the H200's
host that was 1.31 ms a batch-1 step for Qwen3-0.6B, against ~1.0 ms of GPU work
(scripts/step_timers.py, session 7: attention calls 811 µs for 28 layers, piece replays 196 µs,
the rest ~300 µs), so piecewise decode was host-bound.

How: the first forward at a bucket after its capture runs as usual with a `Tape` on the pool. The
graphed pieces note the graph they replay, the splitting ops (eager_call's EagerOp) the kernel and
the arguments they call it with. When every piece replayed, the tape becomes that bucket's
`ReplayProgram`, and later forwards at the bucket run it instead: replay, call, replay, ... and
return the tensor the recorded forward returned. Same graphs, same kernels, same arguments:

- every tensor a splitting op receives is fixed for the bucket: piece outputs live in graph memory
  that each replay rewrites in place (cuda_graph.py), the KV caches and weights are allocated once;
- the forward's inputs are views of the runner's static buffers (checked by address per run; a
  forward on other buffers takes the traced path);
- what changes per step reaches the graphs through those buffers and the ops through the forward
  context, which the program's op calls read as the traced path's do.

What skipping Dynamo skips: its guards. The program is keyed on the one thing they check that
varies for a runner, the token count; a change they would catch otherwise (a new model, rebound
KV caches) replaces the graphs themselves, and the pool drops every program whenever it captures.

Attention: when every op of the tape is pcg::attention on tensors of one shape (as in every layer
of these models) and the backend offers `layer_calls`, the step's launch plan is looked up once for
all layers and bound to their addresses (launch_plan.LayerCalls), and the program runs as one flat
list of calls: graph replays and Triton's launcher with every argument ready. The binding is kept
while the plan, the stream and the addresses stay (a decode's plan changes only when its split
count does), so a step spends no Python per layer beyond the calls themselves: at batch 1 the
per-layer path (closure, plan, recorded launch: four Python frames) was most of a piecewise step's
host time, ~11 µs a layer under cProfile on the H200's host (docs/PERF.md, session 32). Without a
binding (no plan yet for the step's host values: the first step at a new split count; jit_only, a
profiler's hooks), each layer runs the op's kernel as recorded, which records the plan for the next.

PCG_REPLAY_PROGRAM=0 (read at import) keeps the traced path for every forward (A/B runs).
"""

from __future__ import annotations

import torch

from pcg_engine import switches
from pcg_engine.attention.context import get_forward_context

ENABLED = switches.read("PCG_REPLAY_PROGRAM", "1") != "0"


class Tape:
    """What one forward did, as the graphed pieces and the splitting ops report it."""

    __slots__ = ("steps", "complete", "last_outputs")

    def __init__(self):
        self.steps: list = []      # a CUDAGraph (replayed) or an _OpCall, in order
        self.complete = True       # False once anything ran other than a replay or a recordable op
        self.last_outputs = None   # of the last graph replayed

    def replayed(self, graph, outputs) -> None:
        self.steps.append(graph)
        self.last_outputs = outputs

    def called(self, op, inputs) -> None:
        kernel = getattr(op, "kernel", None)
        if kernel is None:   # a splitting submodule run as graph code: nothing to call directly
            self.complete = False
            return
        self.steps.append(_OpCall(op.target, kernel, op.pick(inputs)))

    def other(self) -> None:
        self.complete = False


class _OpCall:
    __slots__ = ("target", "kernel", "args")

    def __init__(self, target, kernel, args):
        self.target, self.kernel, self.args = target, kernel, args


class RecordingOp:
    """Wraps a splitting op of the split module: reports each call to the pool's tape, if any."""

    __slots__ = ("op", "pool")

    def __init__(self, op, pool):
        self.op, self.pool = op, pool

    def __call__(self, *inputs):
        tape = self.pool.tape
        if tape is not None:
            tape.called(self.op, inputs)
        return self.op(*inputs)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


class ReplayProgram:
    """The recorded forward of one bucket (module docstring)."""

    def __init__(self, steps: list, output, input_ptrs: tuple):
        self.steps = steps
        self.output = output
        self.input_ptrs = input_ptrs
        self.graphs = sum(not isinstance(s, _OpCall) for s in steps)
        self.runs = 0
        ops = [s for s in steps if isinstance(s, _OpCall)]
        self.attention = _uniform_attention(ops)   # (q, kv_cache, out) of the first op, or None
        # Each op's (q, kv_cache, out) addresses, in order: one tuple for the program's life, which
        # its binding (launch_plan.LayerCalls) keeps and recognises by identity.
        self.layers = tuple(tuple(t.data_ptr() for t in s.args) for s in ops) if self.attention is not None else ()
        self._bound = None                         # the last step's LayerCalls (the program's own)
        self._flat, self._flat_for = None, None    # the steps as (fn, args), for one binding's calls

    @classmethod
    def build(cls, tape: Tape, output, input_ids, positions) -> ReplayProgram | None:
        """The program of a recorded forward, or None where its result would not be the forward's."""
        if not tape.complete or not tape.steps or isinstance(tape.steps[-1], _OpCall):
            return None
        # The forward must return a graph output as is: anything computed after the last replay
        # (outside every graph) would be frozen at this step's value.
        if not isinstance(output, torch.Tensor) or not any(_same_view(output, t) for t in _tensors(tape.last_outputs)):
            return None
        return cls(list(tape.steps), output, (input_ids.data_ptr(), positions.data_ptr()))

    def accepts(self, input_ids: torch.Tensor, positions: torch.Tensor) -> bool:
        return (input_ids.data_ptr(), positions.data_ptr()) == self.input_ptrs

    def run(self, pool) -> torch.Tensor:
        bound = self._bound = self._layer_calls()
        if bound is None:
            for step in self.steps:
                if isinstance(step, _OpCall):
                    step.kernel(*step.args)
                else:
                    step.replay()
        else:
            if self._flat_for is not bound.calls:
                self._flat, self._flat_for = self._flatten(bound.calls), bound.calls
            try:
                for fn, args in self._flat:
                    fn(*args)
            finally:
                bound.part = None    # the step's partial buffer: back to the allocator, in stream order
        pool.replays += self.graphs
        self.runs += 1
        return self.output

    def _layer_calls(self):
        """The backend's launches bound to this program's layers for this step, or None."""
        if self.attention is None:
            return None
        context = get_forward_context()
        make = getattr(context.backend, "layer_calls", None) if context.metadata is not None else None
        return make(context.metadata, *self.attention, self.layers, self._bound) if make is not None else None

    def _flatten(self, calls) -> list:
        """The steps as (fn, args): each graph's replay, each op's bound launches in its place."""
        flat, layer = [], 0
        for step in self.steps:
            if isinstance(step, _OpCall):
                flat.extend(calls[layer])
                layer += 1
            else:
                flat.append((step.replay, ()))
        return flat


def _uniform_attention(ops):
    """(q, kv_cache, out) of the first op when every op is pcg::attention on tensors of the same
    shapes, strides and dtypes (one launch plan serves all), else None."""
    if not ops:
        return None
    try:
        target = torch.ops.pcg.attention.default
    except AttributeError:   # pragma: no cover - the op is registered on import of attention.op
        return None
    first = ops[0].args
    if any(len(s.args) != 3 or (s.target is not target and s.target is not torch.ops.pcg.attention)
           for s in ops):
        return None
    meta = [(t.shape, t.stride(), t.dtype, t.device) for t in first]
    for s in ops:
        if [(t.shape, t.stride(), t.dtype, t.device) for t in s.args] != meta:
            return None
    return first
