"""Tokenizer and end-of-sequence ids from a checkpoint directory, offline, never running its code.

The tokenizer is transformers' and importing transformers costs seconds, so the engine loads it
lazily, on the first prompt text to encode or output to decode (`LazyTokenizer`). The EOS ids
a request stops on are needed before that: they come from generation_config.json and from the
tokenizer's own files (tokenizer_config.json / special_tokens_map.json name the EOS token,
tokenizer_config.json or tokenizer.json give its id). Only when those files leave it open (no EOS
named, a name they do not resolve, two files that disagree) is the tokenizer loaded to ask it.
"""

import numbers
from pathlib import Path

from pcg_engine.errors import CheckpointError
from pcg_engine.models.json_file import read_json_object
from pcg_engine.models.model_config import token_ids_ok
from pcg_engine.models.regular_file import open_regular


# The tokenizer's JSON files, read by this module and by transformers.
# added_tokens.json too: transformers reads it while loading, and a broken one was blamed on the
# files above (found by a review).
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def load_tokenizer(path: Path):
    """transformers' tokenizer of the checkpoint; a broken file is a CheckpointError naming it.

    transformers' own errors named no file: json's bare message for a file that is not JSON, an
    AttributeError for one of the wrong shape; and a key given twice (a token with two ids in
    tokenizer.json's vocab) loaded its last value without a word. So the files are read here first,
    each one JSON object with no key given twice. That parses Qwen3's 11 MB tokenizer.json once more
    (0.3 s on a 2-core test host), once a process, on the first text prompt; token-id prompts never
    pay it."""
    path = Path(path)
    for name in TOKENIZER_JSON_FILES:
        _read_json(path / name)
    _check_chat_template_file(path / CHAT_TEMPLATE_FILE)
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as e:
        # Valid JSON of the wrong structure: which file, only transformers' reason can tell.
        present = [f.name for f in sorted(path.iterdir()) if f.name.startswith((
            "tokenizer", "special_tokens", "vocab", "merges", "added_tokens", "chat_template"))]
        raise CheckpointError(f"{path}: the tokenizer ({', '.join(present)}) cannot be loaded: "
                              f"{type(e).__name__}: {e}") from e
    # transformers keeps this field unchecked and compares it with every encoded length: a string
    # ("4096") loaded, then each text prompt failed with a bare TypeError (found by a review).
    limit = getattr(tokenizer, "model_max_length", None)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, numbers.Real)):
        raise CheckpointError(f"{path / 'tokenizer_config.json'}: model_max_length is {limit!r}; allowed: a "
                              "number of tokens (or no such key)")
    return tokenizer


def _check_chat_template_file(file: Path) -> None:
    """chat_template.jinja, read by transformers while loading the tokenizer (for every text
    prompt, chat or not): text it cannot decode failed the load with a UnicodeDecodeError blamed on
    tokenizer.json (found by a review)."""
    if not file.is_file():
        return
    try:
        with open_regular(file) as f:
            f.read().decode("utf-8")
    except OSError as e:
        raise CheckpointError(f"{file}: unreadable ({e})") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start}); a chat template is "
                              "Jinja text") from None


# Files that hold a vocabulary: a fast tokenizer's, a BPE one's, a SentencePiece model. Without any,
# transformers 5 still builds the model type's tokenizer class, empty: text encodes to no tokens
# and every output decodes to "" (seen with a weights-only Qwen3 directory).
VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")


class LazyTokenizer:
    """Loads the checkpoint's tokenizer on first use; `loaded` says whether that has happened,
    `available` whether the checkpoint has one at all (a vocabulary file)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._tokenizer = None
        self.available = any((self.path / name).is_file() for name in VOCABULARY_FILES)

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def missing(self) -> str:
        """What to tell a caller who needs text: the checkpoint has no tokenizer."""
        return f"the checkpoint {self.path} has no tokenizer (none of {', '.join(VOCABULARY_FILES)})"

    def get(self):
        if self._tokenizer is None:
            if not self.available:
                raise CheckpointError(f"{self.missing()}: give prompts as token ids")
            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer


_UNKNOWN = object()


def _read_json(file: Path) -> dict | None:
    """A checkpoint's JSON file (a tokenizer file, generation_config.json) as its object, None if
    there is no such file; one that cannot be read as a JSON object, or gives a key twice, is a
    CheckpointError naming it (models/json_file.py)."""
    return read_json_object(file) if file.is_file() else None


def _token_text(value):
    """A special token as tokenizer files write it: a string, or an AddedToken dict with content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else _UNKNOWN


def tokenizer_eos_id(path: Path):
    """The tokenizer's eos_token_id read from its files: an int, None (no EOS token), or _UNKNOWN."""
    path = Path(path)
    config = _read_json(path / "tokenizer_config.json")
    special = _read_json(path / "special_tokens_map.json")
    named = [d["eos_token"] for d in (config, special) if isinstance(d, dict) and "eos_token" in d]
    if not named:
        return _UNKNOWN                   # the tokenizer class may have a default: ask it
    if isinstance(config, dict) and "eos_token" not in config and "added_tokens_decoder" in config:
        # Named in special_tokens_map.json alone, beside an added_tokens_decoder: transformers 5
        # then reads that file or not by version (5.25 does not, keeping the class's default),
        # so the files alone cannot tell; ask the tokenizer (found by a review).
        return _UNKNOWN
    texts = {None if v is None else _token_text(v) for v in named}
    if len(texts) != 1 or _UNKNOWN in texts:
        return _UNKNOWN
    text = texts.pop()
    if text is None:
        return None
    decoder = (config or {}).get("added_tokens_decoder")
    if isinstance(decoder, dict):
        ids = [int(i) for i, tok in decoder.items() if isinstance(tok, dict) and tok.get("content") == text
               and str(i).isdigit()]
        if len(ids) == 1:
            return ids[0]
    tok = _read_json(path / "tokenizer.json")
    if tok is None:
        return _UNKNOWN
    # A file of another structure is left to the tokenizer's loader, which names what is wrong.
    added = tok.get("added_tokens")
    added = [t.get("id") for t in (added if isinstance(added, list) else [])
             if isinstance(t, dict) and t.get("content") == text]
    if len(added) == 1 and isinstance(added[0], int):
        return added[0]
    model = tok.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if not added and isinstance(vocab, dict) and isinstance(vocab.get(text), int):
        return vocab[text]
    return _UNKNOWN


def _generation_eos_ids(file: Path, value, vocab_size: int | None) -> list[int]:
    """generation_config.json's eos_token_id: a token id, a list of them, or null. Any other entry
    is refused, not dropped: a request would run on past the EOS the file meant, and an id beyond
    the vocabulary is never sampled (config.json's eos_token_id is checked the same way at load)."""
    if not token_ids_ok(value, vocab_size):
        allowed = (f"a token id in 0..{vocab_size - 1} (config.json's vocab_size)" if vocab_size is not None
                   else "a token id (an integer >= 0)")
        raise CheckpointError(f"{file}: field 'eos_token_id' is {value!r}; allowed: {allowed}, a list of them, "
                              "or null")
    return [] if value is None else value if isinstance(value, list) else [value]


def eos_token_ids(path: Path, tokenizer=None, vocab_size: int | None = None) -> set[int]:
    """EOS ids from generation_config.json (int or list; config.json's where that file gives none)
    and the tokenizer. `tokenizer` may be a
    loaded tokenizer, a LazyTokenizer (loaded only if its files do not give the id) or None.
    vocab_size, where known (the engine's model), bounds generation_config.json's ids and the
    tokenizer's."""
    ids: set[int] = set()
    file = Path(path) / "generation_config.json"
    config = _read_json(file)
    if config is None or "eos_token_id" not in config:
        # Without the file's own entry, config.json's eos_token_id (checked at load by model_config.py).
        # transformers' generate() falls back to it only where the file is absent
        # (GenerationConfig.from_model_config); a file that names no EOS runs its generate() to
        # max_new_tokens. Here the model's declared EOS still ends a request, as the tokenizer's does
        # (vLLM stops at both too). Ignored before, a checkpoint without generation_config.json and
        # without a tokenizer ran every request to max_tokens.
        file = Path(path) / "config.json"
        config = _read_json(file)
    if config is not None:
        ids.update(_generation_eos_ids(file, config.get("eos_token_id"), vocab_size))
    eos = tokenizer_eos_id(path) if isinstance(tokenizer, LazyTokenizer) and not tokenizer.loaded else _UNKNOWN
    if eos is _UNKNOWN:
        if isinstance(tokenizer, LazyTokenizer) and not tokenizer.available:
            return ids                    # nothing to ask: generation_config.json's ids only
        loaded = tokenizer.get() if isinstance(tokenizer, LazyTokenizer) else tokenizer
        eos = getattr(loaded, "eos_token_id", None)
    if eos is not None:
        if vocab_size is not None and not 0 <= eos < vocab_size:
            # The tokenizer's EOS beyond the model's logits is never sampled: requests would run to
            # max_tokens. The tokenizer and config.json are not of the same model.
            raise CheckpointError(f"{path}: the tokenizer's eos token has id {eos}, outside the model's vocabulary; "
                                  f"allowed: 0..{vocab_size - 1} (config.json's vocab_size)")
        ids.add(eos)
    return ids
