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
    (0, "messages: must be a non-empty list of {'role': ..., 'content': ...} messages; got int"),
    ([{"role": "user"}], "messages: message 0 of 1 must be a dict with a text 'role' and a 'content' (text, None or "
                         "text parts); got {'role': 'user'}"),
    ([{"role": "user", "content": 5}], "messages: message 0 of 1 must be a dict with a text 'role'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
     "messages: message 0 of 1: a content part must be {'type': 'text', 'text': ...} (this engine reads text only)"),
    ([[{"role": "user", "content": "ok"}], [{"role": "user", "content": 5}]],
     "messages: conversation 1 of 2: message 0 of 1 must be a dict"),
    # one conversation with a bad message first: named by its index (it was "conversation 0 of 2")
    ([None, {"role": "user", "content": "hi"}], "messages: message 0 of 2 must be a dict"),
    (["Hello", "there"], "messages: message 0 of 2 must be a dict"),
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


TOOL_TEMPLATE = ("{%- for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}{% if m.tool_calls %}[call "
                 "{{ m.tool_calls[0].function.name }}]{% endif %}\n{%- endfor %}{% if tools %}tools: {{ tools | length }}"
                 "{% endif %}{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def test_chat_takes_the_message_shapes_templates_and_other_engines_take(llm, monkeypatch):
    """Found by a review (session 41): an assistant's tool call (content None), OpenAI-style text
    parts and chat_template_kwargs / tools were refused; a chat prompt beyond max_model_len was
    named as prompt_token_ids without its conversation."""
    template = llm.tokenizer.apply_chat_template
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    (out,) = llm.chat(parts, GREEDY)
    assert out.prompt == template([{"role": "user", "content": "Hello\nthere"}], tokenize=False,
                                  add_generation_prompt=True)
    call = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function",
                                                                  "function": {"name": "f", "arguments": {}}}]},
            {"role": "tool", "content": "42"}]
    # (a template that renders tool calls, as Qwen3's does; the tiny checkpoint's concatenates text only)
    monkeypatch.setattr(llm.tokenizer, "chat_template", TOOL_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    (out,) = llm.chat(call, GREEDY, chat_template_kwargs={"enable_thinking": False}, tools=tools)
    assert out.prompt == "user: hiassistant: [call f]tool: 42tools: 1<think></think>assistant: "   # ({%- trims)
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs: must be a dict"):
        llm.chat(parts, GREEDY, chat_template_kwargs=["enable_thinking"])
    with pytest.raises(TypeError):
        llm.chat(parts, GREEDY, None)          # on_output and the rest are keyword-only
    long = [{"role": "user", "content": "word " * 400}]
    with pytest.raises(InvalidRequestError, match=r"^prompt_token_ids: conversation 1 of 2: prompt has \d+ tokens"):
        llm.chat([parts, long], GREEDY)
    assert_drained(llm.engine)
