"""LLM.generate stopped by an exception (its on_output callback raising, or Ctrl-C in a notebook):
the requests it queued are aborted, not left in the engine for the next call to run to the end,
and nothing leaks once the step in flight is resolved."""

import pytest

from engine_helpers import assert_drained, drain, make_llm, random_prompts
from pcg_engine.sampling_params import SamplingParams

PROMPTS = random_prompts([7, 12, 5], seed=31)
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


class Stop(Exception):
    pass


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, tiny_paths):
    return make_llm(tiny_paths["tiny-qwen3"], async_scheduling=request.param)


@pytest.mark.parametrize("exc", [Stop, KeyboardInterrupt])
def test_interrupted_generate_aborts_its_requests(llm, exc):
    want = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    seen = []

    def on_output(out):
        seen.append(out.request_id)
        if len(seen) == 5:            # a few steps in: every request is running
            raise exc("stop")
    with pytest.raises(exc):
        llm.generate(PROMPTS, PARAMS, on_output=on_output)
    engine = llm.engine
    assert not engine.requests, "an interrupted generate left its requests in the engine"
    drain(engine)                     # the step in flight (async), whose tokens are dropped
    assert_drained(engine)
    # The engine serves on as before.
    got = [o.token_ids for o in llm.generate(PROMPTS[:1], PARAMS)]
    assert got == want[:1]
    assert_drained(engine)


def test_interrupted_generate_keeps_the_outputs_of_other_requests(llm):
    """The callback raising on one of generate's outputs: the outputs of other requests behind it in
    the same step stay with the engine. They were dropped with the rest of the step, so a request
    that another caller added (here, the callback itself) finished without its final output."""
    engine = llm.engine
    other = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    seen = []

    def on_output(out):
        seen.append(out)
        if len(seen) == 1:            # added now: scheduled behind generate's request in every step
            engine.add_request(PROMPTS[1], other, request_id="other")
        elif "other" not in engine.requests:
            raise Stop("stop")        # in the step that finished "other", before its output is read
    with pytest.raises(Stop):
        llm.generate(PROMPTS[:1], PARAMS, on_output=on_output)
    finals = drain(engine)
    assert "other" in finals, "the other request's final output was lost"
    assert finals["other"].finish_reason == "length" and len(finals["other"].token_ids) == 1
    assert_drained(engine)


def test_interrupted_generate_leaves_a_new_request_under_a_finished_id_alone(llm):
    """Only generate's unfinished requests are aborted: one of its requests that has finished frees
    its id, and a request the callback added under that id since is the callback's. It was aborted
    with generate's, and its final output dropped."""
    engine = llm.engine
    short = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    reused = []

    def on_output(out):
        if reused:
            raise Stop("stop")        # the next output of generate's other request
        if out.finished:
            engine.add_request(PROMPTS[2], short, request_id=out.request_id)   # the finished one's id
            reused.append(out.request_id)
    with pytest.raises(Stop):
        llm.generate(PROMPTS[:2], [short, PARAMS], on_output=on_output)
    finals = drain(engine)
    assert finals[reused[0]].finish_reason == "length", "the callback's request was aborted"
    assert_drained(engine)


@pytest.mark.parametrize("at", [1, 3])
def test_ctrl_c_in_the_read_back_wait_leaves_other_requests_whole(llm, at, monkeypatch):
    """Ctrl-C during generate() lands most often in a step's one host sync, the token read-back.
    The step launched then was lost with the step's frame, and the requests in it kept a placeholder
    no step would resolve: a request another caller had added never finished (sync), or streamed
    the placeholder as a token (async). The next step now reads that step back first."""
    engine = llm.engine
    other = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(PROMPTS, other)]
    engine.add_request(PROMPTS[1], other, request_id="other")
    readback, calls = engine.readback, []
    for name in ("wait", "wait_array"):
        real = getattr(readback, name)

        def wait(*args, _real=real):
            calls.append(1)
            if len(calls) == at:
                raise KeyboardInterrupt
            return _real(*args)
        monkeypatch.setattr(readback, name, wait)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPTS[0], PROMPTS[2]], other)
    finals = drain(engine)
    assert finals["other"].token_ids == want[1]
    assert_drained(engine)
    assert [o.token_ids for o in llm.generate(PROMPTS, other)] == want
    assert_drained(engine)


def test_a_step_stopped_in_its_sampling_leaves_other_requests_running(llm, monkeypatch):
    """Found by probing (session 31): an exception in the sampler (a bug, Ctrl-C, out of memory)
    while generate() ran left another caller's request counted as computed with no token coming:
    never scheduled again, holding its blocks. The step now counts as not launched."""
    engine = llm.engine
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=3, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(PROMPTS[1:2], PARAMS)][0]
    engine.add_request(PROMPTS[1], PARAMS, request_id="other")
    for _ in range(3):
        engine.step()
    sampler = engine.sampler
    real = type(sampler).__call__
    calls = []

    def fail_once(self, logits, t):
        calls.append(1)
        if len(calls) == 1:
            raise Stop("in the sampler")
        return real(self, logits, t)
    monkeypatch.setattr(type(sampler), "__call__", fail_once)
    with pytest.raises(Stop):
        llm.generate(PROMPTS[:1], sampled)      # a sampling request: the step goes through the sampler
    assert calls
    finals = drain(engine)          # it stalled here: "engine did not drain", its blocks held
    assert finals["other"].token_ids == want
    assert_drained(engine)


# On the GPU too: there the read-back's pinned buffers and the argmax kernel's outputs are taken
# in turns, which a failed step must not shift under the step in flight.
# (A fixed KV cache: several engines live at once, each would size its cache from the free memory.)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["forward", "sampler", "forward, then its handling"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_step_stopped_in_its_launch_gives_the_others_their_own_tokens(tiny_paths, where, async_scheduling,
                                                                        device, monkeypatch):
    """Found by a review: with async scheduling, a step stopped in its forward or its sampling (Ctrl-C
    in generate(), out of memory, a bug) had already rewritten where each row's token sits in the
    step's output. The step after it then filled its placeholder inputs from the step in flight by
    that layout: a neighbour's token. Here request A stops on its third token, so the failed step's
    rows differ from the step in flight's, and B ran on from another token (silently: no invariant
    broke), and the blocks it published held KV computed for tokens other than those they are
    hashed under, which a later prompt then hit in the prefix cache.
    "forward, then its handling": a second Ctrl-C in the handling of the first (found by session
    39's review: the handling invalidated the batch before it moved the step in flight aside, and
    a stop there left the step in flight, as before the fix)."""
    path = tiny_paths["tiny-qwen3"]
    greedy = lambda n, **kw: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)  # noqa: E731
    a, b, c = PROMPTS
    ref = make_llm(path, enable_prefix_caching=False, device=device, mode="eager", num_kv_blocks=64)
    a_want, b_want = (ref.generate([p], greedy(12))[0].token_ids for p in (a, b))
    llm = make_llm(path, async_scheduling=async_scheduling, block_size=4, device=device, mode="eager", num_kv_blocks=64)
    engine = llm.engine
    engine.add_request(a, greedy(12, stop_token_ids=[a_want[2]]), request_id="A")
    engine.add_request(b, greedy(12), request_id="B")
    finals = {}
    for _ in range(4):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    if where == "forward, then its handling":
        _raise_once(monkeypatch, engine.runner.batch, "invalidate")
        where = "forward"
    if where == "forward":
        runner, real = engine.runner, engine.runner.forward_fn

        def interrupt(*args, **kwargs):
            runner.forward_fn = real
            raise KeyboardInterrupt
        runner.forward_fn = interrupt
        params = greedy(3)
    else:
        cls = type(engine.sampler)
        real = cls.__call__

        def interrupt(self, logits, t):
            cls.__call__ = real
            raise KeyboardInterrupt
        cls.__call__ = interrupt
        params = SamplingParams(temperature=0.8, seed=5, max_tokens=3)   # a row for the sampler
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([c], params)
    finally:
        if where == "forward":
            runner.forward_fn = real
        else:
            cls.__call__ = real
    finals.update(drain(engine))
    assert_drained(engine)
    assert finals["A"].token_ids == a_want[:3] and finals["B"].token_ids == b_want
    # B's published blocks hold B's own KV: a prompt extending B's text hits them and runs as without.
    longer = b + b_want[:8]
    out = llm.generate([longer], greedy(6))[0]
    assert out.metrics.num_cached_tokens > 0
    assert out.token_ids == ref.generate([longer], greedy(6))[0].token_ids
    assert_drained(engine)


@pytest.mark.parametrize("where", ["read-back", "after the noise"])
@pytest.mark.parametrize("b_params", [
    dict(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0), dict(temperature=1.0, seed=42),
    "min_tokens",
], ids=["penalty", "seeded", "min_tokens"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_step_stopped_after_its_sampling_leaves_no_trace_in_the_sampling_state(tiny_paths, where, b_params,
                                                                                 async_scheduling, device):
    """Found by a review: a step stopped after its sampler ran (in the read-back's start, or right
    after the seeded noise was drawn) is planned again, but the sampling store had counted its
    tokens (a penalty counted twice, the min_tokens mask lifted a token early) and the seeded
    rows' streams had moved on: the other request's tokens differed from an uninterrupted run."""
    from pcg_engine.engine import sampler as sampler_mod
    path = tiny_paths["tiny-qwen3"]
    b = PROMPTS[1]
    if b_params == "min_tokens":
        free = make_llm(path, device=device, mode="eager", num_kv_blocks=64).generate(
            [b], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
        # the 6th token is masked while fewer than 6 are out: one count ahead, it stops the request there
        b_params = dict(temperature=0.0, min_tokens=6, stop_token_ids=[free.token_ids[5]])
    params = SamplingParams(max_tokens=12, ignore_eos=True, **b_params)
    want = make_llm(path, device=device, mode="eager", num_kv_blocks=64).generate([b], params)[0].token_ids
    llm = make_llm(path, async_scheduling=async_scheduling, device=device, mode="eager", num_kv_blocks=64)
    engine = llm.engine
    engine.add_request(b, params, request_id="B")
    finals = {}
    for _ in range(3):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    if where == "read-back":
        target, name = engine.readback, "start"
    else:
        target, name = sampler_mod.Sampler, "_exponential_noise"
    real = getattr(target, name)

    def once(*args, **kwargs):
        real(*args, **kwargs)       # the work done (noise drawn, copies enqueued), then the stop
        setattr(target, name, real)
        raise KeyboardInterrupt
    setattr(target, name, once)
    try:
        with pytest.raises(KeyboardInterrupt):   # a sampling request: the step goes through the sampler
            llm.generate([PROMPTS[2]], SamplingParams(temperature=0.8, seed=5, max_tokens=3))
    finally:
        if target is engine.readback:
            del engine.readback.start          # the instance attribute: the class's method again
        else:
            setattr(target, name, real)
    finals.update(drain(engine))
    assert_drained(engine)
    assert finals["B"].token_ids == want


# ---- session 39's review: the edges of a failed launch --------------------------------------------
def _greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _raise_once(monkeypatch, owner, name):
    """owner.name raises KeyboardInterrupt at its next call, then is itself again."""
    real = getattr(owner, name)

    def once(*args, **kwargs):
        monkeypatch.setattr(owner, name, real)
        raise KeyboardInterrupt(name)
    monkeypatch.setattr(owner, name, once)


@pytest.mark.parametrize("where", ["record_sampled", "update_after_step"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_stop_around_counting_the_sampled_tokens_leaves_a_seeded_request_whole(tiny_paths, async_scheduling,
                                                                                where, monkeypatch):
    """Found by a review: the sampled tokens were counted after the scheduler's update, outside the
    launch's try; a stop in the count left the step counted as computed with no token to come, and
    the request was never scheduled again (it held its blocks for good). Now the count is taken
    back and the step planned again: the seeded request's tokens are an uninterrupted run's."""
    path = tiny_paths["tiny-qwen3"]
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)
    want = make_llm(path, mode="eager", num_kv_blocks=64).generate([PROMPTS[1]], params)[0].token_ids
    engine = make_llm(path, async_scheduling=async_scheduling, mode="eager", num_kv_blocks=64).engine
    engine.add_request(PROMPTS[1], params, request_id="B")
    finals = {}
    for _ in range(3):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    # in the count, or in the scheduler's update after it (the count is taken back)
    _raise_once(monkeypatch, engine.sampling if where == "record_sampled" else engine.scheduler, where)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    finals.update(drain(engine, max_steps=50))
    assert finals["B"].token_ids == want
    assert_drained(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_stop_before_a_fresh_rows_sampling_is_written_keeps_its_sampling(tiny_paths, async_scheduling,
                                                                          monkeypatch):
    """Found by a review: a stop between binding a request's row and writing its sampling row left
    the row bound; no later launch wrote it, and a request with a temperature and a seed ran on
    greedy. Now the launch's fresh rows are released and bound again by the next launch."""
    path = tiny_paths["tiny-qwen3"]
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=8, ignore_eos=True)
    want = make_llm(path, mode="eager", num_kv_blocks=64).generate([PROMPTS[1]], params)[0].token_ids
    engine = make_llm(path, async_scheduling=async_scheduling, mode="eager", num_kv_blocks=64).engine
    _raise_once(monkeypatch, engine.sampling, "write_rows")
    engine.add_request(PROMPTS[1], params, request_id="B")
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    finals = drain(engine)
    assert finals["B"].token_ids == want
    assert_drained(engine)
