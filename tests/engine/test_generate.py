"""End-to-end generation on the CPU: greedy tokens equal transformers' generate (plain, with prefix-cache
hits, under preemption, with chunked prefill; dense and MoE), seeded sampling independent of the batch,
every stop condition, logprobs, streaming and incremental detokenization."""

import pytest

from engine_helpers import assert_drained, assert_tokens, drain, make_llm, random_prompts
from pcg_engine.engine.detokenizer import IncrementalDetokenizer
from pcg_engine.errors import InvalidRequestError
from pcg_engine.sampling_params import SamplingParams

PRESETS = ["tiny-qwen3", "tiny-qwen3-moe"]
LENGTHS = [3, 17, 8, 33, 12, 5]
MAX_TOKENS = 20


def greedy(max_tokens=MAX_TOKENS, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def engines(tiny_paths):
    """(preset, frozenset(config)) -> LLM, shared by the module's tests."""
    cache = {}

    def get(preset, **config):
        key = (preset, frozenset(config.items()))
        if key not in cache:
            cache[key] = make_llm(tiny_paths[preset], **config)
        llm = cache[key]
        assert_drained(llm.engine)
        return llm
    return get


def record_plans(engine):
    """Keep every SchedulerOutput the engine plans (to check that a case did what it claims)."""
    plans = []
    real = engine.scheduler.schedule

    def schedule():
        out = real()
        plans.append(out)
        return out
    engine.scheduler.schedule = schedule
    return plans


# ---- greedy equals transformers -----------------------------------------------------------------

CASES = {
    "plain": {},
    "preemption": {"num_kv_blocks": 7},                # 6 usable blocks of 16 for ~14 blocks of work
    "chunked": {"max_num_batched_tokens": 8},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_matches_transformers(preset, case, engines, hf_refs):
    llm = engines(preset, **CASES[case])
    ref = hf_refs(preset)
    prompts = random_prompts(LENGTHS, seed=1)
    want = [ref.greedy(p, MAX_TOKENS) for p in prompts]
    plans = record_plans(llm.engine)
    preempted0 = llm.engine.stats.preemptions
    outs = llm.generate(prompts, greedy())
    assert_tokens([o.token_ids for o in outs], want, case)
    for o, w, p in zip(outs, want, prompts):
        assert o.finish_reason == ("stop" if w[-1] in ref.eos else "length")
        assert o.finished and o.prompt_token_ids == p
    if case == "preemption":
        assert llm.engine.stats.preemptions > preempted0, "the small cache forced no preemption"
    if case == "chunked":
        assert any(not s for p in plans for s in p.samples), "no prefill was chunked"
        assert max(p.num_batched_tokens for p in plans) <= 8
    assert_drained(llm.engine)


@pytest.mark.parametrize("preset", PRESETS)
def test_prefix_cache_hits_match_transformers(preset, engines, hf_refs):
    llm = engines(preset)
    ref = hf_refs(preset)
    prefix = random_prompts([40], seed=2)[0]
    suffixes = random_prompts([1, 5, 9, 16], seed=3)
    prompts = [prefix + s for s in suffixes]
    want = [ref.greedy(p, MAX_TOKENS) for p in prompts]
    first = llm.generate(prompts[:1], greedy())
    assert first[0].finished
    outs = llm.generate(prompts[1:], greedy())     # submitted after the first one finished
    assert_tokens([o.token_ids for o in first + outs], want, "prefix")
    for o in outs:
        assert o.metrics.num_cached_tokens > 0, "no prefix-cache hit"
        assert o.metrics.num_cached_tokens % llm.config.block_size == 0
        assert o.metrics.num_cached_tokens <= len(prefix)
    # The same prompt again hits everything but its last (partial) block.
    again = llm.generate(prompts[1:2], greedy())
    assert again[0].token_ids == want[1]
    assert again[0].metrics.num_cached_tokens >= len(prefix) // 16 * 16
    assert_drained(llm.engine)


def test_reset_prefix_cache_makes_the_next_prompt_miss(engines):
    """What a benchmark's measured run needs (bench/load_test.py): after a reset the same prompt is
    computed in full, with the same tokens, and no block is lost. Refused while a request is unfinished."""
    llm = engines("tiny-qwen3")
    engine = llm.engine
    prompt = random_prompts([40], seed=4)[0]
    first = llm.generate([prompt], greedy())[0]
    again = llm.generate([prompt], greedy())[0]
    assert again.metrics.num_cached_tokens == 32 and again.token_ids == first.token_ids
    free, cached = engine.block_manager.num_free_blocks, engine.block_manager.num_cached_blocks
    assert cached > 0 and free == engine.block_manager.num_total_blocks
    rid = engine.add_request(prompt, greedy())
    assert llm.reset_prefix_cache() is False                # unfinished: nothing forgotten
    assert engine.block_manager.num_cached_blocks == cached
    drain(engine)
    assert rid not in engine.requests
    assert llm.reset_prefix_cache() is True
    assert engine.block_manager.num_cached_blocks == 0 and engine.block_manager.num_free_blocks == free
    cold = llm.generate([prompt], greedy())[0]
    assert cold.metrics.num_cached_tokens == 0 and cold.token_ids == first.token_ids
    assert_drained(llm.engine)


def test_reset_prefix_cache_right_after_an_abort(engines):
    """An aborted request's output still waiting for step() holds no block: the reset goes through
    (it answered False on an engine whose caller had just aborted everything), and the aborted
    request's final output still comes on the next step."""
    llm = engines("tiny-qwen3")
    engine = llm.engine
    prompt = random_prompts([40], seed=5)[0]
    rid = engine.add_request(prompt, greedy())
    engine.step()                                           # computed, its full blocks published
    engine.abort_request(rid)
    assert engine.has_unfinished_requests()                 # the abort's output is not read yet
    assert engine.block_manager.num_cached_blocks > 0
    assert llm.reset_prefix_cache() is True
    assert engine.block_manager.num_cached_blocks == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    finals = drain(engine)
    assert list(finals) == [rid] and finals[rid].finish_reason == "abort"
    assert_drained(engine)


def test_a_caller_id_whose_final_output_is_pending_is_refused(engines):
    """Found by probing: an aborted request's id taken again before step() returned the abort's
    output gave the caller two finished outputs under one id (the abort's first, taken for the new
    request's end). Refused by name until then; free afterwards."""
    llm = engines("tiny-qwen3")
    engine = llm.engine
    engine.add_request([5, 6, 7], greedy(), request_id="x")
    engine.step()
    engine.abort_request("x")
    with pytest.raises(InvalidRequestError, match="request_id: 'x' is the id of a finished request whose final "
                                                  "output step\\(\\) has not returned yet") as info:
        engine.add_request([9, 9, 9], greedy(), request_id="x")
    assert info.value.field == "request_id"
    finals = drain(engine)
    assert finals["x"].finish_reason == "abort"
    engine.add_request([9, 9, 9], greedy(max_tokens=3), request_id="x")
    assert drain(engine)["x"].finish_reason == "length"
    assert_drained(engine)


def test_preemption_with_prefix_cache_and_chunking_together(engines, hf_refs):
    """The three mechanisms at once, with a mixed batch of shared-prefix and unrelated prompts."""
    llm = engines("tiny-qwen3", num_kv_blocks=12, max_num_batched_tokens=12, block_size=4)
    ref = hf_refs("tiny-qwen3")
    prefix = random_prompts([10], seed=4)[0]
    prompts = [prefix + s for s in random_prompts([2, 7], seed=5)] + random_prompts([6, 11, 3], seed=6)
    want = [ref.greedy(p, 12) for p in prompts]
    before = llm.engine.stats.preemptions
    outs = llm.generate(prompts, greedy(12))
    assert_tokens([o.token_ids for o in outs], want, "mixed")
    assert llm.engine.stats.preemptions > before
    assert_drained(llm.engine)


# ---- seeded sampling ----------------------------------------------------------------------------

def test_seeded_sampling_is_independent_of_the_batch(engines):
    llm = engines("tiny-qwen3")
    prompts = random_prompts([5, 14, 9, 21], seed=7)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=16, ignore_eos=True)
              for i in range(len(prompts))]
    alone = [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    # In one batch, in reverse order, next to an unseeded sampler and a greedy request.
    extra = random_prompts([6, 10], seed=8)
    batch_prompts = extra[:1] + prompts[::-1] + extra[1:]
    batch_params = ([SamplingParams(temperature=1.0, max_tokens=16)] + params[::-1]
                    + [greedy(16)])
    together = [o.token_ids for o in llm.generate(batch_prompts, batch_params)][1:-1][::-1]
    assert_tokens(together, alone, "seeded")
    # Not vacuous: sampling is not greedy, and different seeds differ.
    greedy_out = [o.token_ids for o in llm.generate(prompts, greedy(16, ignore_eos=True))]
    assert alone != greedy_out
    reseeded = llm.generate(prompts[:1], SamplingParams(temperature=0.8, top_p=0.9, seed=999, max_tokens=16,
                                                        ignore_eos=True))[0].token_ids
    assert reseeded != alone[0]
    assert_drained(llm.engine)


# ---- stop conditions ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_run(engines):
    """Greedy outputs of a few prompts with ignore_eos: what the stop tests cut."""
    llm = engines("tiny-qwen3")
    prompts = random_prompts([4, 11, 19], seed=9)
    outs = llm.generate(prompts, greedy(24, ignore_eos=True))
    return prompts, [o.token_ids for o in outs], [o.text for o in outs]


def test_stop_token_ids(engines, plain_run):
    llm = engines("tiny-qwen3")
    prompts, refs, _ = plain_run
    cases = []
    for prompt, ref in zip(prompts, refs):
        for k in (0, 1, 5, len(ref) - 1):
            cases.append((prompt, ref, ref[k]))
    outs = llm.generate([c[0] for c in cases],
                        [greedy(24, ignore_eos=True, stop_token_ids=[c[2]]) for c in cases])
    for (prompt, ref, stop), out in zip(cases, outs):
        k = ref.index(stop)               # the first occurrence stops it
        assert out.token_ids == ref[:k + 1]
        assert out.finish_reason == "stop" and out.stop_reason == stop
    assert_drained(llm.engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_stop_token_text_is_left_out(engines, plain_run, eos_checkpoint, async_scheduling):
    """A stop token (stop_token_ids, EOS) ends the output but its text is not in it, as vLLM's
    detokenizer leaves it out (include_stop_str_in_output=False skips the stop-terminated token)
    and as a stop string is left out. Reference: the text of the same tokens without the stop
    token, ended by max_tokens; streamed deltas add up to it too."""
    prompts, refs, _ = plain_run
    tokenizer = engines("tiny-qwen3").tokenizer
    cases = []       # (checkpoint, prompt, params, output length with the stop token)
    for prompt, ref in zip(prompts, refs):
        for k in (1, 5, len(ref) - 1):
            if ref.index(ref[k]) == k and tokenizer.decode([ref[k]]):  # a first occurrence with text
                cases.append((None, prompt, greedy(24, ignore_eos=True, stop_token_ids=[ref[k]]), k + 1))
    eos = refs[1][6]
    cases.append((eos_checkpoint(eos), prompts[1], greedy(24, skip_special_tokens=False), refs[1].index(eos) + 1))
    assert len(cases) >= 4
    for path, prompt, params, n in cases:
        llm = (engines("tiny-qwen3", async_scheduling=async_scheduling) if path is None
               else make_llm(path, async_scheduling=async_scheduling))
        out = llm.generate([prompt], params)[0]
        assert out.finish_reason == "stop" and len(out.token_ids) == n
        without = llm.generate([prompt], greedy(n - 1, ignore_eos=True))[0] if n > 1 else None
        want = without.text if without is not None else ""
        assert without is None or without.token_ids == out.token_ids[:-1]
        assert out.text == want, (tokenizer.decode([out.token_ids[-1]]), out.text, want)
        assert "".join(o.new_text for o in llm.stream(prompt, params)) == want
        drain(llm.engine)          # async: the stream returns with the step after its stop in flight
        assert_drained(llm.engine)
        if path is not None:
            llm.close()


def test_stop_token_ids_respect_min_tokens(engines, plain_run):
    llm = engines("tiny-qwen3")
    prompts, refs, _ = plain_run
    stop = refs[0][1]
    out = llm.generate(prompts[:1], greedy(24, ignore_eos=True, stop_token_ids=[stop], min_tokens=6))[0]
    assert stop not in out.token_ids[:6]          # masked while fewer than min_tokens
    assert len(out.token_ids) >= 6
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == stop and stop not in out.token_ids[:-1]
    assert out.token_ids[:1] == refs[0][:1]


def test_stop_strings(engines, plain_run):
    llm = engines("tiny-qwen3")
    prompts, refs, texts = plain_run
    cases = []
    for prompt, ref, text in zip(prompts, refs, texts):
        # A stop string taken from the middle of the text, one spanning a token boundary, and one
        # that never occurs.
        clean = [i for i in range(2, len(text) - 4) if "\ufffd" not in text[i:i + 3]]
        i = clean[len(clean) // 2]
        cases += [(prompt, ref, text, text[i:i + 3]), (prompt, ref, text, text[i + 1:i + 2]),
                  (prompt, ref, text, "\x00never\x00")]
    outs = llm.generate([c[0] for c in cases],
                        [greedy(24, ignore_eos=True, stop=[c[3]]) for c in cases])
    for (prompt, ref, text, stop), out in zip(cases, outs):
        cut = text.find(stop)
        if cut < 0:
            assert out.text == text and out.finish_reason == "length" and out.token_ids == ref
            continue
        assert out.text == text[:cut], (stop, out.text, text)
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.token_ids == ref[:len(out.token_ids)]      # generation stopped, not diverged
        # It stopped at the token that completed the stop string, not later.
        assert stop in llm.tokenizer.decode(out.token_ids) or stop in llm.tokenizer.decode(
            prompt[-4:] + out.token_ids)
        before = llm.tokenizer.decode(out.token_ids[:-1])
        # (unless a character split across tokens held the text back until the last token)
        assert stop not in before or before.endswith("\ufffd")
    assert_drained(llm.engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_max_tokens_and_max_model_len(tiny_paths, hf_refs, async_scheduling):
    llm = make_llm(tiny_paths["tiny-qwen3"], max_model_len=32, async_scheduling=async_scheduling)
    ref = hf_refs("tiny-qwen3")
    prompt = random_prompts([20], seed=10)[0]
    want = ref.greedy(prompt, 12, stop_at_eos=False)
    outs = llm.generate([prompt, prompt, prompt],
                        [greedy(1, ignore_eos=True), greedy(5, ignore_eos=True), greedy(12, ignore_eos=True)])
    assert [o.token_ids for o in outs] == [want[:1], want[:5], want]   # 12 = max_model_len - prompt
    assert all(o.finish_reason == "length" and o.stop_reason is None for o in outs)
    with pytest.raises(InvalidRequestError, match=r"max_tokens.*1\.\.12"):
        llm.generate([prompt], greedy(13))
    assert_drained(llm.engine)


def test_truncate_prompt_tokens(engines, hf_refs):
    llm = engines("tiny-qwen3")
    prompt = random_prompts([30], seed=13)[0]
    out = llm.generate([prompt], greedy(6, ignore_eos=True, truncate_prompt_tokens=10))[0]
    assert out.prompt_token_ids == prompt[-10:]
    assert out.token_ids == hf_refs("tiny-qwen3").greedy(prompt[-10:], 6, stop_at_eos=False)
    assert_drained(llm.engine)


def test_eos_stops_unless_ignored(plain_run, eos_checkpoint):
    """EOS taken from the generation config: point it at a token the model produces, then compare
    with transformers, which reads the same file."""
    from engine_helpers import HFReference

    prompts, refs, _ = plain_run
    eos = refs[1][6]
    path = eos_checkpoint(eos)
    llm = make_llm(path)
    assert eos in llm.engine.eos_token_ids
    ref = HFReference(path)
    outs = llm.generate(prompts, greedy(24))
    for prompt, full, out in zip(prompts, refs, outs):
        want = ref.greedy(prompt, 24)              # transformers stops at the same EOS
        assert out.token_ids == want
        if eos in full:
            assert out.token_ids == full[:full.index(eos) + 1]
            assert out.finish_reason == "stop" and out.stop_reason is None
        else:
            assert out.finish_reason == "length"
    assert outs[1].finish_reason == "stop"
    ignored = llm.generate(prompts[1:2], greedy(24, ignore_eos=True))[0]
    assert ignored.token_ids == refs[1] and ignored.finish_reason == "length"
    assert_drained(llm.engine)


# ---- logprobs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", PRESETS)
def test_logprobs_match_transformers(preset, engines, hf_refs):
    llm = engines(preset)
    ref = hf_refs(preset)
    prompts = random_prompts([7, 13], seed=11)
    outs = llm.generate(prompts, [greedy(10, ignore_eos=True, logprobs=3),
                                  SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True,
                                                 logprobs=0)])
    for prompt, out, n in zip(prompts, outs, (3, 0)):
        assert len(out.logprobs) == len(out.token_ids) == 10
        lp = ref.logprobs(prompt, out.token_ids)
        for i, (entry, token) in enumerate(zip(out.logprobs, out.token_ids)):
            assert entry["token"] == token
            assert entry["logprob"] <= 0
            assert entry["logprob"] == pytest.approx(lp[i, token].item(), abs=1e-4)
            assert len(entry["top"]) == n
            if n:
                ids = [t for t, _ in entry["top"]]
                values = [v for _, v in entry["top"]]
                assert values == sorted(values, reverse=True)
                assert ids[0] == token                   # greedy took the most likely token
                assert values[0] == pytest.approx(entry["logprob"], abs=1e-6)
                top = lp[i].topk(n)
                assert ids == top.indices.tolist()
                assert values == pytest.approx(top.values.tolist(), abs=1e-4)
    # Without logprobs asked, none are returned.
    assert llm.generate(prompts[:1], greedy(3))[0].logprobs is None
    assert_drained(llm.engine)


# ---- streaming ----------------------------------------------------------------------------------

def test_stream_deltas_add_up(engines):
    llm = engines("tiny-qwen3")
    engine = llm.engine
    others = random_prompts([9, 4], seed=12)
    for i, p in enumerate(others):           # requests running alongside the stream
        engine.add_request(p, greedy(30, ignore_eos=True), request_id=f"other-{i}")
    prompt = "Café 中文 🙂 the quick brown fox"
    deltas = list(llm.stream(prompt, greedy(20, ignore_eos=True)))
    final = deltas[-1]
    assert final.finished and all(not d.finished for d in deltas[:-1])
    assert "".join(d.new_text for d in deltas) == final.text
    assert [t for d in deltas for t in d.new_token_ids] == final.token_ids
    assert len(final.token_ids) == 20
    rest = drain(engine)
    assert set(rest) == {"other-0", "other-1"}
    alone = llm.generate([prompt], greedy(20, ignore_eos=True))[0]
    assert alone.token_ids == final.token_ids and alone.text == final.text
    # A stop string straddling two deltas: the first half must not have been streamed already.
    text, bounds, b = final.text, [], 0
    for d in deltas[:-1]:
        b += len(d.new_text)
        stop_at = text[b - 1:b + 1]
        if d.new_text and len(stop_at) == 2 and "\ufffd" not in stop_at and text.find(stop_at) == b - 1:
            bounds.append(stop_at)
    assert bounds, "no delta boundary to place a stop string on"
    for stop_at in bounds[:2]:
        cut = list(llm.stream(prompt, greedy(20, ignore_eos=True, stop=stop_at)))
        assert "".join(d.new_text for d in cut) == cut[-1].text == text[:text.find(stop_at)]
        assert cut[-1].finish_reason == "stop" and cut[-1].stop_reason == stop_at
    # Leaving a stream early aborts its request: nothing leaks.
    for i, _ in enumerate(llm.stream(prompt, greedy(20, ignore_eos=True))):
        if i == 2:
            break
    drain(engine)
    assert_drained(engine)


# ---- detokenization -----------------------------------------------------------------------------

TEXTS = [
    "Café crème brûlée à São Paulo, naïve façade.",
    "中文：你好，世界。我们今天学习机器学习。",
    "Emoji: 🙂 😀 🚀 👩‍💻 🇫🇷 ❤️ done",
    "Straße, Ærøskøbing, Kraków — “quotes” … ∑ ≈ €",
    "日本語：こんにちは世界。한국어: 안녕하세요",
    "mixed ascii then 🎉🔥 and Ελληνικά: καλημέρα",
]




@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_changing_an_outputs_prompt_leaves_the_request_alone(engines, async_scheduling):
    """out.prompt_token_ids was the running request's own list: a stream consumer building its next
    prompt in place (ctx = out.prompt_token_ids; ctx += out.token_ids) lengthened the request's
    prompt, so it ran past max_tokens and its outputs were cut at the wrong place."""
    llm = engines("tiny-qwen3", async_scheduling=async_scheduling)
    prompt = random_prompts([6], seed=14)[0]
    want = llm.generate([prompt], greedy(4, ignore_eos=True))[0].token_ids
    outs = []
    for out in llm.stream(prompt, greedy(4, ignore_eos=True)):
        ctx = out.prompt_token_ids
        ctx += out.token_ids
        outs.append(out)
    assert len(outs) == 4 and outs[-1].token_ids == want
    assert all(o.prompt_token_ids == prompt for o in outs)
    assert_drained(llm.engine)

def test_outputs_carry_the_prompt_text_as_given(engines):
    """Found by probing (session 41): RequestOutput.prompt, a documented field, was always None, and
    read-only (a class attribute outside __slots__), so no front end could set it either."""
    from pcg_engine.outputs import DecodeOutput
    llm = engines("tiny-qwen3")
    text, ids = "Hello there, world", random_prompts([5], seed=15)[0]
    by_text, by_ids = llm.generate([text, ids], greedy(3))
    assert by_text.prompt == text and by_ids.prompt is None
    # truncated ids keep the text as given
    cut = llm.generate([text], greedy(2, truncate_prompt_tokens=2))[0]
    assert cut.prompt == text and len(cut.prompt_token_ids) == 2
    # streamed: the bulk-booked outputs of one token and no text too (DecodeOutput)
    outs = list(llm.stream(text, greedy(4, ignore_eos=True, detokenize=False)))
    assert any(isinstance(o, DecodeOutput) for o in outs) and all(o.prompt == text for o in outs)
    assert all(o.error is None for o in outs)
    assert_drained(llm.engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_streamed_outputs_keep_the_logprobs_of_their_step(engines, async_scheduling):
    """An output is a snapshot of its step: its logprobs, like its token_ids, stop at that step.
    They were the engine's live list, so every streamed output read after the request finished
    held the logprobs of all its tokens (output k: k+1 token ids, max_tokens logprobs)."""
    llm = engines("tiny-qwen3", async_scheduling=async_scheduling)
    outs = list(llm.stream(random_prompts([5], seed=13)[0], greedy(5, ignore_eos=True, logprobs=1)))
    assert len(outs) == 5
    assert [len(o.logprobs) for o in outs] == [len(o.token_ids) for o in outs] == [1, 2, 3, 4, 5]
    for o in outs:
        assert [lp["token"] for lp in o.logprobs] == o.token_ids
        assert o.logprobs == outs[-1].logprobs[:len(o.token_ids)]
    assert_drained(llm.engine)

@pytest.fixture(scope="module")
def tokenizer(dense_path):
    from pcg_engine.engine.tokenizer import load_tokenizer
    return load_tokenizer(dense_path)


def test_incremental_detokenizer_multibyte(tokenizer):
    split_chars = 0
    prompt = tokenizer("Say: ", add_special_tokens=False)["input_ids"]
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        split_chars += sum("\ufffd" in tokenizer.decode([i]) for i in ids)
        detok = IncrementalDetokenizer(tokenizer, prompt)
        deltas = [detok.add(t) for t in ids]
        deltas.append(detok.flush())
        assert "".join(deltas) == detok.text == tokenizer.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas), "a partial character was emitted"
        # With a stop string that never matches, text is held back and flushed at the end.
        held = IncrementalDetokenizer(tokenizer, prompt, stop=["\x00never-matches"])
        deltas = [held.add(t) for t in ids] + [held.flush()]
        assert "".join(deltas) == held.text == text and held.stopped_by is None
        # Every prefix of the emitted text is a prefix of the final text (nothing is revised).
        for n in range(1, len(ids)):
            partial = IncrementalDetokenizer(tokenizer, prompt)
            for t in ids[:n]:
                partial.add(t)
            assert text.startswith(partial.text)
    assert split_chars > 10, "the texts never split a character across tokens: the test tests nothing"


def test_incremental_detokenizer_stop_strings_multibyte(tokenizer):
    text = TEXTS[1]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for stop in ("世界", "学习", "。", "你"):
        detok = IncrementalDetokenizer(tokenizer, [5, 6], stop=[stop, "never"])
        emitted = ""
        for t in ids:
            emitted += detok.add(t)
            if detok.stopped_by is not None:
                break
        assert detok.stopped_by == stop
        assert emitted == detok.text == text[:text.find(stop)]


def test_stop_string_before_min_tokens_then_a_split_character_is_not_decoded_twice(tokenizer):
    """Found by probing: a stop string wholly before the min_tokens-th token (so no stop), then a
    token that starts a multi-byte character: the complete part of that token was appended without
    moving the decode offsets, and the next token decoded it again (' val  ' for ' val ')."""
    cases = 0
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for k in range(1, len(ids) - 1):
            before = tokenizer.decode(ids[:k + 1])
            now = tokenizer.decode(ids[:k + 2])
            stop = before.rstrip("\ufffd")[-2:]
            if (len(stop) < 2 or not now.endswith("\ufffd") or len(now.rstrip("\ufffd")) <= len(before)
                    or tokenizer.decode(ids).count(stop) != 1):
                continue
            # the stop string ends with token k, one before min_tokens (k + 2); a long second stop
            # string keeps enough text held back to hold the first one whole
            detok = IncrementalDetokenizer(tokenizer, [5], stop=[stop, "\x00" * 12], min_tokens=k + 2)
            deltas = [detok.add(t) for t in ids] + [detok.flush()]
            assert detok.stopped_by is None and "".join(deltas) == detok.text == tokenizer.decode(ids), (text, k)
            cases += 1
    assert cases >= 3, "no token split a character after a stop string: the test tests nothing"


def _text_before_token(tokenizer, ids, k):
    """The final text of ids[:k]: its decoding without a character the next tokens may complete."""
    return tokenizer.decode(ids[:k]).rstrip("\ufffd") if k > 0 else ""


def test_stop_string_counts_only_where_it_ends_past_the_first_min_tokens_tokens(tokenizer):
    """The rule the detokenizer states, against a reference on the whole text: with min_tokens m, a
    stop string counts where it ends past the final text of the first m tokens, as vLLM's
    detokenizer and as EOS (masked until m tokens are out; a review found the rule one token early:
    min_tokens=1 with stop ["\n"] returned an empty text). Found by
    probing: a stop string wholly in the text of a token before the m-th that also starts a
    multi-byte character (' \xe2\x88' then '\x9f') counted, since that text first reached the
    stop search inside the m-th token's delta; the same text tokenized otherwise did not stop."""
    cases = 0
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        whole = tokenizer.decode(ids)
        for stop in {" ", "，", "：", "a", "o", "世", "é"} & set(whole):
            for m in range(1, len(ids) + 1):
                boundary = len(_text_before_token(tokenizer, ids, m))
                ends = [i + len(stop) for i in range(len(whole)) if whole.startswith(stop, i)]
                counted = [e for e in ends if e > boundary]
                detok = IncrementalDetokenizer(tokenizer, [5, 6], stop=[stop], min_tokens=m)
                deltas = []
                for t in ids:
                    deltas.append(detok.add(t))
                    if detok.stopped_by is not None:
                        break
                else:
                    deltas.append(detok.flush())
                expected = whole[:counted[0] - len(stop)] if counted else whole
                assert (detok.text, detok.stopped_by) == (expected, stop if counted else None), (text, stop, m)
                assert "".join(deltas) == detok.text
                # the case of the bug: a stop string before the boundary, and a token before the
                # m-th that leaves a character split
                cases += any(e <= boundary for e in ends) and any(
                    tokenizer.decode(ids[:k]).endswith("\ufffd") for k in range(1, m))
    assert cases > 10, "no stop string before min_tokens met a split character: the test tests nothing"


def test_the_min_tokens_rule_holds_for_a_request_ending_inside_a_character(tokenizer):
    """The same rule where the output ends (max_tokens) inside a character: flush() searched the
    held text of the first min_tokens tokens too (found by review)."""
    cases = 0
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for n in range(2, len(ids)):
            whole = tokenizer.decode(ids[:n])
            if not whole.endswith("\ufffd"):
                continue
            for stop in {" ", "，", "：", "a", "o"} & set(whole):
                ends = [i + len(stop) for i in range(len(whole)) if whole.startswith(stop, i)]
                for m in range(1, n + 1):
                    boundary = len(_text_before_token(tokenizer, ids, m))
                    counted = [e for e in ends if e > boundary]
                    detok = IncrementalDetokenizer(tokenizer, [5, 6], stop=[stop], min_tokens=m)
                    for t in ids[:n]:
                        detok.add(t)
                        if detok.stopped_by is not None:
                            break
                    else:
                        detok.flush()
                    expected = whole[:counted[0] - len(stop)] if counted else whole
                    assert (detok.text, detok.stopped_by) == (expected, stop if counted else None), (text, n, stop, m)
                    cases += not counted and bool(ends)
    assert cases > 10, "no run ended inside a character after an uncounted stop string: the test tests nothing"


def test_stop_string_in_a_token_that_starts_a_character_stops_there(tokenizer):
    """A token can end a stop string and start a multi-byte character (' \\xc3', 'r\\xc3'): the
    request stops at that token. Its text was held back whole until the character completed, so
    the stop string was seen a token later (one extra token in token_ids), or only by flush at
    max_tokens, after the request had ended for its length."""
    cases = 0
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for k in range(len(ids)):
            before = tokenizer.decode(ids[:k]).rstrip("\ufffd")
            now = tokenizer.decode(ids[:k + 1])
            complete = now.rstrip("\ufffd")
            if not now.endswith("\ufffd") or len(complete) <= len(before):
                continue
            stop = complete[-2:]
            first = text.find(stop)
            if first + len(stop) != len(complete):
                continue              # the stop string occurs earlier: another token's case
            cases += 1
            detok = IncrementalDetokenizer(tokenizer, [5, 6], stop=["never", stop])
            emitted, stopped_at = "", None
            for i, t in enumerate(ids):
                emitted += detok.add(t)
                if detok.stopped_by is not None:
                    stopped_at = i
                    break
            assert (stopped_at, detok.stopped_by) == (k, stop), (text, k, stop)
            assert emitted == detok.text == text[:first]
    assert cases > 3, "no token ended a stop string and started a character: the test tests nothing"


class CountingTokenizer:
    """A tokenizer that counts the token ids it is asked to decode."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_skipped_special_tokens_do_not_grow_the_window(tokenizer):
    """A run of special tokens left out of the text (<|endoftext|> after the end, with ignore_eos)
    stayed in the decode window, which grew by one token a step: every token decoded the whole run
    (quadratic: 4096 of them took 1.7 s on the CPU, the serving loop stalled for every request)."""
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text_ids = tokenizer(TEXTS[2], add_special_tokens=False)["input_ids"]
    ids = text_ids[:5] + [pad] * 1000 + text_ids[5:]
    for skip in (True, False):
        counting = CountingTokenizer(tokenizer)
        detok = IncrementalDetokenizer(counting, [5, 6], skip_special_tokens=skip)
        deltas = [detok.add(t) for t in ids] + [detok.flush()]
        assert "".join(deltas) == detok.text == tokenizer.decode(ids, skip_special_tokens=skip)
        # Two decodes a token of a window of a few tokens (a character spans at most 4).
        assert counting.decoded <= 16 * len(ids), (skip, counting.decoded)


def test_bytes_that_never_complete_a_character_stream_in_linear_time(tokenizer):
    """A token repeated that starts a character and never completes it (' \\xc3' ' \\xc3' ...: a model
    stuck repeating one token) kept the window ending in U+FFFD: nothing was streamed until the
    end and every token decoded the whole run (quadratic: 2048 of them took 0.5 s on the CPU)."""
    ids = [t for text in TEXTS for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    stuck = [t for t in dict.fromkeys(ids) if tokenizer.decode([t]).endswith("\ufffd") and len(tokenizer.decode([t])) > 1
             and tokenizer.decode([t, t]) == 2 * tokenizer.decode([t])]
    assert stuck, "no token starts a character it cannot complete by itself: the test tests nothing"
    tail = tokenizer(TEXTS[1], add_special_tokens=False)["input_ids"]
    for t in stuck[:3]:
        for stop in (None, ["\x00never-matches"]):
            run = [t] * 500 + tail
            counting = CountingTokenizer(tokenizer)
            detok = IncrementalDetokenizer(counting, [5, 6], stop=stop)
            deltas = [detok.add(i) for i in run] + [detok.flush()]
            assert "".join(deltas) == detok.text == tokenizer.decode(run)
            assert "".join(deltas[:20]), "nothing streamed while the run went on"
            assert counting.decoded <= 16 * len(run), (t, counting.decoded)
    # Ids past the vocabulary (a model's padded rows) decode to nothing: a character split across
    # a run of them still completes, however long the window gets.
    past = len(tokenizer)
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for k in (k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")):
            run = ids[:k] + [past] * 6 + ids[k:]
            detok = IncrementalDetokenizer(tokenizer, [5, 6])
            assert "".join([detok.add(i) for i in run] + [detok.flush()]) == tokenizer.decode(run) == text


def test_incremental_detokenizer_prompt_ending_inside_a_character(tokenizer):
    """A token-id prompt that ends inside a character (a continuation of an output cut at
    max_tokens mid-emoji): the output's text is its own tokens' decoding. The window started in
    the prompt, whose text ended in U+FFFD; the first output token completed the character, the
    text got no longer, and the next delta was cut past it: the character vanished."""
    cases = 0
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for k in range(1, len(ids)):
            if not tokenizer.decode(ids[:k]).endswith("\ufffd"):
                continue
            cases += 1
            prompt, out = ids[max(0, k - 4):k], ids[k:]
            for stop in (None, ["\x00never-matches"]):
                detok = IncrementalDetokenizer(tokenizer, prompt, stop=stop)
                deltas = [detok.add(t) for t in out] + [detok.flush()]
                assert "".join(deltas) == detok.text == tokenizer.decode(out), (text, k, stop)
    assert cases > 5, "no prompt ended inside a character: the test tests nothing"


def test_generated_text_is_decoded_tokens(engines, tokenizer):
    """Text prompts in several scripts: the engine's text equals decoding its tokens at once."""
    llm = engines("tiny-qwen3")
    outs = llm.generate(TEXTS, greedy(16, ignore_eos=True))
    for out in outs:
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert_drained(llm.engine)


def test_detokenize_false_gives_no_text(engines):
    llm = engines("tiny-qwen3")
    out = llm.generate(["hello"], greedy(4, detokenize=False))[0]
    assert out.text == "" and len(out.token_ids) == 4
    with_text = llm.generate(["hello"], greedy(4))[0]
    assert with_text.token_ids == out.token_ids and with_text.text != ""


def test_close_releases_the_kv_cache_and_weights(dense_path):
    """LLM.close frees device memory at once, even while the caller still holds the LLM object."""
    import weakref
    from pcg_engine.llm import LLM
    with LLM(str(dense_path), device="cpu", num_kv_blocks=16) as llm:
        out = llm.generate([[5, 6, 7]], greedy(max_tokens=3))
        assert len(out[0].token_ids) == 3
        kv = weakref.ref(llm.engine.runner.kv_caches[0])
        weight = weakref.ref(next(llm.engine.runner.model.parameters()))
    assert kv() is None and weight() is None


@pytest.mark.gpu
def test_close_releases_the_kv_cache_after_piecewise_replays(dense_path):
    """Replay programs hold the KV caches their attention ops take (compile/replay_program.py),
    and the compiled forward can outlive the runner in Dynamo's cache: close must still free them."""
    import weakref
    from pcg_engine.llm import LLM
    with LLM(str(dense_path), device="cuda", mode="piecewise", num_kv_blocks=16) as llm:
        for _ in range(2):   # the first forward at a bucket records its program, the second runs it
            assert len(llm.generate([[5, 6, 7]], greedy(max_tokens=4))[0].token_ids) == 4
        runner = llm.engine.runner
        pool = runner.graph_pool
        assert pool.programs and sum(p.runs for p in pool.programs.values()) > 0
        assert pool.pieces and all(piece.entries for piece in pool.pieces)
        pieces = list(pool.pieces)
        kv = weakref.ref(runner.kv_caches[0])
    assert kv() is None
    assert not pool.programs and not any(piece.entries for piece in pieces)   # graphs dropped too


def test_final_only_requests_report_once_and_match(engines):
    """generate without a callback asks for final outputs only: same results, one output each."""
    llm = engines("tiny-qwen3")
    prompts = [[5, 6, 7], [9] * 20, [11, 12]]
    params = greedy(max_tokens=6)
    seen = []
    with_callback = llm.generate(prompts, params, on_output=seen.append)
    assert len(seen) > len(prompts)                 # per-step outputs were delivered
    plain = llm.generate(prompts, params)
    assert [o.token_ids for o in plain] == [o.token_ids for o in with_callback]
    assert [o.finish_reason for o in plain] == ["length"] * 3
    engine = llm.engine
    ids = [engine.add_request(p, params, final_only=True) for p in prompts]
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert sorted(o.request_id for o in outs) == sorted(ids) and all(o.finished for o in outs)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_stop_string_found_only_at_the_end_is_the_finish_reason(dense_path, tokenizer, async_scheduling):
    """Found by probing: a stop string that only the end's text completes (U+FFFD, which a
    character split at max_tokens decodes to) cut the text in flush(), but finish_reason stayed
    'length' and stop_reason None. The outputs are forced by overriding the logits."""
    ids = [t for t in range(tokenizer.vocab_size)
           if tokenizer.decode([t]).endswith("\ufffd") and len(tokenizer.decode([t])) == 2][:1]
    first = tokenizer(["a"], add_special_tokens=False)["input_ids"][0]
    assert ids and len(first) == 1, "no 'x' + split-character token in the vocabulary"
    forced = first + ids                                       # 'a', then a token ending in a split character
    from pcg_engine.llm import LLM
    llm = LLM(dense_path, device="cpu", mode="eager", async_scheduling=async_scheduling, num_kv_blocks=32)
    runner, execute = llm.engine.runner, llm.engine.runner.execute
    made = []

    def forcing(scheduled, previous_tokens=None):
        logits, inputs = execute(scheduled, previous_tokens=previous_tokens)
        logits = logits.clone()
        for i in range(logits.shape[0]):
            logits[i] = -1e4
            logits[i, forced[min(len(made), len(forced) - 1)]] = 1e4
            made.append(i)
        return logits, inputs
    runner.execute = forcing
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0, stop=["\ufffd"]))[0]
    finally:
        llm.close()
    assert out.token_ids == forced
    assert (out.text, out.finish_reason, out.stop_reason) == (tokenizer.decode(forced).split("\ufffd")[0], "stop",
                                                              "\ufffd")
