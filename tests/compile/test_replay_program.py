"""Replay programs (compile/replay_program.py): what a tape becomes, what a program runs and in which
order, when it must not exist. CPU: graphs are stand-ins that log their replays; the real graphs are
covered by the GPU tests (test_cuda_graphs.py: programs recorded, run, equal to eager)."""

import pytest
import torch

import pcg_engine.attention.op  # noqa: F401  (registers torch.ops.pcg.attention)
from pcg_engine.attention.context import ForwardContext, set_forward_context
from pcg_engine.compile.backend import EagerOp
from pcg_engine.compile.replay_program import RecordingOp, ReplayProgram, Tape


class FakeGraph:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def replay(self):
        self.log.append(self.name)


class FakePool:
    def __init__(self):
        self.tape = None
        self.replays = 0


def _op(log, target=None):
    def kernel(q, kv_cache, out):
        log.append(("kernel", q.data_ptr(), kv_cache.data_ptr(), out.data_ptr()))
    # the submodule passes (out, q, kv_cache); the op takes (q, kv_cache, out)
    return EagerOp(target or torch.ops.pcg.attention.default, kernel, lambda inputs: (inputs[1], inputs[2], inputs[0]))


def _layers(n, shape=(4, 2, 8)):
    return [tuple(torch.randn(shape) for _ in range(3)) for _ in range(n)]


def _record(log, layers, op, output):
    """The tape of a forward graph 0, op, graph 1, op, ..., graph L (output: graph L's)."""
    pool = FakePool()
    pool.tape = Tape()
    recording = RecordingOp(op, pool)
    graphs = [FakeGraph(f"g{i}", log) for i in range(len(layers) + 1)]
    for i, (q, kv, out) in enumerate(layers):
        pool.tape.replayed(graphs[i], (q,))
        recording(out, q, kv)
    pool.tape.replayed(graphs[-1], (output, torch.zeros(1)))
    return pool, pool.tape


def _program(n):
    """A program recorded from a forward of n layers: (log, layers, output, pool, program)."""
    log = []
    layers = _layers(n)
    output = torch.randn(4, 16)
    pool, tape = _record(log, layers, _op(log), output)
    return log, layers, output, pool, ReplayProgram.build(tape, output, torch.zeros(4), torch.zeros(4))


class FakeCalls:
    """launch_plan.LayerCalls' shape: per layer, (fn, args) pairs the program calls as fn(*args)."""

    def __init__(self, calls):
        self.calls, self.part = calls, "the step's partial buffer"


class FakeBackend:
    def __init__(self, log, bind=True):
        self.log, self.bind, self.made = log, bind, []
        self.bound = None

    def layer_calls(self, meta, q, kv_cache, out, layers, last=None):
        self.made.append((meta, q, kv_cache, out, layers, last))
        if not self.bind:
            return None
        if last is None:      # the program's last binding is served again, as AttentionPlan.for_layers does
            self.bound = FakeCalls([((self.log.append, (("launch",) + ptrs,)),) for ptrs in layers])
            return self.bound
        return last


def test_program_replays_and_calls_in_recorded_order():
    log = []
    layers = _layers(3)
    output = torch.randn(4, 16)
    pool, tape = _record(log, layers, _op(log), output)
    ids, pos = torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)
    program = ReplayProgram.build(tape, output, ids, pos)
    assert program is not None and program.graphs == 4 and program.accepts(ids, pos)
    assert not program.accepts(ids.clone(), pos)
    recorded = list(log)  # the recording forward itself: ops called through, graphs untouched
    assert recorded == [("kernel", q.data_ptr(), kv.data_ptr(), out.data_ptr()) for q, kv, out in layers]

    # A backend without layer_calls: every op runs its kernel on the recorded tensors.
    log.clear()
    with set_forward_context(ForwardContext(object(), [], object())):
        assert program.run(pool) is output
    expected = []
    for i, (q, kv, out) in enumerate(layers):
        expected += [f"g{i}", ("kernel", q.data_ptr(), kv.data_ptr(), out.data_ptr())]
    assert log == expected + ["g3"] and pool.replays == 4 and program.runs == 1


def test_bound_layer_calls_replace_every_kernel_in_order():
    """With the backend's binding, a step is one flat list: each graph's replay, each layer's bound
    launch in its place, no op kernel; the binding is asked for once a step with the program's own
    layer addresses (one tuple for its life), and the flat list is reused while the binding is."""
    log, layers, output, pool, program = _program(4)
    backend = FakeBackend(log)
    meta = object()
    flats = []
    for _ in range(2):
        log.clear()
        with set_forward_context(ForwardContext(meta, [], backend)):
            assert program.run(pool) is output
        expected = []
        for i, (q, kv, out) in enumerate(layers):
            expected += [f"g{i}", ("launch", q.data_ptr(), kv.data_ptr(), out.data_ptr())]
        assert log == expected + ["g4"]
        flats.append(program._flat)
        assert backend.bound.part is None    # the step's partial buffer is let go after the step
        backend.bound.part = "next step's"
    assert len(backend.made) == 2 and flats[0] is flats[1]
    (m, q, kv, out, addresses, last), _ = backend.made
    assert m is meta and (q, kv, out) == layers[0] and last is None
    assert backend.made[1][5] is backend.bound          # the program passed its own last binding
    assert addresses is backend.made[1][4] and addresses == tuple(tuple(t.data_ptr() for t in layer) for layer in layers)
    assert pool.replays == 10 and program.runs == 2


def test_a_new_binding_replaces_the_flat_list():
    """The split count changed (another plan), or its buffers moved: the backend binds anew, and the
    step runs the new binding's calls, not the last step's."""
    log, layers, output, pool, program = _program(2)
    backend = FakeBackend(log)
    for kind in ("launch", "rebound"):
        if kind == "rebound":
            backend.layer_calls = lambda meta, q, kv, out, addresses, last=None: FakeCalls(
                [((log.append, (("rebound",) + ptrs,)),) for ptrs in addresses])
        log.clear()
        with set_forward_context(ForwardContext(object(), [], backend)):
            program.run(pool)
        assert [e[0] for e in log if isinstance(e, tuple)] == [kind, kind]


def test_without_a_binding_every_layer_runs_its_kernel():
    """No plan yet for the step's host values (or a profiler's hooks): the op kernels run as
    recorded, each layer in its place; the next step with a binding launches through it."""
    log, layers, output, pool, program = _program(3)
    backend = FakeBackend(log, bind=False)
    for bind, kind in [(False, "kernel"), (True, "launch")]:
        backend.bind = bind
        log.clear()
        with set_forward_context(ForwardContext(object(), [], backend)):
            program.run(pool)
        expected = []
        for i, (q, kv, out) in enumerate(layers):
            expected += [f"g{i}", (kind, q.data_ptr(), kv.data_ptr(), out.data_ptr())]
        assert log == expected + ["g3"]


def test_no_binding_for_mixed_shapes_or_other_ops():
    log = []
    layers = _layers(2) + _layers(1, shape=(4, 2, 16))
    output = torch.randn(4, 16)
    pool, tape = _record(log, layers, _op(log), output)
    program = ReplayProgram.build(tape, output, torch.zeros(4), torch.zeros(4))
    assert program is not None and program.attention is None
    backend = FakeBackend(log)
    with set_forward_context(ForwardContext(object(), [], backend)):
        program.run(pool)
    assert backend.made == [] and sum(1 for e in log if e[0] == "kernel") == 2 * 3   # recording + run

    other = torch.ops.pcg.rope_kv_write.default
    pool, tape = _record(log, _layers(2), _op(log, target=other), output)
    assert ReplayProgram.build(tape, output, torch.zeros(4), torch.zeros(4)).attention is None


@pytest.mark.parametrize("case", ["other", "graph_code_op", "ends_with_op", "output_not_a_graph_output",
                                  "output_reshaped", "empty"])
def test_no_program_where_its_result_would_differ(case):
    log = []
    layers = _layers(2)
    output = torch.randn(4, 16)
    op = _op(log)
    if case == "graph_code_op":
        op = lambda *inputs: ()   # noqa: E731 - a splitting submodule run as graph code
    pool, tape = _record(log, layers, op, output)
    if case == "other":
        tape.other()              # e.g. a piece ran compiled (not captured at this size)
    elif case == "ends_with_op":
        tape.called(_op(log), (layers[0][2], layers[0][0], layers[0][1]))
    elif case == "output_not_a_graph_output":
        output = output.clone()   # computed after the last graph: would be frozen
    elif case == "output_reshaped":
        output = output.view(16, 4)
    elif case == "empty":
        tape = Tape()
    assert ReplayProgram.build(tape, output, torch.zeros(4), torch.zeros(4)) is None
