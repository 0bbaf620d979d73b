"""Prompt files given on the command line (`pcg generate --prompts-file`, `pcg bench load-test
--dataset`): UTF-8 text, one prompt or one JSON object per line. A file that cannot be read, is not
UTF-8, or has a line that is not JSON (or gives a key twice in one object) stops the command in one
line naming the flag (and the line's number), not in a traceback; each caller then checks the
objects' fields. A leading UTF-8 byte-order mark (Windows editors write one) is not part of the
first line."""

import json
import re
import sys

from pcg_engine.models.json_file import refuse_repeats, RepeatedKey, beyond_json_limits


# Standard input's bytes once read ("-"): a benchmark that runs each mode in a fresh process hands
# them to the children, whose own "-" found an empty stdin ("--dataset: - holds no request").
stdin_bytes: bytes | None = None


def read_lines(path: str, flag: str) -> list[tuple[int, str]]:
    """(line number from 1, line) of the file's non-blank lines; path "-" reads standard input."""
    global stdin_bytes
    try:
        if path == "-":
            if stdin_bytes is None:
                stdin_bytes = sys.stdin.buffer.read()
            data = stdin_bytes
        else:
            with open(path, "rb") as f:
                data = f.read()
    except OSError as e:
        raise SystemExit(f"{flag}: cannot read {path}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1   # (the byte offset alone left the line to be counted out)
        raise SystemExit(f"{flag}: {path} is not UTF-8 text: line {line}: {e.reason} at byte {e.start}") from None
    text = text.replace("\r\n", "\n").replace("\r", "\n")   # every newline convention, as text mode reads
    # A byte-order mark is dropped wherever a line starts with one: left on line 1, a JSONL file's
    # first line did not start with "{" and its object was run as a text prompt, JSON and all; files
    # saved with one and joined by `cat` carry it at a later line's start too (found by a review).
    lines = (line.removeprefix("\ufeff") for line in text.split("\n"))
    return [(number, line) for number, line in enumerate(lines, 1) if line.strip()]


def parse_json(line: str, number: int, flag: str):
    try:
        # A key given twice: json.loads kept the last value, so {"max_tokens": 3, "max_tokens": 500}
        # (or two "prompt"s) ran one of them without a word about the other; which was meant cannot
        # be told. Refused, as checkpoint JSON files are (models/json_file.py).
        return json.loads(line, object_pairs_hook=refuse_repeats)
    except RepeatedKey as e:
        raise SystemExit(f"{flag}: line {number}: key {e.key!r} is given twice in one object; which value is "
                         "meant cannot be told") from None
    except json.JSONDecodeError as e:
        # A text prompt that starts with "{" ("{set} theory") is read as JSON too: say how to give it.
        # (the hint is for prompts files, where other lines are text; a dataset takes JSON lines only)
        hint = (" (a line that starts with '{' is read as a JSON object; give such a text prompt as "
                "{\"prompt\": \"...\"})") if line.lstrip().startswith("{") else ""
        raise SystemExit(f"{flag}: line {number} is not valid JSON ({e.msg}): {line[:80]}{hint}") from None
    except (RecursionError, ValueError) as e:   # json's own limits (models/json_file.py says which)
        raise SystemExit(f"{flag}: line {number} is not valid JSON here ({beyond_json_limits(e)}): "
                         f"{line[:80]}") from None


def sampling_field(obj: dict) -> str | None:
    """The first key of a JSON line that names a SamplingParams field, if any. A load-test dataset
    gives only output_len, and such a key was dropped without a word: the load test refuses the
    line, naming it. (`pcg generate` reads them as the prompt's own sampling parameters.)"""
    from pcg_engine.sampling_params import SamplingParams
    names = SamplingParams.field_names()
    return next((k for k in obj if k in names), None)


# Other engines' names of a sampling field (Hugging Face, OpenAI, Anthropic): on a line they were
# ignored like any other key, the prompt run at the flags' value.
_FIELD_ALIASES = {"max_new_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "stop_sequences": "stop",
                  "top_logprobs": "logprobs"}

# Sampling options of other engines' APIs (vLLM, OpenAI, transformers' generate) that pcg-engine does
# not implement, with what to do instead: a line carrying one ran without it, without a word.
OTHER_ENGINES_OPTIONS = {
    "best_of": "add the prompt again with another seed", "use_beam_search": "beam search is not implemented",
    "num_beams": "beam search is not implemented", "length_penalty": "beam search is not implemented",
    "logit_bias": "not implemented", "prompt_logprobs": "not implemented",
    "include_stop_str_in_output": "not implemented (the text leaves the stop string out)",
    "do_sample": "give temperature instead (0: greedy)", "response_format": "not implemented",
    # (found by a review: ignored without a word, e.g. a banned word sampled first)
    "bad_words": "not implemented", "allowed_token_ids": "not implemented",
    "spaces_between_special_tokens": "not implemented (the text is the tokenizer's decode)",
    "add_special_tokens": "not implemented (text prompts are encoded without special tokens)",
    "chat_template_kwargs": "not implemented (--chat renders the template with the prompt alone)",
}


def other_engines_option(key: str) -> str | None:
    """A refusal's reason for `key` when it is another engine's sampling option (see above), else None."""
    why = OTHER_ENGINES_OPTIONS.get(key)
    return None if why is None else f"{key!r} is another engine's sampling option that pcg-engine does not take: {why}"


def misspelt_field(key: str, names: tuple) -> str | None:
    """The SamplingParams field that `key` (a JSONL line's key that is none of them) reads as a
    misspelling of: another case, '-' for '_', camelCase, one letter added, dropped, changed or
    swapped ("temprature", "stop_token_id", "logprob"), or another engine's name ("max_new_tokens");
    None for an unrelated key ("id", "label", "n_tokens", "top"). One edit counts only towards a
    field of 6 letters or more: one letter from "stop" and "seed" are ordinary words a dataset uses
    as keys ("step", "shop", "seen", "need", "speed"), whose lines ran before and must still run."""
    plain = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", key).lower().replace("-", "_").replace(" ", "_")
    if plain in names or plain in _FIELD_ALIASES:
        return _FIELD_ALIASES.get(plain, plain)
    return next((name for name in names if len(name) >= 6 and _one_edit_apart(plain, name)), None)


def _one_edit_apart(a: str, b: str) -> bool:
    """a and b differ by one letter inserted, deleted, replaced, or two neighbours swapped."""
    if abs(len(a) - len(b)) > 1 or a == b:
        return False
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    if len(a) == len(b):
        return a[i + 1:] == b[i + 1:] or (a[i + 2:] == b[i + 2:] and a[i:i + 2] == b[i:i + 2][::-1])
    return (a[i + 1:] == b[i:]) if len(a) > len(b) else (a[i:] == b[i + 1:])
