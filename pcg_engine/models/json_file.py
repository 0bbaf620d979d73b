"""Reading a checkpoint's JSON files (config.json, the shard index, generation_config.json, the
tokenizer's files): one JSON object, no key given twice at any depth, or a CheckpointError naming
the file and the key.

json.loads keeps the last value of a repeated key, so a config.json giving "vocab_size" twice, an
index mapping one tensor to two shards, or a tokenizer.json giving one token two ids, would load one
of the values without a word about the other; which one the author meant cannot be told. (The
shards' own headers get the same check in safetensors_reader.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

from pcg_engine.errors import CheckpointError
from pcg_engine.models.regular_file import open_regular


class RepeatedKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def refuse_repeats(pairs: list) -> dict:
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise RepeatedKey(key)
        obj[key] = value
    return obj


def beyond_json_limits(e: Exception) -> str:
    """What json.loads raised at its own limits, where the text may be valid JSON: a RecursionError
    for arrays or objects nested too deep, a ValueError for an integer of over 4300 digits
    (sys.get_int_max_str_digits). Neither is a JSONDecodeError: uncaught, they left as bare
    tracebacks naming no file."""
    return "nested deeper than Python's json reader goes" if isinstance(e, RecursionError) else str(e)


def read_json_object(file: Path) -> dict:
    """The file's JSON object; a file that cannot be read, is not JSON, is not an object or gives a
    key twice in one object is a CheckpointError naming it."""
    try:
        with open_regular(Path(file)) as f:
            text = f.read().decode("utf-8")
        data = json.loads(text, object_pairs_hook=refuse_repeats)
    except OSError as e:
        raise CheckpointError(f"{file}: unreadable ({e})") from None
    except RepeatedKey as e:
        raise CheckpointError(f"{file}: key {e.key!r} is given twice in one object; which value is meant "
                              "cannot be told") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    except (RecursionError, ValueError) as e:
        raise CheckpointError(f"{file}: not valid JSON here ({beyond_json_limits(e)})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data
