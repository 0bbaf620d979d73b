import math

import pytest

from pcg_engine.errors import InvalidRequestError
from pcg_engine.sampling_params import SamplingParams

# (field, bad value, a piece of the range the message must state)
BAD = [
    ("max_tokens", 0, ">= 1"), ("max_tokens", -3, ">= 1"), ("max_tokens", 1.5, ">= 1"),
    ("max_tokens", True, ">= 1"), ("max_tokens", "16", ">= 1"), ("max_tokens", None, ">= 1"),
    ("temperature", -0.1, "[0, 1e6]"), ("temperature", math.nan, "[0, 1e6]"),
    ("temperature", math.inf, "[0, 1e6]"), ("temperature", "1", "[0, 1e6]"), ("temperature", None, "[0, 1e6]"),
    # Finite in float64 but inf in the sampler's float32 row tensor: top_k / top_p / min_p then kept
    # every token, and a row with a min_tokens-masked EOS drew token 0 every step.
    ("temperature", 1e39, "[0, 1e6]"), ("temperature", 1e6 * (1 + 1e-9), "[0, 1e6]"),
    ("top_p", 0.0, "(0, 1]"), ("top_p", -0.5, "(0, 1]"), ("top_p", 1.01, "(0, 1]"),
    ("top_p", math.nan, "(0, 1]"), ("top_p", False, "(0, 1]"),
    ("top_k", -3, ">= 1"), ("top_k", -2, ">= 1"), ("top_k", 2.0, ">= 1"), ("top_k", None, ">= 1"),
    ("min_p", -0.01, "[0, 1]"), ("min_p", 1.5, "[0, 1]"), ("min_p", math.inf, "[0, 1]"),
    ("repetition_penalty", 0.0, "in [0.01, 100]"), ("repetition_penalty", -1.0, "in [0.01, 100]"),
    ("repetition_penalty", math.nan, "in [0.01, 100]"), ("repetition_penalty", 1e-38, "in [0.01, 100]"),
    ("repetition_penalty", 101.0, "in [0.01, 100]"),
    ("presence_penalty", -2.01, "[-2, 2]"), ("presence_penalty", 3, "[-2, 2]"),
    ("presence_penalty", math.nan, "[-2, 2]"),
    ("frequency_penalty", 2.5, "[-2, 2]"), ("frequency_penalty", -5, "[-2, 2]"),
    ("frequency_penalty", "0", "[-2, 2]"),
    ("seed", 1.5, "null"), ("seed", "7", "null"), ("seed", True, "null"),
    ("seed", 2**64, "null"), ("seed", -(2**63) - 1, "null"),
    ("stop", "", "non-empty"), ("stop", ["ok", ""], "non-empty"), ("stop", [3], "non-empty"),
    ("stop", 5, "non-empty"), ("stop", {"a": 1}, "non-empty"),
    ("stop_token_ids", [-1], ">= 0"), ("stop_token_ids", [1, 2.0], ">= 0"),
    ("stop_token_ids", [True], ">= 0"), ("stop_token_ids", 5, ">= 0"),
    ("stop_token_ids", "12", ">= 0"),
    ("ignore_eos", 1, "true or false"), ("ignore_eos", "yes", "true or false"),
    ("logprobs", -1, "[0, 20]"), ("logprobs", 21, "[0, 20]"), ("logprobs", 2.0, "[0, 20]"),
    ("logprobs", True, "[0, 20]"),
    ("min_tokens", -1, ">= 0"), ("min_tokens", 1.0, ">= 0"), ("min_tokens", 17, "max_tokens=16"),
    ("detokenize", 0, "true or false"), ("detokenize", None, "true or false"),
    ("truncate_prompt_tokens", 0, ">= 1"), ("truncate_prompt_tokens", -5, ">= 1"),
    ("truncate_prompt_tokens", 3.0, ">= 1"),
    ("skip_special_tokens", "true", "true or false"),
    ("n", 2, "equal to 1"), ("n", 0, "equal to 1"), ("n", 1.0, "equal to 1"),
]


@pytest.mark.parametrize("field,value,rng", BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_invalid_value_names_field_and_range(field, value, rng):
    for make in (lambda: SamplingParams(**{field: value}),
                 lambda: SamplingParams.from_dict({field: value})):
        with pytest.raises(InvalidRequestError) as e:
            make()
        assert e.value.field == field
        msg = str(e.value)
        assert msg.startswith(f"{field}:")
        assert rng in msg, msg


def test_stop_token_ids_are_distinct_and_bounded():
    """Found by probing: stop_token_ids=[7] * 200_000 was taken; the sampler's per-row stop table
    took the longest list's width for every row (439 MiB at 256 rows) for the engine's life.
    Repeats are dropped (first occurrence order kept); more distinct ids than the limit are refused."""
    from pcg_engine.sampling_params import MAX_STOP_TOKEN_IDS
    assert SamplingParams(stop_token_ids=[7] * 200_000 + [3, 7, 5]).stop_token_ids == [7, 3, 5]
    assert len(SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))).stop_token_ids) == MAX_STOP_TOKEN_IDS
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.from_dict({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))})
    assert str(e.value) == f"stop_token_ids: holds {MAX_STOP_TOKEN_IDS + 1} distinct ids; allowed: at most {MAX_STOP_TOKEN_IDS}"


def test_stop_strings_are_distinct_and_bounded():
    """Found by review: a request with a million stop strings was taken, and its stop search made
    every step of its batch 84 times slower on the dev machine (the longest string also sets how
    much text is held back). Repeats are dropped (first occurrence order kept); more distinct
    strings, or a longer one, than the limits are refused, naming the field and the range."""
    from pcg_engine.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
    assert SamplingParams(stop=["b", "a"] * 100_000 + ["c"]).stop == ["b", "a", "c"]
    many = [f"s{i}" for i in range(MAX_STOP_STRINGS)]
    assert SamplingParams(stop=many).stop == many
    assert SamplingParams(stop="x" * MAX_STOP_CHARS).stop == ["x" * MAX_STOP_CHARS]
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.from_dict({"stop": many + ["one more"]})
    assert str(e.value) == f"stop: holds {MAX_STOP_STRINGS + 1} distinct strings; allowed: at most {MAX_STOP_STRINGS}"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop=["ok", "y" * (MAX_STOP_CHARS + 1)])
    assert e.value.field == "stop" and f"has {MAX_STOP_CHARS + 1} characters; allowed: 1 to {MAX_STOP_CHARS}" in str(e.value)


def test_stop_strings_need_detokenize():
    """Found by probing: detokenize=False with stop strings still detokenized, returned the text
    and stopped on the strings."""
    for make in (lambda: SamplingParams(stop=["x"], detokenize=False),
                 lambda: SamplingParams.from_dict({"stop": "x", "detokenize": False})):
        with pytest.raises(InvalidRequestError) as e:
            make()
        assert e.value.field == "stop"
        assert "stop strings (['x']) are matched on the output text, but detokenize is False" in str(e.value)
    assert SamplingParams(stop_token_ids=[3], detokenize=False).stop == []


def test_every_field_has_a_refused_value():
    tested = {f for f, _, _ in BAD}
    assert tested == set(SamplingParams.field_names())


def test_unknown_field_is_refused_and_lists_allowed():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.from_dict({"temperature": 0.5, "temprature": 0.5})
    assert e.value.field == "temprature"
    for name in SamplingParams.field_names():
        assert name in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.from_kwargs(best_of=2)
    assert e.value.field == "best_of"


def test_from_dict_refuses_non_mapping():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.from_dict([("temperature", 1.0)])
    assert e.value.field == "sampling_params"


def test_defaults_are_valid():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and p.logprobs is None and p.min_tokens == 0
    assert p.detokenize and p.truncate_prompt_tokens is None and p.skip_special_tokens
    assert not p.greedy
    assert SamplingParams.from_dict(None) == p == SamplingParams.from_kwargs()


def test_valid_edges_and_normalisation():
    p = SamplingParams.from_kwargs(
        max_tokens=1, temperature=0, top_p=1, top_k=1, min_p=1, repetition_penalty=0.01,
        presence_penalty=-2, frequency_penalty=2, seed=0, stop="###", stop_token_ids=(5, 0),
        ignore_eos=True, logprobs=20, min_tokens=1, truncate_prompt_tokens=1)
    assert p.greedy and p.stop == ["###"] and p.stop_token_ids == [5, 0]
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(top_k=-1, max_tokens=4, min_tokens=4).min_tokens == 4


def test_validate_against_model():
    p = SamplingParams(stop_token_ids=[0, 99])
    p.validate_against_model(100)
    with pytest.raises(InvalidRequestError) as e:
        p.validate_against_model(99)
    assert e.value.field == "stop_token_ids" and "[0, 98]" in str(e.value)
