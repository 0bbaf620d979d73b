"""LLM.chat: conversations rendered with the checkpoint's chat template, then generated as generate() does.

Found by probing (session 41): chat templating lived in `pcg generate --chat` alone; an API user
had to call the tokenizer's apply_chat_template by hand, without the CLI's checks.
"""

import pytest

from engine_helpers import assert_drained, make_llm
from pcg_engine.errors import InvalidRequestError
from pcg_engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_paths):
    llm = make_llm(tiny_paths["tiny-qwen3"])
    yield llm
    llm.close()


def test_chat_runs_the_template_text_as_generate_does(llm):
    hi = [{"role": "user", "content": "Hello there"}]
    text = llm.tokenizer.apply_chat_template(hi, tokenize=False, add_generation_prompt=True)
    assert "Hello there" in text and text != "Hello there"
    (out,) = llm.chat(hi, GREEDY)
    assert out.prompt == text and out.token_ids == llm.generate([text], GREEDY)[0].token_ids
    # several conversations: outputs in their order, each its own template text
    other = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    outs = llm.chat([hi, other], GREEDY)
    assert [o.prompt for o in outs] == [text, llm.tokenizer.apply_chat_template(other, tokenize=False,
                                                                                add_generation_prompt=True)]
    assert outs[0].token_ids == out.token_ids
    # without the generation prompt: the template's own text for that
    (bare,) = llm.chat(hi, GREEDY, add_generation_prompt=False)
    assert bare.prompt == llm.tokenizer.apply_chat_template(hi, tokenize=False, add_generation_prompt=False)
    assert_drained(llm.engine)


@pytest.mark.parametrize("messages, expected", [
    ([], "messages: must be a non-empty list of {'role': ..., 'content': ...} messages; got list (empty)"),
    ("Hello", "messages: must be a non-empty list of {'role': ..., 'content': ...} messages; got str"),
    ([{"role": "user"}], "messages: message 0 of 1 must be a dict with text 'role' and 'content'; got {'role': 'user'}"),
    ([{"role": "user", "content": [1, 2]}], "messages: message 0 of 1 must be a dict with text 'role' and 'content'"),
    ([[{"role": "user", "content": "ok"}], [{"role": "user", "content": 5}]],
     "messages: conversation 1 of 2: message 0 of 1 must be a dict"),
    (["Hello", "there"], "messages: conversation 0 of 2: must be a non-empty list"),
])
def test_bad_conversations_are_refused_before_any_runs(llm, messages, expected):
    with pytest.raises(InvalidRequestError) as e:
        llm.chat(messages, GREEDY)
    assert str(e.value).startswith(expected) and e.value.field == "messages"
    assert_drained(llm.engine)
    assert llm.chat([{"role": "user", "content": "still serving"}], GREEDY)[0].finished


def test_a_template_that_fails_or_is_missing_is_named(llm, monkeypatch):
    tokenizer = llm.tokenizer

    def refuse(*args, **kwargs):
        raise ValueError("only user and assistant roles")
    monkeypatch.setattr(tokenizer, "apply_chat_template", refuse)
    with pytest.raises(InvalidRequestError, match=r"^messages: the chat template of .* failed: ValueError: only "
                                                  r"user and assistant roles$"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **k: "")
    with pytest.raises(InvalidRequestError, match="made empty text of the conversation"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    monkeypatch.setattr(tokenizer, "chat_template", None)
    with pytest.raises(InvalidRequestError, match=r"has no chat template \(chat_template.jinja"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    with pytest.raises(InvalidRequestError, match="add_generation_prompt: must be true or false, got 'yes'"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, add_generation_prompt="yes")
    assert_drained(llm.engine)
