"""Bad input (DESIGN.md, "Bad input"): every refusal is an InvalidRequestError naming the field and
its allowed range, the requests already in flight finish exactly as they would have without it, and
no KV block, batch row or sampling row leaks."""

import math
import time

import pytest

from engine_helpers import assert_drained, drain, make_llm, random_prompts
from pcg_engine.errors import InvalidRequestError
from pcg_engine.sampling_params import SamplingParams

MAX_MODEL_LEN = 2048
NUM_KV_BLOCKS = 32          # 31 usable blocks of 16: 496 tokens, less than max_model_len
VOCAB = 1024

GOOD_PROMPTS = random_prompts([6, 19, 11], seed=20)
GOOD_PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=7, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, stop_token_ids=[3], stop=["zz"]),
]
GOOD_IDS = ["good-0", "good-1", "good-2"]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, tiny_paths):
    return make_llm(tiny_paths["tiny-qwen3"], max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS,
                    async_scheduling=request.param)


@pytest.fixture(scope="module")
def baseline(llm):
    """The good requests' outputs without any bad request around."""
    finals = _run_good(llm.engine, bad=None)[0]
    return {rid: (o.token_ids, o.text, o.finish_reason) for rid, o in finals.items()}


def _run_good(engine, bad, steps_before: int = 3):
    """Add the good requests, run a few steps, try `bad(engine)`, then drain. Returns (the good
    requests' final outputs, the error the bad action raised)."""
    for rid, prompt, params in zip(GOOD_IDS, GOOD_PROMPTS, GOOD_PARAMS):
        engine.add_request(prompt, params, request_id=rid)
    finals, error = {}, None
    for _ in range(steps_before):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    if bad is not None:
        with pytest.raises(InvalidRequestError) as info:
            bad(engine)
        error = info.value
    finals.update(drain(engine))
    return finals, error


def _prompt(n=8):
    return random_prompts([n], seed=21)[0]


# (id, action, field, pattern the message must match: the allowed range)
CASES = [
    ("empty-text-prompt", lambda e: e.add_request("", None), "prompt", r"at least one"),
    ("empty-token-prompt", lambda e: e.add_request([], None), "prompt_token_ids", r"at least 1"),
    ("prompt-not-str-or-ids", lambda e: e.add_request(42, None), "prompt", r"string or a list of token ids"),
    ("beyond-max-model-len", lambda e: e.add_request(_prompt(10), {"max_tokens": MAX_MODEL_LEN}),
     "max_tokens", rf"max_model_len {MAX_MODEL_LEN}.*allowed: 1\.\.{MAX_MODEL_LEN - 10}"),
    ("prompt-fills-max-model-len", lambda e: e.add_request(_prompt(MAX_MODEL_LEN), {"max_tokens": 1}),
     "prompt_token_ids", rf"max_model_len is {MAX_MODEL_LEN}; allowed: at most {MAX_MODEL_LEN - 1} prompt tokens"),
    ("max-tokens-0", lambda e: e.add_request(_prompt(), {"max_tokens": 0}), "max_tokens", r">= 1"),
    ("max-tokens-negative", lambda e: e.add_request(_prompt(), {"max_tokens": -3}), "max_tokens", r">= 1"),
    ("max-tokens-bool", lambda e: e.add_request(_prompt(), {"max_tokens": True}), "max_tokens", r">= 1"),
    ("temperature-negative", lambda e: e.add_request(_prompt(), {"temperature": -0.5}), "temperature", r"\[0, 1e6\]"),
    ("temperature-nan", lambda e: e.add_request(_prompt(), {"temperature": math.nan}), "temperature",
     r"finite.*\[0, 1e6\]"),
    ("top-p-0", lambda e: e.add_request(_prompt(), {"top_p": 0.0}), "top_p", r"\(0, 1\]"),
    ("top-p-above-1", lambda e: e.add_request(_prompt(), {"top_p": 1.5}), "top_p", r"\(0, 1\]"),
    ("top-k-below-minus-1", lambda e: e.add_request(_prompt(), {"top_k": -2}), "top_k",
     r"-1 or 0 \(disabled\) or an integer >= 1"),
    ("top-k-below-minus-1", lambda e: e.add_request(_prompt(), {"top_k": -2}), "top_k", r"-1 .* >= 1"),
    ("min-p-negative", lambda e: e.add_request(_prompt(), {"min_p": -0.1}), "min_p", r"\[0, 1\]"),
    ("min-p-above-1", lambda e: e.add_request(_prompt(), {"min_p": 1.5}), "min_p", r"\[0, 1\]"),
    ("token-id-too-large", lambda e: e.add_request([5, 6, VOCAB], None), "prompt_token_ids",
     rf"position 2.*0\.\.{VOCAB - 1}"),
    ("token-id-negative", lambda e: e.add_request([-1, 5], None), "prompt_token_ids", rf"0\.\.{VOCAB - 1}"),
    ("token-id-not-int", lambda e: e.add_request([5, 2.0], None), "prompt_token_ids", rf"0\.\.{VOCAB - 1}"),
    ("token-id-bool", lambda e: e.add_request([5, True], None), "prompt_token_ids", rf"position 1.*0\.\.{VOCAB - 1}"),
    ("stop-token-id-outside-vocab", lambda e: e.add_request(_prompt(), {"stop_token_ids": [VOCAB]}),
     "stop_token_ids", rf"\[0, {VOCAB - 1}\]"),
    ("unknown-field", lambda e: e.add_request(_prompt(), {"temprature": 0.5}), "temprature",
     r"unknown sampling parameter; allowed: .*temperature"),
    ("params-wrong-type", lambda e: e.add_request(_prompt(), "greedy"), "sampling_params", r"SamplingParams or dict"),
    ("larger-than-kv-cache", lambda e: e.add_request(_prompt(10), {"max_tokens": 600}), "max_tokens",
     rf"KV cache holds at most {(NUM_KV_BLOCKS - 1) * 16}; max_tokens allowed: 1\.\.{(NUM_KV_BLOCKS - 1) * 16 - 10}"),
    ("prompt-larger-than-kv-cache", lambda e: e.add_request(_prompt((NUM_KV_BLOCKS - 1) * 16), {"max_tokens": 1}),
     "prompt_token_ids", rf"KV cache holds at most {(NUM_KV_BLOCKS - 1) * 16}; allowed: at most "
     rf"{(NUM_KV_BLOCKS - 1) * 16 - 1} prompt tokens"),
    ("abort-unknown-id", lambda e: e.abort_request("no-such-request"), "request_id", r"not an unfinished request"),
    ("duplicate-request-id", lambda e: e.add_request(_prompt(), None, request_id="good-1"), "request_id",
     r"already in use"),
    ("request-id-empty", lambda e: e.add_request(_prompt(), None, request_id=""), "request_id",
     r"non-empty string, or None"),
    ("request-id-int", lambda e: e.add_request(_prompt(), None, request_id=5), "request_id", r"non-empty string"),
    ("token-id-text", lambda e: e.add_request([5, "6"], None), "prompt_token_ids", r"position 1 is not an integer"),
    ("token-id-nested", lambda e: e.add_request([[5, 6]], None), "prompt_token_ids", r"position 0 is not an integer"),
    # Found by probing: LLM.stream(["a", "b"]) (a batch where one prompt goes) said "token 'a' ... is
    # not an integer".
    ("text-list", lambda e: e.add_request(["a", "b"], None), "prompt", r"is a list of 2 strings; one request takes one prompt"),
    ("prompt-and-ids", lambda e: e.add_request("hi", None, prompt_token_ids=[5, 6]), "prompt", r"not both"),
    # Found by a review: a memoryview has ndim and tolist, so one of bytes was read as token ids.
    ("prompt-memoryview", lambda e: e.add_request(memoryview(b"\x05\x06"), None), "prompt",
     r"is a memoryview; give text as a str \(decode bytes first\) or token ids as a list"),
    ("ids-kw-memoryview", lambda e: e.add_request(prompt_token_ids=memoryview(b"\x05\x06")), "prompt_token_ids",
     r"is a memoryview"),
    # Found by probing: prompt_token_ids= took any iterable (a dict's keys, a set in hash order),
    # raised a bare TypeError for an int, and read a string as a list of text prompts.
    ("ids-kw-int", lambda e: e.add_request(prompt_token_ids=5), "prompt_token_ids",
     r"must be a list of token ids .*got int"),
    ("ids-kw-dict", lambda e: e.add_request(prompt_token_ids={5: 6}), "prompt_token_ids",
     r"must be a list of token ids .*got dict"),
    ("ids-kw-set", lambda e: e.add_request(prompt_token_ids={5, 6}), "prompt_token_ids",
     r"must be a list of token ids .*got set"),
    ("ids-kw-str", lambda e: e.add_request(prompt_token_ids="56"), "prompt_token_ids",
     r"must be a list of token ids .*got str; give text as prompt"),
    ("ids-kw-2d", lambda e: e.add_request(prompt_token_ids=[[5, 6]]), "prompt_token_ids", r"position 0 is not an integer"),
    ("final-only-not-bool", lambda e: e.add_request(_prompt(), None, final_only="no"), "final_only", r"true or false"),
    ("arrival-time-str", lambda e: e.add_request(_prompt(), None, arrival_time="now"), "arrival_time",
     r"finite time.monotonic\(\) value"),
    ("arrival-time-nan", lambda e: e.add_request(_prompt(), None, arrival_time=math.nan), "arrival_time",
     r"finite"),
    ("prompt-lone-surrogate", lambda e: e.add_request("ok \ud800", None), "prompt", r"not valid Unicode"),
    # Found by probing (session 26): ints past float's range (a JSON body keeps them exact) raised
    # a bare OverflowError from math.isfinite; a future arrival time gave a negative TTFT; a stop
    # string with a lone surrogate was taken and could never match.
    ("temperature-int-past-float", lambda e: e.add_request(_prompt(), {"temperature": 10**400}), "temperature",
     r"finite number in \[0, 1e6\]"),
    ("top-p-int-past-float", lambda e: e.add_request(_prompt(), {"top_p": 10**400}), "top_p", r"finite number"),
    ("presence-penalty-int-past-float", lambda e: e.add_request(_prompt(), {"presence_penalty": -10**400}),
     "presence_penalty", r"finite number"),
    ("arrival-time-int-past-float", lambda e: e.add_request(_prompt(), None, arrival_time=10**400), "arrival_time",
     r"finite time.monotonic\(\) value"),
    ("arrival-time-future", lambda e: e.add_request(_prompt(), None, arrival_time=time.monotonic() + 3600),
     "arrival_time", r"not in the future"),
    ("stop-lone-surrogate", lambda e: e.add_request(_prompt(), {"stop": ["ok", "\ud800"]}), "stop",
     r"item '\\ud800' is not valid Unicode"),
    ("repetition-penalty-underflows", lambda e: e.add_request(_prompt(), {"repetition_penalty": 1e-38}),
     "repetition_penalty", r"\[0.01, 100\]"),
    # SamplingParams is a mutable dataclass: a field changed after it was made is checked again.
    ("params-changed-seed", lambda e: e.add_request(_prompt(), _changed(seed="x")), "seed", r"integer in"),
    ("params-changed-stop-ids", lambda e: e.add_request(_prompt(), _changed(stop_token_ids=[-5])), "stop_token_ids",
     r"integers >= 0"),
    ("params-changed-max-tokens", lambda e: e.add_request(_prompt(), _changed(max_tokens=0)), "max_tokens", r">= 1"),
    ("params-changed-temperature", lambda e: e.add_request(_prompt(), _changed(temperature=math.nan)),
     "temperature", r"finite"),
    ("stop-without-detokenize", lambda e: e.add_request(_prompt(), {"stop": ["x"], "detokenize": False}), "stop",
     r"detokenize is False; allowed: detokenize=True with stop, or stop_token_ids"),
    ("params-changed-detokenize", lambda e: e.add_request(_prompt(), _changed(stop=["x"], detokenize=False)),
     "stop", r"detokenize is False"),
    # Found by probing: a truncate_prompt_tokens that keeps too many tokens was reported under
    # prompt_token_ids with "or set truncate_prompt_tokens to shorten the prompt", which was set.
    ("truncate-keeps-max-model-len", lambda e: e.add_request(_prompt(MAX_MODEL_LEN + 5), {
        "max_tokens": 1, "truncate_prompt_tokens": MAX_MODEL_LEN}), "truncate_prompt_tokens",
     rf"keeps {MAX_MODEL_LEN} prompt tokens, max_model_len is {MAX_MODEL_LEN}; allowed: 1\.\.{MAX_MODEL_LEN - 1}$"),
    ("truncate-beyond-a-long-prompt", lambda e: e.add_request(_prompt(MAX_MODEL_LEN + 5), {
        "max_tokens": 1, "truncate_prompt_tokens": MAX_MODEL_LEN + 9}), "truncate_prompt_tokens",
     rf"keeps {MAX_MODEL_LEN + 5} prompt tokens, max_model_len is {MAX_MODEL_LEN}; allowed: 1\.\.{MAX_MODEL_LEN - 1}$"),
    ("truncate-leaves-no-room-for-max-tokens", lambda e: e.add_request(_prompt(40), {
        "max_tokens": MAX_MODEL_LEN - 20, "truncate_prompt_tokens": 30}), "max_tokens",
     rf"max_tokens allowed: 1\.\.{MAX_MODEL_LEN - 30} \(or truncate_prompt_tokens 1\.\.20 to keep fewer prompt tokens\)$"),
    ("truncate-keeps-more-than-the-kv-cache", lambda e: e.add_request(_prompt(600), {
        "max_tokens": 1, "truncate_prompt_tokens": (NUM_KV_BLOCKS - 1) * 16}), "truncate_prompt_tokens",
     rf"keeps {(NUM_KV_BLOCKS - 1) * 16} prompt tokens; the KV cache holds at most {(NUM_KV_BLOCKS - 1) * 16}; "
     rf"allowed: 1\.\.{(NUM_KV_BLOCKS - 1) * 16 - 1}$"),
]


def _changed(**fields) -> SamplingParams:
    p = SamplingParams(max_tokens=3, seed=1)
    for name, value in fields.items():
        setattr(p, name, value)
    return p


@pytest.mark.parametrize("name,bad,field,pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_request_is_refused_and_the_batch_survives(llm, baseline, name, bad, field, pattern):
    engine = llm.engine
    finals, error = _run_good(engine, bad)
    assert error.field == field
    assert str(error).startswith(f"{field}: ")
    assert __import__("re").search(pattern, str(error)), f"{error} does not give the allowed range ({pattern})"
    got = {rid: (o.token_ids, o.text, o.finish_reason) for rid, o in finals.items()}
    assert got == baseline, f"the requests in flight were disturbed by {name}"
    assert_drained(engine)


def test_top_k_0_is_off_as_in_transformers_and_vllm():
    """Found by a review: top_k 0 (a Hugging Face generation config's "off") was refused."""
    assert SamplingParams(top_k=0).top_k == -1 == SamplingParams().top_k
    assert SamplingParams.from_kwargs(top_k=0, temperature=0.5) == SamplingParams(temperature=0.5)


def test_sampling_params_refuse_bad_fields_directly():
    """The same checks at construction, without an engine (the client's first line of defence)."""
    for kw, field in [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                      ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p")]:
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**kw)
        assert info.value.field == field
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_kwargs(max_tokens=4, temprature=1.0)
    assert info.value.field == "temprature"


def test_abort_of_a_finished_request_is_refused(llm):
    engine = llm.engine
    rid = engine.add_request(_prompt(), SamplingParams(max_tokens=2, temperature=0))
    drain(engine)
    with pytest.raises(InvalidRequestError) as info:
        engine.abort_request(rid)
    assert info.value.field == "request_id" and "missing_ok=True" in str(info.value)
    assert_drained(engine)


def test_abort_with_missing_ok_tells_a_finished_request_from_an_aborted_one(llm):
    """A server aborts on a client's disconnect from its own thread while another steps the
    engine: the request may have just finished. missing_ok=True returns False for it instead of
    raising (found by a threaded probe: every such abort needed a try/except)."""
    engine = llm.engine
    done = engine.add_request(_prompt(), SamplingParams(max_tokens=2, temperature=0))
    drain(engine)
    running = engine.add_request(_prompt(), SamplingParams(max_tokens=50, temperature=0))
    assert engine.abort_request(done, missing_ok=True) is False
    assert engine.abort_request(running, missing_ok=True) is True
    assert drain(engine)[running].finish_reason == "abort"
    assert engine.abort_request(running, missing_ok=True) is False
    assert_drained(engine)


def test_generate_with_one_bad_prompt_runs_none(llm, baseline):
    """LLM.generate validates every prompt first: a bad one raises and the good ones don't run; the
    engine then serves the next call normally."""
    engine = llm.engine
    steps = engine.stats.steps
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([GOOD_PROMPTS[0], [5, VOCAB + 3], GOOD_PROMPTS[1]], SamplingParams(max_tokens=4))
    assert info.value.field == "prompt_token_ids"
    assert engine.stats.steps == steps          # nothing ran
    assert_drained(engine)
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(GOOD_PROMPTS, [SamplingParams()] * 2)
    assert info.value.field == "sampling_params"
    outs = llm.generate(GOOD_PROMPTS, GOOD_PARAMS)
    assert {rid: (o.token_ids, o.text, o.finish_reason) for rid, o in zip(GOOD_IDS, outs)} == baseline
    assert_drained(engine)


@pytest.mark.parametrize("prompts, params, field, text", [
    (None, None, "prompts", "got NoneType"),
    (7, None, "prompts", "got int"),
    (["a"], 5, "sampling_params", "got int"),
    (["a"], "greedy", "sampling_params", "got str"),
    (["a", "b"], [SamplingParams(), 5], "sampling_params", "item 1 is a int"),
])
def test_generate_names_prompts_and_params_of_the_wrong_type(llm, prompts, params, field, text):
    """Before: TypeErrors from inside generate (len(None), iterating an int). Nothing is queued."""
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(prompts, params)
    assert info.value.field == field and text in str(info.value)
    assert_drained(llm.engine)


def test_generate_with_a_bad_prompt_leaves_other_requests_running(llm, baseline):
    """A bad prompt in LLM.generate while other requests are in flight (added through the engine):
    they keep running and their outputs reach their owner, not a drain inside generate."""
    engine = llm.engine
    for rid, prompt, params in zip(GOOD_IDS, GOOD_PROMPTS, GOOD_PARAMS):
        engine.add_request(prompt, params, request_id=rid)
    finals = {}
    for _ in range(3):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    with pytest.raises(InvalidRequestError):
        llm.generate([GOOD_PROMPTS[0], []], SamplingParams(max_tokens=4))
    finals.update(drain(engine))
    assert {rid: (o.token_ids, o.text, o.finish_reason) for rid, o in finals.items()} == baseline
    assert_drained(engine)


def test_abort_in_flight_frees_everything(llm, baseline):
    """Aborting a good request mid-flight: it finishes as 'abort' with a prefix of its tokens, the
    others are unharmed."""
    engine = llm.engine
    for rid, prompt, params in zip(GOOD_IDS, GOOD_PROMPTS, GOOD_PARAMS):
        engine.add_request(prompt, params, request_id=rid)
    for _ in range(4):
        engine.step()
    engine.abort_request("good-1")
    finals = drain(engine)
    aborted = finals.pop("good-1")
    assert aborted.finish_reason == "abort"
    assert aborted.token_ids == baseline["good-1"][0][:len(aborted.token_ids)]
    assert 0 < len(aborted.token_ids) < len(baseline["good-1"][0])
    assert {rid: (o.token_ids, o.text, o.finish_reason) for rid, o in finals.items()} == {
        rid: v for rid, v in baseline.items() if rid != "good-1"}
    assert_drained(engine)


def test_an_aborted_request_s_text_holds_every_token_s_text(llm):
    """Found by a review: the final output of an aborted request left out the text held back for a
    possible stop string (up to the longest stop string but one character), though its token_ids
    held those tokens. Its text is now their whole decoding, as at any other finish."""
    engine = llm.engine
    never = "\x00" * 12                     # no text holds it: 11 characters stay held back
    rid = engine.add_request(_prompt(), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                       stop=[never]))
    for _ in range(6):
        engine.step()
    engine.abort_request(rid)
    finals = drain(engine)
    out = finals[rid]
    assert out.finish_reason == "abort" and len(out.token_ids) >= 3
    want = engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.text == want and len(want) > 0
    assert_drained(engine)


def test_abort_with_a_non_string_id_aborts_nothing(llm, baseline):
    """abort_request(5) is refused by field: it used to look up str(5), aborting a request named "5"."""
    engine = llm.engine
    engine.add_request(_prompt(), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), request_id="5")
    with pytest.raises(InvalidRequestError, match="must be a string") as info:
        engine.abort_request(5)
    assert info.value.field == "request_id"
    finals = drain(engine)
    assert finals["5"].finish_reason == "length" and len(finals["5"].token_ids) == 4
    assert_drained(engine)


def test_a_request_that_fails_to_set_up_is_not_queued(llm, monkeypatch):
    """add_request builds the detokenizer (which loads the tokenizer) and the seed's generator
    before queueing: a failure there leaves nothing in the engine (it used to leave the request
    queued, and the next generate() ran it and threw its output away)."""
    from pcg_engine.engine import llm_engine

    def broken(*args, **kwargs):
        raise RuntimeError("tokenizer.json is broken")
    monkeypatch.setattr(llm_engine, "IncrementalDetokenizer", broken)
    engine = llm.engine
    with pytest.raises(RuntimeError, match="broken"):
        engine.add_request(_prompt(), SamplingParams(max_tokens=3, detokenize=True), request_id="half")
    assert "half" not in engine.requests and not engine.scheduler.has_unfinished_requests()
    assert_drained(engine)


def test_generate_and_stream_leave_other_requests_outputs_to_their_owner(llm, baseline):
    """Requests added through the engine by someone else keep running during LLM.generate and
    LLM.stream, and their outputs are not consumed there: the owner's next step() returns them."""
    engine = llm.engine
    for use in ("generate", "stream"):
        for rid, prompt, params in zip(GOOD_IDS, GOOD_PROMPTS, GOOD_PARAMS):
            engine.add_request(prompt, params, request_id=rid)
        mine = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        if use == "generate":
            seen = []
            out = llm.generate([_prompt()], mine, on_output=seen.append)[0]
            assert out.finished and all(o.request_id == out.request_id for o in seen)
        else:
            outs = list(llm.stream(_prompt(), mine))
            assert outs[-1].finished and len({o.request_id for o in outs}) == 1
        finals = {}
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert {rid: (o.token_ids, o.text, o.finish_reason) for rid, o in finals.items()} == baseline, use
        assert_drained(engine)


def _fail_if_spinning(engine, monkeypatch, max_steps: int = 100) -> None:
    """Fail, rather than hang, when a stream keeps stepping an idle engine."""
    real_step, steps = engine.step, []

    def step():
        steps.append(1)
        assert len(steps) < max_steps, "a stream kept stepping an idle engine"
        return real_step()
    monkeypatch.setattr(engine, "step", step)


def test_streams_advanced_in_turn_each_get_all_their_outputs(llm, monkeypatch):
    """Two LLM.stream generators advanced alternately: a step run by one brings outputs of the
    other, which must reach the other. (Found by a fuzzer: the stepping stream kept them until it
    ended, so the other lost those deltas, and when its final output was among them it stepped the
    idle engine forever.)"""
    engine = llm.engine
    prompts = random_prompts([5, 7], seed=22)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (8, 4)]
    want = [o.token_ids for o in llm.generate(prompts, params)]
    _fail_if_spinning(engine, monkeypatch)
    streams = [llm.stream(p, sp) for p, sp in zip(prompts, params)]
    deltas, finals, ids = [[], []], [None, None], [set(), set()]
    while None in finals:
        for i, stream in enumerate(streams):
            if finals[i] is None:
                out = next(stream)
                ids[i].add(out.request_id)
                deltas[i] += out.new_token_ids
                if out.finished:
                    finals[i] = out
    for stream in streams:
        stream.close()
    assert deltas == want and [f.token_ids for f in finals] == want
    assert all(len(i) == 1 for i in ids) and ids[0] != ids[1]
    assert not engine.has_unfinished_requests()
    assert_drained(engine)


def test_stream_whose_final_output_another_caller_took_raises(llm, monkeypatch):
    """A caller stepping the engine itself while a stream is suspended takes the stream's outputs;
    once the request has finished the stream raises instead of stepping an idle engine forever."""
    engine = llm.engine
    stream = llm.stream(_prompt(), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    rid = next(stream).request_id
    taken = drain(engine)
    assert taken[rid].finished
    _fail_if_spinning(engine, monkeypatch)
    with pytest.raises(RuntimeError, match="taken by another caller"):
        next(stream)
    assert_drained(engine)



def test_generate_whose_final_output_another_caller_took_raises(llm, monkeypatch):
    """The same for generate(): its callback stepping the engine itself took the final outputs of
    generate's requests, and generate stepped an idle engine forever waiting for them. It now
    raises once nothing left in the engine can bring them, naming the requests."""
    engine = llm.engine
    taken = []

    def callback(out):
        if not taken:
            taken.extend(engine.step())
    _fail_if_spinning(engine, monkeypatch)
    with pytest.raises(RuntimeError, match=r"generate: request 'req-\d+' finished, but its final output was "
                                           "taken by another caller of engine.step"):
        llm.generate(random_prompts([4, 5], seed=23), SamplingParams(temperature=0.0, max_tokens=2,
                                                                      ignore_eos=True), on_output=callback)
    assert any(o.finished for o in taken)
    drain(engine)
    assert_drained(engine)

def test_stream_stopped_early_leaves_no_output_behind(llm):
    engine = llm.engine
    stream = llm.stream(_prompt(), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    rid = next(stream).request_id
    stream.close()
    left = []
    while engine.has_unfinished_requests():        # async: the step in flight is still resolved
        left += engine.step()
    assert [o for o in left if o.request_id == rid] == []   # its abort output was not left behind
    assert_drained(engine)



def test_stream_refuses_a_bad_request_when_called_and_a_dropped_stream_aborts(llm, baseline):
    """Found by review: stream() was a generator function, so a bad request raised only at the
    first next(): a server that had begun its streaming response could no longer refuse it. Now
    the call itself raises (nothing added), and a stream dropped or closed before anything was
    asked of it aborts its request: no block, row or output left behind, the others unharmed."""
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match=r"^max_tokens:"):
        llm.stream(_prompt(), {"max_tokens": 0})
    assert not engine.has_unfinished_requests()
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm.stream(_prompt(), params)                   # dropped at once: collected, its request aborted
    closed = llm.stream(_prompt(7), params)
    closed.close()
    finals, _ = _run_good(engine, bad=None)
    assert {rid: (o.token_ids, o.text, o.finish_reason) for rid, o in finals.items()
            if rid in baseline} == baseline
    assert [rid for rid in finals if rid not in baseline] == []       # the aborted ones' outputs: not left
    assert_drained(engine)


def test_stream_closed_after_its_final_output_leaves_a_new_request_under_its_id_alone(llm):
    """A stream that has yielded its final output has nothing left to abort. Closed (or collected)
    while suspended at that yield, it aborted whatever request held its id by then: a caller's new
    request, added under the finished one's id, lost its run."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    stream = llm.stream(_prompt(), params)
    out = next(stream)
    while not out.finished:
        out = next(stream)
    engine.add_request(_prompt(9), params, request_id=out.request_id)     # its id, free again
    engine.step()
    stream.close()
    finals = drain(engine)
    assert finals[out.request_id].finish_reason == "length" and len(finals[out.request_id].token_ids) == 3
    assert_drained(engine)

def test_automatic_ids_skip_the_ids_callers_chose(llm):
    engine = llm.engine
    upcoming = f"req-{next(engine._ids) + 1}"          # the id the next automatic one would take
    engine.add_request(_prompt(), SamplingParams(max_tokens=2), request_id=upcoming)
    out = llm.generate([_prompt()], SamplingParams(max_tokens=2))[0]
    assert out.request_id != upcoming
    drain(engine)
    assert_drained(engine)



def test_automatic_ids_skip_the_ids_of_outputs_not_yet_collected(llm):
    """A caller's request that finished inside generate() leaves its final output with the engine
    for the caller's next step(). A later generate() must not take that id for one of its own
    requests: it took the caller's output as its own (returning the caller's tokens for its prompt,
    before its own request had finished) and the caller never saw it."""
    engine = llm.engine
    theirs = f"req-{next(engine._ids) + 3}"             # an automatic id a later generate() reaches
    engine.add_request(_prompt(5), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                       request_id=theirs)
    llm.generate([_prompt(6)], SamplingParams(temperature=0.0, max_tokens=2))   # theirs finishes meanwhile
    assert [o.request_id for o in engine.pending_outputs] == [theirs]
    prompts = random_prompts([4, 5, 6], seed=22)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 2, 6)]
    outs = llm.generate(prompts, params)
    assert theirs not in [o.request_id for o in outs]
    assert [len(o.token_ids) for o in outs] == [2, 2, 6]
    assert [o.request_id for o in engine.step() if o.finished] == [theirs]   # still the caller's
    drain(engine)
    assert_drained(engine)

def test_generate_names_the_bad_prompt(llm):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["a", "b", [5, VOCAB + 1]], SamplingParams(max_tokens=2))
    assert info.value.field == "prompt_token_ids" and "(prompt 2 of 3; none of them was run)" in str(info.value)
    assert info.value.prompt_index == 2         # for a caller that maps it back (pcg generate: the file's line)
    assert str(info.value).startswith("prompt_token_ids: token")
    assert_drained(llm.engine)


def test_min_tokens_holds_stop_strings_back_too(llm):
    """min_tokens applies to stop strings as it does to EOS and stop_token_ids: a stop string in
    the text of the first min_tokens tokens does not end the request."""
    engine = llm.engine
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    text = llm.generate([_prompt()], free)[0].text
    assert len(text) >= 2
    stop = text[:2]                                 # occurs at once without min_tokens
    early = llm.generate([_prompt()], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                     stop=[stop]))[0]
    held = llm.generate([_prompt()], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                    stop=[stop], min_tokens=8))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 8
    assert len(held.token_ids) >= 8 and held.text.startswith(text[:len(early.text)])
    assert_drained(engine)


def test_stop_string_ending_in_the_token_after_min_tokens_stops_there(llm):
    """Found by probing: a stop string that began in the text of the first min_tokens tokens and
    ended in the next token's text was missed (the text before was emitted, unsearched and not held
    back), and the request ran to max_tokens. It counts, as in vLLM: the request stops at that
    token, its text cut before the stop string. One ending in the min_tokens-th token's text does
    not (a review: it did, so min_tokens=1 with stop ["\\n"] could return an empty text), as EOS
    is masked until min_tokens tokens are out."""
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    deltas = [out.new_text for out in llm.stream(_prompt(), free)]
    # token k (1-based) whose text, with the last character of token k-1's, makes the stop string;
    # none of the text from token k on holds it alone (so only the straddling match can stop it)
    k = next(k for k in range(2, len(deltas)) if deltas[k - 2] and deltas[k - 1]
             and deltas[k - 2][-1] + deltas[k - 1][0] not in "".join(deltas[k - 1:]))
    stop = deltas[k - 2][-1] + deltas[k - 1][0]
    out = llm.generate([_prompt()], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop],
                                                   min_tokens=k - 1))[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == k
    assert out.text == "".join(deltas[:k - 1])[:-1]
    late = llm.generate([_prompt()], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop],
                                                    min_tokens=k))[0]
    assert late.finish_reason == "length" and late.text == "".join(deltas)
    assert_drained(llm.engine)


def test_numpy_ids_and_numbers_are_taken_as_plain_ones(llm):
    """numpy integers (prompt ids, a 1-D id array or tensor, sampling fields) are integers: taken, as plain
    Python ints (they were refused as 'outside the vocabulary' / 'must be an integer')."""
    import numpy as np
    engine = llm.engine
    prompt = _prompt()
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    params = SamplingParams(temperature=np.float32(0.0), max_tokens=np.int64(4), ignore_eos=True,
                            top_k=np.int32(5), stop_token_ids=[np.int64(3)], min_tokens=np.int16(4))
    assert type(params.max_tokens) is int and type(params.top_k) is int and type(params.stop_token_ids[0]) is int
    assert type(params.temperature) is float
    import torch
    for ids in ([np.int64(t) for t in prompt], np.array(prompt), torch.tensor(prompt)):
        out = llm.generate([ids], params)[0]
        assert out.token_ids == plain.token_ids and out.prompt_token_ids == prompt
        assert all(type(t) is int for t in out.prompt_token_ids)
    # One prompt not in a list, as generate takes a list of ints (a list of numpy ints was read as
    # prompts of one int each, refused as 'expected a string ... got int64'; an array as 'got ndarray')
    for ids in ([np.int64(t) for t in prompt], np.array(prompt), torch.tensor(prompt)):
        assert [o.token_ids for o in llm.generate(ids, params)] == [plain.token_ids]
    with pytest.raises(InvalidRequestError, match="prompt_token_ids: token 5.0 at position 0 is not an integer"):
        engine.add_request(np.array([5.0, 6.0]), None)
    assert_drained(engine)


def test_generate_takes_a_numpy_array_of_text_as_prompts(llm):
    """Found by a review: a 1-D numpy array of strings was taken as one prompt and refused as
    "a list of 2 strings; ... LLM.generate takes a list of prompts" - in a call to LLM.generate.
    Each element is a prompt, as in a list."""
    import numpy as np
    if not llm.engine.lazy_tokenizer.available:
        pytest.skip("the checkpoint has no tokenizer")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    texts = ["hello there", "one two three"]
    want = [o.token_ids for o in llm.generate(texts, params)]
    for prompts in (np.array(texts), np.array(texts, dtype=object)):
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
    with pytest.raises(InvalidRequestError, match="prompt: expected a string or a list of token ids, got bytes"):
        llm.generate(np.array([b"hello"]), params)
    assert_drained(llm.engine)


def test_generate_refuses_an_on_output_that_is_not_callable_before_running(llm):
    """Before: a bare TypeError from the first step's callback, after the prompt was queued and run."""
    steps = llm.engine.stats.steps
    with pytest.raises(InvalidRequestError, match="on_output: must be a callable") as info:
        llm.generate([_prompt()], SamplingParams(max_tokens=2), on_output="print")
    assert info.value.field == "on_output" and llm.engine.stats.steps == steps
    assert_drained(llm.engine)
