"""Chat templates: a conversation as the checkpoint's prompt text, for LLM.chat and `pcg generate --chat`.

A conversation is a list of {"role": ..., "content": ...} messages with text content; the
checkpoint's tokenizer renders it with its own chat template (chat_template.jinja, or
chat_template in tokenizer_config.json), which also writes the special tokens the model expects.
Every problem is an InvalidRequestError on the field "messages", raised before anything is queued.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pcg_engine.errors import InvalidRequestError


def missing_template(engine) -> str | None:
    """Why the engine's checkpoint cannot render chats (no tokenizer, or no template); None if it can."""
    lazy = engine.lazy_tokenizer
    if not lazy.available:
        return f"{lazy.missing()}, so no chat template"
    if not getattr(engine.tokenizer, "chat_template", None):
        # transformers' own ValueError named neither the checkpoint nor where a template lives
        return (f"the tokenizer of {engine.model_path} has no chat template (chat_template.jinja, or chat_template "
                "in tokenizer_config.json)")
    return None


def check_conversation(messages) -> list[dict]:
    """The messages as a list of dicts, or InvalidRequestError naming the first that is not a
    message. A message has a text "role" and a "content" that is text, None (an assistant's tool
    call, which templates render) or OpenAI-style parts, of which the text parts are joined into
    one text (as vLLM does; other parts are refused: this engine reads text only). Other keys
    ("name", "tool_calls") reach the template as given."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        empty = " (empty)" if isinstance(messages, Sequence) and not isinstance(messages, str) and not messages else ""
        raise InvalidRequestError("messages", f"must be a non-empty list of {{'role': ..., 'content': ...}} "
                                  f"messages; got {type(messages).__name__}{empty}")
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, Sequence) and not isinstance(content, str):
            content = _text_of_parts(content, i, len(messages))
        if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                and "content" in message and (content is None or isinstance(content, str))):
            raise InvalidRequestError("messages", f"message {i} of {len(messages)} must be a dict with a text 'role' "
                                      f"and a 'content' (text, None or text parts); got {message!r:.80}")
        out.append({**message, "content": content})
    return out


def _text_of_parts(parts, i: int, n: int) -> str:
    """OpenAI-style content parts ([{"type": "text", "text": ...}, ...]) as one text, joined by newlines."""
    texts = []
    for part in parts:
        if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise InvalidRequestError("messages", f"message {i} of {n}: a content part must be {{'type': 'text', "
                                      f"'text': ...}} (this engine reads text only); got {part!r:.80}")
        texts.append(part["text"])
    return "\n".join(texts)


def render(engine, messages, add_generation_prompt: bool = True, tools=None, template_kwargs=None) -> str:
    """The conversation as the prompt text of the checkpoint's template (checked first); tools and
    template_kwargs (Qwen3's enable_thinking, ...) reach the template as transformers passes them."""
    messages = check_conversation(messages)
    problem = missing_template(engine)
    if problem is not None:
        raise InvalidRequestError("messages", problem)
    try:
        text = engine.tokenizer.apply_chat_template(messages, tokenize=False, tools=tools,
                                                    add_generation_prompt=add_generation_prompt,
                                                    **(template_kwargs or {}))
    except Exception as e:    # the checkpoint's own template code: a jinja2 syntax error, or its
        # raise_exception() refusing the messages (only some roles allowed), ended in a traceback
        raise InvalidRequestError("messages", f"the chat template of {engine.model_path} failed: "
                                  f"{type(e).__name__}: {e}") from None
    if not isinstance(text, str) or not text:
        # (the engine then refused the empty text as "prompt: is empty", blaming the caller's prompt)
        raise InvalidRequestError("messages", f"the chat template of {engine.model_path} made empty text of the "
                                  "conversation")
    return text
