"""Prompt files given on the command line (`pcg generate --prompts-file`, `pcg bench load-test
--dataset`): UTF-8 text, one prompt or one JSON object per line. A file that cannot be read, is not
UTF-8, or has a line that is not JSON stops the command in one line naming the flag (and the line's
number), not in a traceback; each caller then checks the objects' fields. A leading UTF-8 byte-order
mark (Windows editors write one) is not part of the first line."""

import json


def read_lines(path: str, flag: str) -> list[tuple[int, str]]:
    """(line number from 1, line) of the file's non-blank lines."""
    try:
        # utf-8-sig: with plain utf-8 the mark stayed on line 1, so a JSONL file's first line did not
        # start with "{" and its object was run as a text prompt, JSON and all.
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except OSError as e:
        raise SystemExit(f"{flag}: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SystemExit(f"{flag}: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    return [(number, line) for number, line in enumerate(text.split("\n"), 1) if line.strip()]


def parse_json(line: str, number: int, flag: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise SystemExit(f"{flag}: line {number} is not valid JSON ({e.msg}): {line[:80]}") from None


def sampling_field(obj: dict) -> str | None:
    """The first key of a JSON line that names a SamplingParams field, if any. Neither command reads
    sampling from a line (generate takes its flags', a dataset gives only output_len), and such a
    key was dropped without a word: each caller refuses the line, naming it."""
    from pcg_engine.sampling_params import SamplingParams
    names = SamplingParams.field_names()
    return next((k for k in obj if k in names), None)
