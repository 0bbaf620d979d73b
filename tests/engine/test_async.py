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
    return {rid: (o.token_ids, o.text, o.finish_reason, o.stop_reason, o.metrics.num_cached_tokens)
            for rid, o in finals.items()}


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
    for rid, _, params, want in reqs + second:
        tokens, _, finish, stop_reason, _ = sync[rid]
        if want is not None:
            assert tokens == want, rid
        assert len(tokens) >= 1 and all(t >= 0 for t in tokens)
    for i, (toks, text) in enumerate(reference[:len(PROMPTS)]):
        for k in range(N):
            assert sync[f"p{i}-stop{k}"][2:4] == ("stop", toks[k])
        # EOS: the rewritten generation config makes toks[3] of prompt 0 an EOS id.
        tokens, _, finish, stop_reason, _ = sync[f"p{i}-eos"]
        if eos_token in toks:
            assert tokens == toks[:toks.index(eos_token) + 1] and finish == "stop" and stop_reason is None
        str_out = sync[f"p{i}-str"]
        assert str_out[2] == "stop" and str_out[1] == text[:text.find(str_out[3])]
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


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_abort_mid_flight(steps, reference, eos_checkpoint, eos_token):
    reqs = [(f"r{i}", p, greedy(N, ignore_eos=True), reference[i][0]) for i, p in enumerate(PROMPTS)]
    reqs.append(("seeded", PROMPTS[1], SamplingParams(temperature=0.8, seed=3, max_tokens=N, ignore_eos=True),
                 None))
    results = {}
    for mode in (False, True):
        llm = make_llm(eos_checkpoint(eos_token), async_scheduling=mode)
        full = run(llm, reqs, wave_after=0)
        partial = run(llm, reqs, wave_after=steps, abort=["r1", "seeded"])
        results[mode] = (full, partial)
        for rid in ("r1", "seeded"):
            tokens, _, finish, _, _ = partial[rid]
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
        assert_drained(llm.engine)
    assert results[False] == results[True]
