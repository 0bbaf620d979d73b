"""Async scheduling equals sync scheduling (DESIGN.md, "Async scheduling", "Equivalence").

Engines with async_scheduling=True and False run the same mixed workloads: a stop at every output
position, max_tokens 1, EOS, stop strings, seeded sampling, under preemption, with prefix hits and
chunked prefill, and with aborts mid-flight. Tokens, texts and finish reasons must be identical; no
block, row or placeholder may leak: every engine here runs with the invariant hook of
engine_helpers (placeholders never in outputs or in published prefix-cache blocks, block manager
consistent after every step), and the async engines must really have fed placeholders forward.
"""

import pytest

from engine_helpers import assert_drained, assert_tokens, drain, make_llm, random_prompts
from pcg_engine.errors import InvalidRequestError
from pcg_engine.engine.request import PLACEHOLDER
from pcg_engine.sampling_params import SamplingParams

N = 8                     # output tokens of the reference run; stops are placed at 0..N-1
PROMPTS = random_prompts([5, 13, 22], seed=30)
PREFIX = random_prompts([20], seed=31)[0]
SHARED = [PREFIX + s for s in random_prompts([3, 9], seed=32)]


def greedy(max_tokens=N, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def count_placeholder_inputs(engine):
    """Count, per step, the scheduled input tokens that are placeholders (filled on the device)."""
    counts = []
    real = engine.runner.execute

    def execute(scheduled, previous_tokens=None):
        n = sum(r.token_ids[r.num_computed_tokens:r.num_computed_tokens + k].count(PLACEHOLDER)
                for r, k in scheduled)
        counts.append(n)
        if n:
            assert previous_tokens is not None
        return real(scheduled, previous_tokens=previous_tokens)
    engine.runner.execute = execute
    return counts


@pytest.fixture(scope="module")
def eos_token(hf_refs):
    """An EOS id the model produces early for PROMPTS[0] (the generation config is rewritten)."""
    return hf_refs("tiny-qwen3").greedy(PROMPTS[0], N, stop_at_eos=False)[3]


@pytest.fixture(scope="module")
def reference(eos_checkpoint, eos_token):
    """Sync, roomy cache, EOS ignored: each prompt's N greedy tokens and their text."""
    llm = make_llm(eos_checkpoint(eos_token))
    outs = llm.generate(PROMPTS + SHARED, greedy(N, ignore_eos=True))
    return [(o.token_ids, o.text) for o in outs]


def workload(reference):
    """[(request_id, prompt, params, expected tokens or None)]: expected derived from the reference
    wherever the stop rule makes it computable."""
    reqs = []
    for i, (prompt, (toks, text)) in enumerate(zip(PROMPTS, reference)):
        for k in range(N):
            stop = toks[k]
            reqs.append((f"p{i}-stop{k}", prompt, greedy(N, ignore_eos=True, stop_token_ids=[stop]),
                         toks[:toks.index(stop) + 1]))
        reqs.append((f"p{i}-max1", prompt, greedy(1, ignore_eos=True), toks[:1]))
        reqs.append((f"p{i}-eos", prompt, greedy(N), None))
        clean = [j for j in range(1, len(text) - 2) if "\ufffd" not in text[j:j + 2]]
        reqs.append((f"p{i}-str", prompt, greedy(N, ignore_eos=True, stop=text[clean[len(clean) // 2]:][:2]),
                     None))
        reqs.append((f"p{i}-seeded", prompt, SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=N),
                     None))
        reqs.append((f"p{i}-penalties", prompt, greedy(N, ignore_eos=True, repetition_penalty=1.3,
                                                       presence_penalty=0.4, frequency_penalty=0.2, logprobs=2),
                     None))
    return reqs


def run(llm, reqs, second_wave=(), wave_after: int = 4, abort=None):
    """Add reqs, step; after `wave_after` steps add second_wave (prefix hits on what the first
    wave cached) and abort the ids in `abort`. Returns {rid: (tokens, text, finish, stop_reason)}."""
    engine = llm.engine
    for rid, prompt, params, _ in reqs:
        engine.add_request(prompt, params, request_id=rid)
    finals = {}
    for _ in range(wave_after):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    for rid in abort or ():
        engine.abort_request(rid)
    for rid, prompt, params, _ in second_wave:
        engine.add_request(prompt, params, request_id=rid)
    finals.update(drain(engine))
    assert_drained(engine)
    return {rid: (o.token_ids, o.text, o.finish_reason, o.stop_reason, o.metrics.num_cached_tokens, o.logprobs)
            for rid, o in finals.items()}


def same_logprobs(a, b) -> bool:
    """Equal up to float rounding (a row's logits may round differently in another batch)."""
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        x["token"] == y["token"] and abs(x["logprob"] - y["logprob"]) < 1e-4
        and [t for t, _ in x["top"]] == [t for t, _ in y["top"]] for x, y in zip(a, b))


CONFIGS = {
    "default": {},
    "small-cache": {"num_kv_blocks": 24, "block_size": 4},
    "chunked": {"max_num_batched_tokens": 8},
    "all": {"num_kv_blocks": 12, "block_size": 4, "max_num_batched_tokens": 12, "max_num_seqs": 6},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_async_equals_sync_on_mixed_workload(config, reference, eos_checkpoint, eos_token):
    reqs = workload(reference)
    second = [(f"shared{j}", p, greedy(N, ignore_eos=True), reference[len(PROMPTS) + j][0])
              for j, p in enumerate(SHARED)]
    # The second wave shares a 20-token prefix with the first request of the first wave (admitted
    # first, so its full block is published before the second wave arrives).
    reqs.insert(0, ("shared-first", SHARED[0][:21], greedy(N, ignore_eos=True), None))
    results, stats = {}, {}
    for mode in (False, True):
        llm = make_llm(eos_checkpoint(eos_token), async_scheduling=mode, **CONFIGS[config])
        assert llm.engine.async_scheduling is mode
        placeholders = count_placeholder_inputs(llm.engine)
        results[mode] = run(llm, reqs, second)
        stats[mode] = (llm.engine.stats.preemptions, sum(placeholders))
    sync, asyn = results[False], results[True]
    assert set(sync) == set(asyn) == {r[0] for r in reqs + second}
    for rid in sync:
        assert sync[rid][:4] == asyn[rid][:4], f"{rid}: sync {sync[rid]} != async {asyn[rid]}"
        assert same_logprobs(sync[rid][5], asyn[rid][5]), rid
    for rid, _, params, want in reqs + second:
        tokens, _, finish, stop_reason, _, _ = sync[rid]
        if want is not None:
            assert tokens == want, rid
        assert len(tokens) >= 1 and all(t >= 0 for t in tokens)
    for i, (toks, text) in enumerate(reference[:len(PROMPTS)]):
        for k in range(N):
            assert sync[f"p{i}-stop{k}"][2:4] == ("stop", toks[k])
        # EOS: the rewritten generation config makes toks[3] of prompt 0 an EOS id.
        tokens, _, finish, stop_reason, _, _ = sync[f"p{i}-eos"]
        if eos_token in toks:
            assert tokens == toks[:toks.index(eos_token) + 1] and finish == "stop" and stop_reason is None
        str_out = sync[f"p{i}-str"]
        assert str_out[2] == "stop" and str_out[1] == text[:text.find(str_out[3])]
        pen = sync[f"p{i}-penalties"]
        assert len(pen[5]) == len(pen[0]) == N
    assert any(sync[f"p{i}-penalties"][0] != toks for i, (toks, _) in enumerate(reference[:len(PROMPTS)])), (
        "the penalties changed nothing: the test would not see them mishandled")
    assert sync["p0-eos"][2] == "stop"
    # Prefix hits happened in both modes (requests of one prompt share it); with a roomy cache the
    # second wave found the first wave's prefix. (Under a small cache, which blocks survive the
    # evictions depends on the step timing, which differs between the modes.)
    for mode in (False, True):
        assert any(r[4] > 0 for r in results[mode].values())
        if "num_kv_blocks" not in CONFIGS[config]:
            assert all(results[mode][f"shared{j}"][4] >= 16 for j in range(len(SHARED)))
    # Not vacuous: the async engine fed placeholders forward, the sync one never did, and the small
    # cache preempted in both.
    assert stats[True][1] > 0 and stats[False][1] == 0
    if "num_kv_blocks" in CONFIGS[config]:
        assert stats[False][0] > 0 and stats[True][0] > 0


@pytest.mark.parametrize("config", ["default", "small-cache"])
@pytest.mark.parametrize("steps", [1, 4])
def test_abort_mid_flight(steps, config, reference, eos_checkpoint, eos_token):
    reqs = [(f"r{i}", p, greedy(N, ignore_eos=True), reference[i][0]) for i, p in enumerate(PROMPTS)]
    reqs.append(("seeded", PROMPTS[1], SamplingParams(temperature=0.8, seed=3, max_tokens=N, ignore_eos=True),
                 None))
    results = {}
    for mode in (False, True):
        llm = make_llm(eos_checkpoint(eos_token), async_scheduling=mode, **CONFIGS[config])
        full = run(llm, reqs, wave_after=0)
        partial = run(llm, reqs, wave_after=steps, abort=["r1", "seeded"])
        results[mode] = (full, partial)
        for rid in ("r1", "seeded"):
            tokens, _, finish, _, _, _ = partial[rid]
            assert finish == "abort"
            assert tokens == full[rid][0][:len(tokens)], f"aborted {rid} diverged before the abort"
            assert len(tokens) <= steps
        for rid in ("r0", "r2"):
            assert partial[rid][:4] == full[rid][:4]
            assert partial[rid][0] == reference[int(rid[1])][0]
    # Sync and async agree on everything that was not aborted; the async partial output is at most
    # one token (the one in flight) shorter.
    for rid in results[False][0]:
        assert results[False][0][rid][:4] == results[True][0][rid][:4]
    for rid in ("r1", "seeded"):
        n_sync, n_async = len(results[False][1][rid][0]), len(results[True][1][rid][0])
        assert n_sync - 1 <= n_async <= n_sync


def test_async_equals_sync_moe(tiny_paths, hf_refs):
    """The MoE model under async scheduling, a small cache and chunked prefill: same tokens as sync
    and as transformers."""
    ref = hf_refs("tiny-qwen3-moe")
    prompts = random_prompts([4, 15, 9, 27], seed=33)
    want = [ref.greedy(p, N) for p in prompts]
    outs = {}
    for mode in (False, True):
        llm = make_llm(tiny_paths["tiny-qwen3-moe"], async_scheduling=mode, num_kv_blocks=12, block_size=4,
                       max_num_batched_tokens=10)
        outs[mode] = llm.generate(prompts, greedy(N))
        assert llm.engine.stats.preemptions > 0
        assert_drained(llm.engine)
    assert_tokens([o.token_ids for o in outs[True]], want, "async")
    assert [(o.token_ids, o.finish_reason) for o in outs[False]] == [(o.token_ids, o.finish_reason)
                                                                     for o in outs[True]]


def test_async_stream_and_min_tokens(reference, eos_checkpoint, eos_token):
    """Streaming deltas under async scheduling add up; min_tokens holds back EOS and stop ids the
    same way in both modes."""
    toks = reference[0][0]
    params = [greedy(N, min_tokens=5), greedy(N, ignore_eos=True, stop_token_ids=[toks[1]], min_tokens=3)]
    results = {}
    for mode in (False, True):
        llm = make_llm(eos_checkpoint(eos_token), async_scheduling=mode)
        outs = llm.generate([PROMPTS[0]] * 2, params)
        deltas = list(llm.stream(PROMPTS[2], greedy(N, ignore_eos=True)))
        assert "".join(d.new_text for d in deltas) == deltas[-1].text
        assert [t for d in deltas for t in d.new_token_ids] == deltas[-1].token_ids == reference[2][0]
        results[mode] = [(o.token_ids, o.finish_reason, o.stop_reason) for o in outs]
        assert eos_token not in outs[0].token_ids[:5] and len(outs[0].token_ids) >= 5
        assert toks[1] not in outs[1].token_ids[:3]
        # Leaving a stream early (its next token in flight under async): aborted, nothing leaks.
        for i, _ in enumerate(llm.stream(PROMPTS[1], greedy(N, ignore_eos=True))):
            if i == 1:
                break
        drain(llm.engine)
        assert_drained(llm.engine)
    assert results[False] == results[True]


def random_workload(seed):
    """Requests of random kinds (greedy, seeded top-p/top-k, penalties + min_tokens, logprobs, stop
    ids and strings), random lengths, half sharing one of three prefixes, arriving over 10 steps; a
    few are aborted at step 6."""
    import random

    rng = random.Random(seed)
    prefixes = random_prompts([rng.randint(4, 20) for _ in range(3)], seed=seed)
    reqs = []
    for i in range(rng.randint(10, 18)):
        p = random_prompts([rng.randint(1, 20)], seed=seed * 100 + i)[0]
        if rng.random() < 0.5:
            p = rng.choice(prefixes) + p
        kw = dict(max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.5)
        kind = rng.random()
        if kind < 0.4:
            kw.update(temperature=0)
        elif kind < 0.6:
            kw.update(temperature=0.9, top_p=0.9, seed=rng.randint(0, 99))
        elif kind < 0.75:
            kw.update(temperature=0, repetition_penalty=1.2, min_tokens=min(2, kw["max_tokens"]))
        else:
            kw.update(temperature=0.7, top_k=20, seed=rng.randint(0, 99), logprobs=1)
        if rng.random() < 0.3:
            kw.update(stop_token_ids=[rng.randint(3, 1023) for _ in range(30)])
        if rng.random() < 0.2:
            kw.update(stop=["e", "th"])
        reqs.append((f"q{i}", p, SamplingParams(**kw), rng.randint(0, 10), rng.random() < 0.1))
    return reqs


def run_arrivals(engine, reqs, abort_at=6):
    finals, step = {}, 0
    pending = sorted(reqs, key=lambda r: r[3])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            rid, prompt, params, _, _ = pending.pop(0)
            engine.add_request(prompt, params, request_id=rid)
        if step == abort_at:
            for rid, *_, abort in reqs:
                if abort and rid in engine.requests:
                    engine.abort_request(rid)
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
        assert step < 2000
    assert_drained(engine)
    return {rid: (o.token_ids, o.finish_reason, o.text) for rid, o in finals.items()}


def test_random_workloads_sync_async_and_configs_agree(dense_path):
    # The last: no prefix cache (a preempted request recomputes everything), two-token blocks.
    configs = [{}, {"num_kv_blocks": 16, "block_size": 4},
               {"num_kv_blocks": 18, "block_size": 4, "max_num_batched_tokens": 9, "max_num_seqs": 5},
               {"num_kv_blocks": 32, "block_size": 2, "max_num_batched_tokens": 5, "max_num_seqs": 3,
                "enable_prefix_caching": False}]
    engines = {(c, mode): make_llm(dense_path, async_scheduling=mode, **cfg).engine
               for c, cfg in enumerate(configs) for mode in (False, True)}
    # Seed 11: a request preempts itself when nobody else runs (an empty plan) and comes back
    # through a prefix hit; its input-batch row used to survive with the old block ids (async and
    # the small cache: tokens from the third on read other blocks' KV).
    for seed in (1, 3, 11):
        reqs = random_workload(seed)
        aborted = {r[0] for r in reqs if r[4]}
        results = {key: run_arrivals(engine, reqs) for key, engine in engines.items()}
        ref = results[(0, False)]
        assert set(ref) == {r[0] for r in reqs}
        for key, res in results.items():
            assert set(res) == set(ref)
            for rid in ref:
                if rid in aborted and "abort" in (res[rid][1], ref[rid][1]):
                    n = min(len(res[rid][0]), len(ref[rid][0]))
                    assert res[rid][0][:n] == ref[rid][0][:n], (key, rid)
                else:
                    assert res[rid] == ref[rid], (key, rid)
    assert all(engines[(c, mode)].stats.preemptions > 0 for c in (1, 3) for mode in (False, True))


def test_last_token_in_flight_is_not_scheduled_again(dense_path):
    """Async: a request whose last allowed token (max_tokens or max_model_len) is in flight gets no
    further step; one that stops on a token gets at most the one wasted step."""
    llm = make_llm(dense_path, async_scheduling=True, max_model_len=24)
    engine = llm.engine
    scheduled = {}
    real = engine.scheduler.schedule

    def schedule():
        out = real()
        for r, _ in out.scheduled:
            scheduled[r.request_id] = scheduled.get(r.request_id, 0) + 1
        return out
    engine.scheduler.schedule = schedule
    prompts = random_prompts([6, 9, 20], seed=34)
    ref = llm.generate(prompts[:1], greedy(6, ignore_eos=True))[0].token_ids
    scheduled.clear()
    for rid, prompt, params in [("m1", prompts[0], greedy(1, ignore_eos=True)),
                                ("m3", prompts[1], greedy(3, ignore_eos=True)),
                                ("len", prompts[2], greedy(4, ignore_eos=True)),      # 20 + 4 = max_model_len
                                ("stop", prompts[0], greedy(6, ignore_eos=True, stop_token_ids=[ref[1]]))]:
        engine.add_request(prompt, params, request_id=rid)
    finals = drain(engine)
    assert [len(finals[r].token_ids) for r in ("m1", "m3", "len")] == [1, 3, 4]
    assert scheduled["m1"] == 1 and scheduled["m3"] == 3 and scheduled["len"] == 4
    stop_at = ref.index(ref[1]) + 1
    assert finals["stop"].token_ids == ref[:stop_at]
    assert stop_at <= scheduled["stop"] <= stop_at + 1
    assert_drained(engine)


@pytest.mark.parametrize("how", ["stop", "abort"])
def test_request_id_reused_while_old_token_in_flight(how, dense_path):
    """Async: a request that stopped (or was aborted) still has a token in flight; a new request
    under the same id, added at once, takes the old one's input-batch row before that token is
    read back. The stale token must be dropped, not booked into the new request (rows, outputs,
    detokenizers and logprobs are found by id or by row), and nothing may leak. The new prompt's
    length puts the new request's first placeholder at the very index of the stale token, in the
    same row: only the row's epoch tells the two apart."""
    in_flight = 3 if how == "stop" else 2                # the old request's output index in flight
    prompts = random_prompts([7, 7 + in_flight], seed=35)
    llm = make_llm(dense_path, async_scheduling=True)
    engine = llm.engine
    ref = [o.token_ids for o in llm.generate(prompts, greedy(N, ignore_eos=True, logprobs=1))]
    stop = ref[0][2]
    assert stop not in ref[0][:2]
    # A request running on meanwhile: with nobody left, the step that reads the stop back would
    # settle the one it launched at once (test_last_finish_settles_the_step_in_flight).
    engine.add_request(prompts[1], greedy(N + 10, ignore_eos=True), request_id="bg")
    engine.add_request(prompts[0], greedy(N, ignore_eos=True, stop_token_ids=[stop] if how == "stop" else None,
                                          logprobs=1), request_id="x")
    old = engine.requests["x"]
    # Step 1 launches the prefill (token 0); step k launches token k-1 and reads token k-2 back.
    # "stop": step 4 reads the stop token 2 back, token 3 is in flight; "abort": after step 3,
    # tokens 0 and 1 are read back and token 2 is in flight.
    finals = {}
    for _ in range(4 if how == "stop" else 3):
        old_row = engine.runner.batch.row_of.get("x")
        finals.update({"old": o for o in engine.step() if o.finished})
    if how == "abort":
        assert not finals
        engine.abort_request("x")
        finals["old"] = engine.pending_outputs[-1]
        assert finals["old"].token_ids == ref[0][:2]
    assert finals["old"].finish_reason == how and finals["old"].token_ids == ref[0][:len(finals["old"].token_ids)]
    assert engine.inflight is not None and old in engine.inflight.requests and old.is_finished
    assert "x" not in engine.requests and old_row is not None
    new_id = "x"
    if how == "abort":
        # The abort's final output is still to come from step(): the id is not free until then (two
        # finished outputs under one id, before); the new request takes the old row under another.
        with pytest.raises(InvalidRequestError, match="request_id: 'x' is the id of a finished request"):
            engine.add_request(prompts[1], greedy(N, ignore_eos=True, logprobs=1), request_id="x")
        new_id = "y"
    engine.add_request(prompts[1], greedy(N, ignore_eos=True, logprobs=1), request_id=new_id)
    new = engine.requests[new_id]
    outs = []
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        outs += [o for o in engine.step() if o.request_id == new_id]
        if not outs:
            assert engine.runner.batch.row_of[new_id] == old_row    # the new request took the old one's row
    assert_drained(engine)
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids == ref[1]
    assert [lp["token"] for lp in outs[-1].logprobs] == ref[1]
    assert new.is_finished and finals["old"].token_ids == ref[0][:len(finals["old"].token_ids)]


@pytest.mark.parametrize("how", ["stream", "generate"])
def test_reset_prefix_cache_after_the_last_request_left_with_a_token_in_flight(how, dense_path):
    """Async: a stream abandoned half-way (or a generate() stopped by its callback) aborts its
    request and leaves its step in flight,
    though no request is left to run. reset_prefix_cache() returned False there (the load test's
    measured run then refused to start: 'the engine still has unfinished requests'), until the
    caller stepped an idle engine. It now settles that step itself (its token is dropped, as a step
    would drop it), forgets the cache and returns True; the prompt then computes in full."""
    llm = make_llm(dense_path, async_scheduling=True)
    engine = llm.engine
    prompt = random_prompts([40], seed=36)[0]
    first = llm.generate([prompt], greedy(ignore_eos=True))[0]
    if how == "stream":
        stream = llm.stream(prompt, greedy(ignore_eos=True))
        next(stream)
        next(stream)
        stream.close()
    else:
        def stop(out):
            if len(out.token_ids) == 2:
                raise KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            llm.generate([prompt], greedy(ignore_eos=True), on_output=stop)
    assert engine.inflight is not None and not engine.requests       # the case: a dead step in flight
    assert engine.block_manager.num_cached_blocks > 0
    assert llm.reset_prefix_cache() is True
    assert engine.block_manager.num_cached_blocks == 0
    assert_drained(engine)
    cold = llm.generate([prompt], greedy(ignore_eos=True))[0]
    assert cold.metrics.num_cached_tokens == 0 and cold.token_ids == first.token_ids
    assert_drained(engine)


@pytest.mark.parametrize("how", ["generate", "stream", "step"])
def test_last_finish_settles_the_step_in_flight(how, dense_path):
    """Async: a request ended by a stop token has one more step launched for it when its stop is
    read back. That step used to stay in flight after generate() or a stream returned, so
    has_unfinished_requests() said True on an engine with no request, until an idle step() read it.
    It is now read at once; the tokens are those of the sync engine."""
    prompts = random_prompts([9, 14], seed=41)
    sync = make_llm(dense_path, async_scheduling=False)
    ref = [o.token_ids for o in sync.generate(prompts, greedy(N, ignore_eos=True))]
    # Each stops at its first token from index 2 on that it has not produced before.
    params = [greedy(N, ignore_eos=True, stop_token_ids=[next(t for k, t in enumerate(r) if k >= 2 and t not in r[:k])])
              for r in ref]
    want = [o.token_ids for o in sync.generate(prompts, params)]
    assert all(2 < len(w) < N for w in want)
    llm = make_llm(dense_path, async_scheduling=True)
    engine = llm.engine
    if how == "generate":
        got = [o.token_ids for o in llm.generate(prompts, params)]
    elif how == "stream":
        got = [list(llm.stream(p, sp))[-1].token_ids for p, sp in zip(prompts, params)]
    else:
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        finals = {}
        while engine.requests:      # a caller's own loop, stopping when its requests are done
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        got = [finals[r].token_ids for r in ids]
    assert got == want
    assert engine.inflight is None and not engine.has_unfinished_requests()
    assert engine.step() == []
    assert_drained(engine)


def test_idle_after_an_abandoned_stream_has_no_unfinished_requests(dense_path):
    """Found by probing: after an abandoned stream (async) has_unfinished_requests() said True on an
    engine with no request left, until one more step(); the dead step is now settled when asked."""
    llm = make_llm(dense_path, async_scheduling=True)
    engine = llm.engine
    stream = llm.stream(random_prompts([12], seed=37)[0], greedy(ignore_eos=True))
    next(stream)
    next(stream)
    stream.close()
    assert engine.inflight is not None and not engine.requests       # the case: a dead step in flight
    assert engine.has_unfinished_requests() is False
    assert engine.inflight is None
    assert_drained(engine)
