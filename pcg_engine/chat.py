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
    message with text "role" and "content"."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages", f"must be a non-empty list of {{'role': ..., 'content': ...}} "
                                  f"messages; got {type(messages).__name__}" + (" (empty)" if not messages else ""))
    for i, message in enumerate(messages):
        if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise InvalidRequestError("messages", f"message {i} of {len(messages)} must be a dict with text 'role' "
                                      f"and 'content'; got {message!r:.80}")
    return [dict(m) for m in messages]


def render(engine, messages, add_generation_prompt: bool = True) -> str:
    """The conversation as the prompt text of the checkpoint's template (checked first)."""
    messages = check_conversation(messages)
    problem = missing_template(engine)
    if problem is not None:
        raise InvalidRequestError("messages", problem)
    try:
        text = engine.tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=add_generation_prompt)
    except Exception as e:    # the checkpoint's own template code: a jinja2 syntax error, or its
        # raise_exception() refusing the messages (only some roles allowed), ended in a traceback
        raise InvalidRequestError("messages", f"the chat template of {engine.model_path} failed: "
                                  f"{type(e).__name__}: {e}") from None
    if not isinstance(text, str) or not text:
        # (the engine then refused the empty text as "prompt: is empty", blaming the caller's prompt)
        raise InvalidRequestError("messages", f"the chat template of {engine.model_path} made empty text of the "
                                  "conversation")
    return text
