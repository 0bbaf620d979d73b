"""Tokenizer and end-of-sequence ids from a checkpoint directory, offline, never running its code."""

import json
from pathlib import Path


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)


def eos_token_ids(path: Path, tokenizer) -> set[int]:
    """EOS ids from generation_config.json (int or list) and the tokenizer."""
    ids: set[int] = set()
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
