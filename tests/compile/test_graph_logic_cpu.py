"""The CUDA-graph bookkeeping, exercised on the CPU with a stand-in for torch.cuda.CUDAGraph.

`FakeGraph` behaves like a captured graph where it matters here: a replay recomputes from the
tensors the capture saw (the captured addresses) and writes the results into the captured outputs
in place. So if a piece were handed inputs anywhere but where its capture read them, or a padding
or metadata detail were wrong, the logits would differ from eager. Real capture is tested on the GPU.
"""

import contextlib

import pytest
import torch

import pcg_engine.compile.cuda_graph as cuda_graph
import pcg_engine.compile.full_graph as full_graph
from compile_helpers import Lockstep, make_runner, run_workload
from pcg_engine.compile.piecewise import CompiledForward
from pcg_engine.compile.setup import _dummy_forward, capture_piecewise

BUCKETS = [1, 2, 4, 8, 16, 32]


def _flat(value):
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    return [value]


class FakeGraph:
    def __init__(self, fn, args, outputs):
        self.fn, self.args, self.outputs = fn, args, outputs
        self.replays = 0

    def replay(self):
        self.replays += 1
        new = self.fn(*self.args)
        for old, value in zip(_flat(self.outputs), _flat(new)):
            if isinstance(old, torch.Tensor):
                old.copy_(value)


CAPTURE_CALLS = []   # (fn, warmups) of every fake capture, in order


def fake_capture(pool, fn, *args, warmups=1):
    CAPTURE_CALLS.append((fn, warmups))
    for _ in range(warmups):
        fn(*args)
    outputs = fn(*args)
    return FakeGraph(fn, args, outputs), outputs


@contextlib.contextmanager
def _fake_graphed_runner(tiny_dense, dense_piecewise):
    """An eager CPU runner turned piecewise with graphs 'captured' through FakeGraph."""
    runner = make_runner(tiny_dense, "eager", max_capture_tokens=32)
    pool = cuda_graph.GraphPool(torch.device("cpu"))
    pool.enabled = True
    mp = pytest.MonkeyPatch()
    mp.setattr(cuda_graph, "capture", fake_capture)
    CAPTURE_CALLS.clear()
    try:
        forward = CompiledForward(runner.model, split=True, graphs=pool, buckets=BUCKETS)
        runner.forward_fn, runner.token_buckets, runner.graph_pool = forward, BUCKETS, pool
        with dense_piecewise.compile_cache.activate(), torch.inference_mode():
            _dummy_forward(runner, forward, BUCKETS[-1])      # trace + compile (cache hit)
        capture_piecewise(runner, forward, BUCKETS)
        yield runner
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def fake_graphed(tiny_dense, dense_piecewise):
    with _fake_graphed_runner(tiny_dense, dense_piecewise) as runner:
        yield runner


def test_fake_capture_once_per_piece_and_bucket(fake_graphed, dense_eager):
    pool = fake_graphed.graph_pool
    pieces = fake_graphed.forward_fn.stats.pieces
    assert dict(pool.captures) == {(i, b): 1 for i in range(pieces) for b in BUCKETS}
    assert pool.captured_buckets() == {b: pieces for b in BUCKETS}

    def check(results, index):
        torch.testing.assert_close(results[1][0], results[0][0], atol=1e-4, rtol=1e-4)
    pool.debug = True
    try:
        for _ in range(2):
            run_workload([dense_eager, fake_graphed], check)
    finally:
        pool.debug = False
    assert dict(pool.captures) == {(i, b): 1 for i in range(pieces) for b in BUCKETS}
    assert pool.replays > 0 and fake_graphed.forward_fn.stats.set_ups == 1


def test_one_warm_up_per_piece_key_and_bucket(fake_graphed, dense_eager):
    """Pieces that share a key (identical layers: one compiled callable) warm up once a bucket,
    the first of them; the others are captured with no warm-up (cuda_graph.py's docstring), and
    the graphs still replay what eager computes (test above)."""
    pool, keys = fake_graphed.graph_pool, fake_graphed.forward_fn.stats.keys
    assert len(set(keys)) < len(keys)                       # the middle layers share one key
    calls = CAPTURE_CALLS[-len(keys) * len(BUCKETS):]       # the capture pass's, of this runner
    assert len(calls) == len(keys) * len(BUCKETS) and {w for _, w in calls} == {0, 1}
    by_fn = {}
    for fn, warmups in calls:
        by_fn.setdefault(id(fn), []).append(warmups)
    assert len(by_fn) == len(set(keys))
    for warmups in by_fn.values():     # per compiled callable: one warm-up a bucket, the first call
        assert sum(warmups) == len(BUCKETS)
        per_bucket = len(warmups) // len(BUCKETS)
        assert all(warmups[i] == (i % per_bucket == 0) for i in range(len(warmups)))
    assert pool.warmups == len(BUCKETS) * len(set(keys))
    assert pool.warmed == {(k, b) for k in keys for b in BUCKETS}


def test_no_graphs_passthrough_and_sizes_off_bucket(fake_graphed):
    pool = fake_graphed.graph_pool
    b = fake_graphed.batch
    before = pool.replays
    from pcg_engine.attention.context import ForwardContext, set_forward_context
    with torch.inference_mode(), set_forward_context(ForwardContext(None, fake_graphed.kv_caches,
                                                                    fake_graphed.backend)):
        with pool.no_graphs():
            fake_graphed.forward_fn(b.input_ids[:8], b.positions[:8])
        assert pool.replays == before
        fake_graphed.forward_fn(b.input_ids[:7], b.positions[:7])      # no bucket of 7: compiled
        assert pool.replays == before
        fake_graphed.forward_fn(b.input_ids[:8], b.positions[:8])
        assert pool.replays == before + fake_graphed.forward_fn.stats.pieces
    assert max(k[1] for k in pool.captures) == 32 and (0, 7) not in pool.captures


def test_replay_programs_on_fake_graphs(tiny_dense, dense_piecewise, dense_eager):
    """Without the debug check, the first forward at a bucket after capture records its replay
    program and later ones run it (graph replays and the attention op's kernel on the recorded
    tensors): outputs still equal eager on new inputs, one Dynamo trace. release() then drops the
    programs and every piece's graphs."""
    with _fake_graphed_runner(tiny_dense, dense_piecewise) as runner:
        pool = runner.graph_pool
        assert not pool.programs          # capture-phase forwards record nothing

        def check(results, index):
            torch.testing.assert_close(results[1][0], results[0][0], atol=1e-4, rtol=1e-4)
        for _ in range(2):
            run_workload([dense_eager, runner], check)
        programs = pool.programs
        assert programs and sum(p.runs for p in programs.values()) > 0
        assert all(p.attention is not None and p.graphs == runner.forward_fn.stats.pieces for p in programs.values())
        assert runner.forward_fn.stats.set_ups == 1
        pieces = list(pool.pieces)
        assert len(pieces) == runner.forward_fn.stats.pieces and all(p.entries for p in pieces)
        pool.release()
        assert not pool.programs and not pool.pieces and not any(p.entries for p in pieces)


def test_full_decode_graph_logic(tiny_dense, dense_eager, monkeypatch):
    runner = make_runner(tiny_dense, "eager")
    monkeypatch.setattr(runner.backend, "cuda_graph_safe", True, raising=False)   # test stand-in only
    monkeypatch.setattr(full_graph, "capture", fake_capture)
    pool = cuda_graph.GraphPool(torch.device("cpu"))
    pool.enabled = True
    # The A/B switch's other setting first: only the first capture, the largest bucket, warms up
    first = full_graph.FullDecodeGraphs(runner, [1, 2, 4, 8], pool=pool, warmups=2, warm_every_bucket=False)
    CAPTURE_CALLS.clear()
    first.capture_all()
    assert [w for _, w in CAPTURE_CALLS] == [2, 0, 0, 0] and first.warmup_runs == 2
    graphs = full_graph.FullDecodeGraphs(runner, [1, 2, 4, 8], pool=pool)
    assert graphs.warm_every_bucket == full_graph.WARM_EVERY_BUCKET
    graphs.warm_every_bucket = True     # the default unless the environment switches it
    CAPTURE_CALLS.clear()
    graphs.capture_all()
    assert graphs.captures == {1: 1, 2: 1, 4: 1, 8: 1}
    assert [w for _, w in CAPTURE_CALLS] == [full_graph.DEFAULT_WARMUPS] * 4   # a warm-up a bucket
    assert graphs.warmup_runs == 4 * full_graph.DEFAULT_WARMUPS
    assert [graphs.bucket_for(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    meta = graphs.metadata(4)
    assert (meta.num_reqs, meta.num_tokens, meta.max_query_len, meta.max_seq_len) == (4, 4, 1, runner.max_model_len)
    runner.full_graphs = graphs
    paths = []
    lock = Lockstep([dense_eager, runner])
    try:
        for rid, n in [("a", 5), ("b", 9), ("c", 3)]:
            lock.add(rid, list(range(10, 10 + n)))
        for step in [[("a", 5), ("b", 9), ("c", 3)]] + [[("a", 1), ("b", 1), ("c", 1)]] * 3 + [[("b", 1)]]:
            (ref, _), (out, inputs) = lock.step(step)
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
            paths.append((runner.last_path, inputs.input_ids.shape[0]))
    finally:
        lock.close()
    # (the runner labels an unpadded prefill of its eager forward "eager" or "compiled")
    assert paths[0][1] == 17 and paths[0][0] != "full"
    assert paths[1:] == [("full", 4)] * 3 + [("full", 1)]
    assert graphs.replays == 4


def test_full_graph_warmups_switch(monkeypatch):
    """PCG_FULL_GRAPH_WARMUPS: 1 by default, at least 1, and a bad value never stops a start;
    PCG_FULL_GRAPH_WARMUP_EVERY: on unless set to 0."""
    for value, expected in [(None, True), ("0", False), ("1", True), ("yes", True)]:
        if value is None:
            monkeypatch.delenv("PCG_FULL_GRAPH_WARMUP_EVERY", raising=False)
        else:
            monkeypatch.setenv("PCG_FULL_GRAPH_WARMUP_EVERY", value)
        assert full_graph._warm_every_switch() is expected, value
    for value, expected in [(None, 1), ("2", 2), ("0", 1), ("-3", 1), ("two", 1), ("", 1)]:
        if value is None:
            monkeypatch.delenv("PCG_FULL_GRAPH_WARMUPS", raising=False)
        else:
            monkeypatch.setenv("PCG_FULL_GRAPH_WARMUPS", value)
        assert full_graph._warmups_switch() == expected, value


def test_full_decode_graphs_refuse_unsafe_backend(dense_eager):
    with pytest.raises(ValueError, match="graph-safe"):
        full_graph.FullDecodeGraphs(dense_eager)


def test_default_decode_buckets():
    assert full_graph.default_decode_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert full_graph.default_decode_buckets(3) == [1, 2, 3]
    assert full_graph.default_decode_buckets(20) == [1, 2, 4, 8, 16, 20]


@pytest.mark.parametrize("on", [False, True])
def test_piece_captures_inside_a_pdl_scope_when_switched_on(monkeypatch, on):
    """PIECE_PDL: a piece graph is captured (warm-up included) with PDL launches; nothing after."""
    from pcg_engine.kernels import pdl
    depths = []

    def capture(pool, fn, *args, warmups=1):
        depths.append(pdl._depth)
        outputs = fn(*args)
        return FakeGraph(fn, args, outputs), outputs
    monkeypatch.setattr(cuda_graph, "capture", capture)
    monkeypatch.setattr(cuda_graph, "PIECE_PDL", on)
    pool = cuda_graph.GraphPool(torch.device("cpu"))
    pool.enabled = True
    piece = cuda_graph.GraphedPiece(lambda x: x * 2, 0, pool, [4])
    pool.num_tokens = 4
    x = torch.arange(4.0)
    with pool.capture_phase():
        assert torch.equal(piece(x), x * 2)
    assert depths == [1 if on else 0] and pdl._depth == 0
    x += 1                                   # a replay reads the captured input's new contents
    assert torch.equal(piece(x), x * 2) and depths == [1 if on else 0]
