"""CUDA graphs (GPU only): capture once per bucket, replay with new inputs equals eager, padding rows
are harmless, the debug address check holds. float32 so that eager and graphed runs compare tightly."""

import pytest
import torch

from compile_helpers import SCHEDULE, Lockstep, make_runner, run_workload

pytestmark = pytest.mark.gpu

BUCKETS = [1, 2, 4, 8, 16, 32]
GPU = dict(device="cuda", dtype="float32", max_capture_tokens=32)


@pytest.fixture(scope="module")
def gpu_runners(tiny_dense, tiny_moe, cache_root):
    cache = {}

    def get(preset, mode, **kw):
        key = (preset, mode, repr(sorted(kw.items())))   # bucket lists are not hashable
        if key not in cache:
            path = tiny_dense if preset == "dense" else tiny_moe
            cache[key] = make_runner(path, mode, compile_cache_dir=str(cache_root), **{**GPU, **kw})
        return cache[key]
    return get


def _assert_matches(eager, graphed, atol=2e-3):
    def check(results, index):
        (ref, _), (out, _) = results
        torch.testing.assert_close(out, ref, atol=atol, rtol=atol, msg=lambda m: f"step {index}: {m}")
    run_workload([eager, graphed], check)


@pytest.mark.parametrize("preset", ["dense", "moe"])
def test_every_bucket_captured_exactly_once(gpu_runners, preset):
    runner = gpu_runners(preset, "piecewise", cudagraph_buckets=BUCKETS)
    pool = runner.graph_pool
    pieces = runner.forward_fn.stats.pieces
    assert runner.token_buckets == BUCKETS
    assert dict(pool.captures) == {(i, b): 1 for i in range(pieces) for b in BUCKETS}
    assert runner.timings["capture_s"] > 0 and runner.timings["graph_pool_mib"] >= 0
    eager = gpu_runners(preset, "eager", attention_backend=runner.backend.name)
    _assert_matches(eager, runner)
    assert dict(pool.captures) == {(i, b): 1 for i in range(pieces) for b in BUCKETS}   # no recapture
    assert pool.replays > 0 and runner.forward_fn.stats.set_ups == 1


@pytest.mark.parametrize("preset", ["dense", "moe"])
def test_full_decode_buckets_captured_once_and_replayed(gpu_runners, preset):
    runner = gpu_runners(preset, "full_and_piecewise", cudagraph_buckets=BUCKETS, decode_buckets=[1, 2, 4, 8])
    graphs = runner.full_graphs
    assert graphs.captures == {1: 1, 2: 1, 4: 1, 8: 1}
    # A warm-up a bucket, or the largest only with PCG_FULL_GRAPH_WARMUP_EVERY=0 (full_graph.py).
    assert graphs.warmup_runs == (4 * graphs.warmups if graphs.warm_every_bucket else graphs.warmups)
    eager = gpu_runners(preset, "eager", attention_backend=runner.backend.name)
    before = graphs.replays
    paths = []
    lock = Lockstep([eager, runner])
    try:
        for rid, n in [("a", 5), ("b", 9), ("c", 3)]:
            lock.add(rid, list(range(10, 10 + n)))
        for step in [[("a", 5), ("b", 9), ("c", 3)]] + [[("a", 1), ("b", 1), ("c", 1)]] * 4 + [[("b", 1)]]:
            (ref, _), (out, _) = lock.step(step)
            torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
            paths.append(runner.last_path)
    finally:
        lock.close()
    assert paths[0] == "piecewise" and set(paths[1:]) == {"full"}
    assert graphs.replays - before == 5


@pytest.mark.parametrize("mode", ["piecewise", "full_decode"])
def test_replay_with_new_inputs_matches_eager(gpu_runners, mode):
    # full_decode takes no token buckets (EngineConfig refuses them there)
    runner = gpu_runners("dense", mode, **({"cudagraph_buckets": BUCKETS} if mode == "piecewise" else {}))
    eager = gpu_runners("dense", "eager", attention_backend=runner.backend.name)
    for _ in range(2):     # the second round replays graphs captured long before, on new data
        _assert_matches(eager, runner)


def test_replay_programs_recorded_run_and_equal_eager(gpu_runners):
    """After the first forward at a bucket, later ones run its replay program (no Dynamo, one
    attention plan lookup a step) and still equal eager, on new inputs, across two rounds."""
    runner = gpu_runners("dense", "piecewise", cudagraph_buckets=BUCKETS)
    eager = gpu_runners("dense", "eager", attention_backend=runner.backend.name)
    backend, pool = runner.backend, runner.graph_pool
    bound = []
    real = backend.layer_calls
    runs_before = {id(p): p.runs for p in pool.programs.values()}   # the runner is shared with other tests

    def counting(*args):
        bound.append(real(*args))
        return bound[-1]
    backend.layer_calls = counting
    try:
        for _ in range(2):
            _assert_matches(eager, runner)
    finally:
        del backend.layer_calls
    runs = sum(p.runs for p in pool.programs.values())
    assert pool.programs and runs > 0
    assert all(p.attention is not None for p in pool.programs.values())
    # the plans were bound to the programs' layers (a step at new host values may find none yet),
    # and the programs that ran here ran their calls: the last binding each kept is one handed out here
    served = [b for b in bound if b is not None]
    assert served and all(len(b.calls) == runner.num_layers for b in served)
    ran = [p for p in pool.programs.values() if p.runs > runs_before.get(id(p), 0)]
    kept = [p._bound for p in ran if p._bound is not None]
    assert kept and all(any(k is b for b in served) for k in kept)
    assert runner.forward_fn.stats.set_ups == 1


def _garbage_hook(runner, seed=0):
    """After prepare, fill the padding rows of the static buffers with valid-looking garbage."""
    real = runner.batch.prepare
    b = runner.batch
    padded = []

    def prepare(scheduled, pad_tokens_to=None, pad_reqs_to=None, previous_tokens=None):
        inputs = real(scheduled, pad_tokens_to=pad_tokens_to, pad_reqs_to=pad_reqs_to,
                      previous_tokens=previous_tokens)
        g = torch.Generator(device=b.input_ids.device).manual_seed(seed + len(padded))
        T, Tp = inputs.num_real_tokens, inputs.input_ids.shape[0]
        R, Rp = inputs.num_real_reqs, inputs.metadata.num_reqs
        dev = b.input_ids.device
        b.input_ids[T:Tp] = torch.randint(0, runner.vocab_size, (Tp - T,), generator=g, device=dev)
        b.positions[T:Tp] = torch.randint(0, runner.max_model_len, (Tp - T,), generator=g, device=dev)
        b.step_block_table[R:Rp] = torch.randint(1, runner.num_kv_blocks, (Rp - R, b.max_blocks), generator=g,
                                                 device=dev, dtype=torch.int32)
        padded.append(Tp - T)
        return inputs
    return prepare, real, padded


@pytest.mark.parametrize("preset", ["dense", "moe"])   # MoE since session 31: its padding rows route too
@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_garbage_in_padding_rows_changes_no_real_output(gpu_runners, mode, preset):
    runner = gpu_runners(preset, mode, cudagraph_buckets=BUCKETS)
    runner.graph_pool.debug = True      # also check every replay's input addresses
    lock = Lockstep([runner])
    hooked, real, padded = _garbage_hook(runner)
    try:
        for rid, prompt in [("a", list(range(3, 8))), ("b", list(range(40, 53))), ("c", list(range(9, 12)))]:
            lock.add(rid, prompt)
        for step in SCHEDULE[:1] + [[("a", 1), ("b", 13), ("c", 3)], [("a", 1), ("b", 1), ("c", 1)]]:
            clean = lock.step(step, advance=False)[0][0]
            runner.batch.prepare = hooked
            dirty = lock.step(step, advance=False)[0][0]
            runner.batch.prepare = real
            torch.testing.assert_close(dirty, clean, atol=1e-5, rtol=1e-5)
            lock.step(step)
    finally:
        runner.batch.prepare = real
        runner.graph_pool.debug = False
        lock.close()
    assert any(padded), "no step was padded"


def test_debug_check_catches_moved_inputs(gpu_runners):
    # A runner of its own (no other test steps it): its bucket-8 graphs are as captured.
    runner = gpu_runners("dense", "piecewise", cudagraph_buckets=[2, 8])
    pool = runner.graph_pool
    assert pool.enabled and not pool.passthrough and all((i, 8) in pool.captures for i in range(runner.forward_fn.stats.pieces))
    # Not the static buffers, but views of a copy of their storage at the same offsets: the step's
    # fields are views of one buffer (engine/step_buffers.py), and Dynamo guards on that aliasing,
    # so a lone fresh tensor would make it trace anew (new pieces, no graphs: nothing to check).
    ids0, pos0 = runner.batch.input_ids[:8], runner.batch.positions[:8]
    assert ids0.dtype == pos0.dtype == torch.long
    store = torch.zeros(ids0.untyped_storage().nbytes() // 8, dtype=torch.long, device="cuda")
    ids = store.as_strided(ids0.shape, ids0.stride(), ids0.storage_offset())
    positions = store.as_strided(pos0.shape, pos0.stride(), pos0.storage_offset())
    from pcg_engine.attention.context import ForwardContext, set_forward_context
    pool.debug = True
    try:
        with torch.inference_mode(), set_forward_context(ForwardContext(None, runner.kv_caches, runner.backend)):
            with pytest.raises(RuntimeError, match="static buffers"):
                runner.forward_fn(ids, positions)
    finally:
        pool.debug = False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool])
def test_non_owning_view_shares_memory(dtype):
    from pcg_engine.compile.cuda_graph import non_owning
    base = torch.arange(24, device="cuda").to(dtype).view(4, 6)
    t = base[:, 1:5]                                   # strided, with an offset
    v = non_owning(t)
    assert v is not t, "fell back to a strong reference"
    assert (v.data_ptr(), v.dtype, v.shape, v.stride()) == (t.data_ptr(), t.dtype, t.shape, t.stride())
    assert torch.equal(v, t)
    base.zero_()
    assert torch.equal(v, t)                           # same memory, not a copy


@pytest.mark.parametrize("preset", ["dense", "moe"])
@pytest.mark.parametrize("mode", ["compile", "piecewise", "full_decode", "full_and_piecewise"])
def test_bf16_logits_close_to_eager_in_every_mode(gpu_runners, preset, mode):
    """Issue 5's 'logits close (bf16)': the other tests compare in float32, where the mechanisms must
    agree tightly; in bf16 Inductor's fused kernels round other intermediates than eager's separate
    ops, so greedy tokens may flip on a near-tie, but every step's logits stay within bf16's
    rounding of eager's (a wrong slot, row or bucket is off by the logits' whole size)."""
    runner = gpu_runners(preset, mode, dtype="bfloat16")
    eager = gpu_runners(preset, "eager", dtype="bfloat16", attention_backend=runner.backend.name)
    worst = []

    def check(results, index):
        (ref, _), (out, _) = results
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        rel = float((out.float() - ref.float()).norm() / ref.float().norm())
        worst.append(rel)
        assert rel < 3e-2, f"step {index}: logits off eager's by {rel:.2e} (relative, whole step)"
    run_workload([eager, runner], check)
    assert len(worst) == len(SCHEDULE)
