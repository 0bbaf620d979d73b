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


class FakeBackend:
    def __init__(self, log, accept, plans_after=0):
        self.log, self.accept, self.made = log, accept, []
        self.plans_after = plans_after   # calls that find no plan yet (None) before one exists

    def layer_launcher(self, meta, q, kv_cache, out):
        self.made.append((meta, q, kv_cache, out))
        if len(self.made) <= self.plans_after:
            return None

        def launch(q_p, cache_p, out_p):
            ok = self.accept(q_p)
            if ok:
                self.log.append(("launch", q_p, cache_p, out_p))
            return ok
        return launch


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

    # A backend without layer_launcher: every op runs its kernel on the recorded tensors.
    log.clear()
    with set_forward_context(ForwardContext(object(), [], object())):
        assert program.run(pool) is output
    expected = []
    for i, (q, kv, out) in enumerate(layers):
        expected += [f"g{i}", ("kernel", q.data_ptr(), kv.data_ptr(), out.data_ptr())]
    assert log == expected + ["g3"] and pool.replays == 4 and program.runs == 1


def test_attention_launcher_serves_layers_and_declined_ones_fall_back():
    log = []
    layers = _layers(4)
    output = torch.randn(4, 16)
    pool, tape = _record(log, layers, _op(log), output)
    program = ReplayProgram.build(tape, output, torch.zeros(4), torch.zeros(4))
    declined = layers[2][0].data_ptr()   # the launcher refuses the third layer: its kernel runs
    backend = FakeBackend(log, accept=lambda q_p: q_p != declined)
    meta = object()
    log.clear()
    with set_forward_context(ForwardContext(meta, [], backend)):
        program.run(pool)
    # one launcher a step, made from the first layer's tensors
    (m, q, kv, out), = backend.made
    assert m is meta and (q, kv, out) == layers[0]
    expected = []
    for i, (q, kv, out) in enumerate(layers):
        kind = "kernel" if i == 2 else "launch"
        expected += [f"g{i}", (kind, q.data_ptr(), kv.data_ptr(), out.data_ptr())]
    assert log == expected + ["g4"]


def test_a_plan_missing_at_the_start_is_looked_up_again_once():
    """New host values: no plan before the first layer's call, which records it; the program asks
    again once after that call, and only once when there is still none."""
    log = []
    layers = _layers(3)
    output = torch.randn(4, 16)
    pool, tape = _record(log, layers, _op(log), output)
    program = ReplayProgram.build(tape, output, torch.zeros(4), torch.zeros(4))
    for plans_after, kinds in [(1, ["kernel", "launch", "launch"]), (5, ["kernel"] * 3)]:
        backend = FakeBackend(log, accept=lambda q_p: True, plans_after=plans_after)
        log.clear()
        with set_forward_context(ForwardContext(object(), [], backend)):
            program.run(pool)
        assert [e[0] for e in log if isinstance(e, tuple)] == kinds and len(backend.made) == 2


def test_no_launcher_for_mixed_shapes_or_other_ops():
    log = []
    layers = _layers(2) + _layers(1, shape=(4, 2, 16))
    output = torch.randn(4, 16)
    pool, tape = _record(log, layers, _op(log), output)
    program = ReplayProgram.build(tape, output, torch.zeros(4), torch.zeros(4))
    assert program is not None and program.attention is None
    backend = FakeBackend(log, accept=lambda q_p: True)
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
