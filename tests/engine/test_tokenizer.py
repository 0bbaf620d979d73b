"""The tokenizer is loaded lazily (engine/tokenizer.py): an engine starts without transformers, EOS
ids come from the tokenizer's files and equal what the loaded tokenizer says, and the first text to
encode or decode loads it."""

import json
import shutil
import subprocess
import sys

import pytest

from engine_helpers import make_llm
from pcg_engine.engine.tokenizer import _UNKNOWN, LazyTokenizer, eos_token_ids, load_tokenizer, tokenizer_eos_id
from pcg_engine.errors import CheckpointError
from pcg_engine.sampling_params import SamplingParams


def test_eos_from_files_equals_the_loaded_tokenizer(dense_path):
    tok = load_tokenizer(dense_path)
    assert tok.eos_token_id is not None
    assert tokenizer_eos_id(dense_path) == tok.eos_token_id
    assert eos_token_ids(dense_path, tok) == eos_token_ids(dense_path, None) | {tok.eos_token_id}


@pytest.fixture
def tok_copy(dense_path, tmp_path):
    for f in dense_path.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    return tmp_path


def _edit(path, name, fn):
    data = json.loads((path / name).read_text()) if (path / name).exists() else {}
    fn(data)
    (path / name).write_text(json.dumps(data))


def test_eos_file_variants(tok_copy):
    want = load_tokenizer(tok_copy).eos_token_id
    text = json.loads((tok_copy / "tokenizer_config.json").read_text())["eos_token"]
    # AddedToken form, and an added_tokens_decoder entry
    _edit(tok_copy, "tokenizer_config.json", lambda d: d.update(
        eos_token={"content": text, "__type": "AddedToken"},
        added_tokens_decoder={str(want): {"content": text, "special": True}}))
    assert tokenizer_eos_id(tok_copy) == want
    # special_tokens_map.json agreeing, then disagreeing: ask the tokenizer
    _edit(tok_copy, "special_tokens_map.json", lambda d: d.update(eos_token=text))
    assert tokenizer_eos_id(tok_copy) == want
    _edit(tok_copy, "special_tokens_map.json", lambda d: d.update(eos_token="<|endoftext|>"))
    assert tokenizer_eos_id(tok_copy) is _UNKNOWN
    (tok_copy / "special_tokens_map.json").unlink()
    # named nowhere (a tokenizer class may have a default), or a name the files do not hold
    _edit(tok_copy, "tokenizer_config.json", lambda d: d.pop("eos_token"))
    assert tokenizer_eos_id(tok_copy) is _UNKNOWN
    _edit(tok_copy, "tokenizer_config.json", lambda d: d.update(eos_token="<no such token>", added_tokens_decoder={}))
    assert tokenizer_eos_id(tok_copy) is _UNKNOWN
    _edit(tok_copy, "tokenizer_config.json", lambda d: d.update(eos_token=None))
    assert tokenizer_eos_id(tok_copy) is None
    # named in special_tokens_map.json alone, beside an added_tokens_decoder (found by a review:
    # transformers 5.25 does not read that file then, and its tokenizer's EOS was another): ask it
    _edit(tok_copy, "tokenizer_config.json", lambda d: (d.pop("eos_token"), d.update(
        added_tokens_decoder={str(want): {"content": text, "special": True}})))
    _edit(tok_copy, "special_tokens_map.json", lambda d: d.update(eos_token=text))
    assert tokenizer_eos_id(tok_copy) is _UNKNOWN


@pytest.mark.parametrize("name, content, expected", [
    ("tokenizer.json", b"{bad", "tokenizer.json: not valid JSON (Expecting property name"),
    ("tokenizer.json", b"\xff\xfe", "tokenizer.json: not valid JSON ('utf-8' codec can't decode"),
    ("tokenizer.json", b'{"version": "1.0", "model": 5}',
     "tokenizer.json, tokenizer_config.json) cannot be loaded: "),
    ("tokenizer_config.json", b"{bad", "tokenizer_config.json: not valid JSON"),
    ("tokenizer_config.json", b"[1, 2]", "tokenizer_config.json: expected a JSON object, got list"),
    ("special_tokens_map.json", b'"x"', "special_tokens_map.json: expected a JSON object, got str"),
])
def test_broken_tokenizer_file_is_named(tok_copy, name, content, expected):
    """Found by probing: json's bare JSONDecodeError or UnicodeDecodeError, or an AttributeError,
    naming no file, from the engine's start-up (which reads the EOS id from these files)."""
    (tok_copy / name).write_bytes(content)
    for read in (lambda: eos_token_ids(tok_copy, LazyTokenizer(tok_copy)),   # the engine's start-up
                 lambda: load_tokenizer(tok_copy)):                           # the first text's load
        with pytest.raises(CheckpointError) as info:
            read()
        assert str(tok_copy) in str(info.value) and expected in str(info.value)


@pytest.mark.parametrize("name, content, expected", [
    ("added_tokens.json", b"{bad", "added_tokens.json: not valid JSON (Expecting property name"),
    ("added_tokens.json", b"[1]", "added_tokens.json: expected a JSON object, got list"),
    ("chat_template.jinja", b"\xff{{ x }}", "chat_template.jinja: not UTF-8 text (invalid start byte at byte 0)"),
])
def test_broken_file_the_tokenizer_loads_too_is_named(tok_copy, name, content, expected):
    """Found by a review: transformers reads added_tokens.json and chat_template.jinja while loading
    the tokenizer (for any text prompt, chat or not); a broken one failed the load as "the tokenizer
    (tokenizer.json, tokenizer_config.json) cannot be loaded: JSONDecodeError ...", or with a bare
    AttributeError, naming neither file."""
    (tok_copy / name).write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        load_tokenizer(tok_copy)
    assert str(info.value).startswith(f"{tok_copy / name}: ") and expected in str(info.value), str(info.value)


def _give_twice(file, old, new):
    """`file` with its first `old` replaced by `new` (which repeats a key), the rest as it was."""
    text = file.read_text() if file.exists() else "{}"
    assert old in text
    file.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize("name, old, new, key", [
    # a token given two ids in the vocabulary: the last one was taken
    ("tokenizer.json", '"vocab": {', '"vocab": {"!": 99, ', "!"),
    ("tokenizer.json", '{', '{"version": "0.1", ', "version"),
    ("tokenizer_config.json", '{', '{"eos_token": "<|endoftext|>", ', "eos_token"),
    ("special_tokens_map.json", '{', '{"eos_token": "<|im_end|>", "eos_token": "<|endoftext|>"', "eos_token"),
])
def test_tokenizer_file_key_given_twice_is_refused(tok_copy, name, old, new, key):
    """Found by probing: json and transformers keep the last value of a repeated key without a word,
    so the second EOS name or the token's second id won. Refused like config.json's repeats
    (models/json_file.py), by the engine's start-up and by the first text's load."""
    file = tok_copy / name
    _give_twice(file, old, new)
    for read in (lambda: eos_token_ids(tok_copy, LazyTokenizer(tok_copy)),   # the engine's start-up
                 lambda: load_tokenizer(tok_copy)):                           # the first text's load
        with pytest.raises(CheckpointError) as info:
            read()
        assert str(file) in str(info.value) and f"key {key!r} is given twice in one object" in str(info.value)


def test_tokenizer_json_key_given_twice_refuses_text_not_the_engine(dense_path, tmp_path):
    """Where the start-up finds the EOS id without tokenizer.json (tokenizer_config.json's
    added_tokens_decoder), a repeated key in it is refused on the first text prompt; the engine
    keeps serving token-id prompts and holds nothing of the refused request."""
    for f in dense_path.iterdir():
        (tmp_path / f.name).symlink_to(f) if f.name == "model.safetensors" else shutil.copy(f, tmp_path / f.name)
    eos = load_tokenizer(dense_path).eos_token_id
    text = json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"]
    _edit(tmp_path, "tokenizer_config.json", lambda d: d.update(
        added_tokens_decoder={str(eos): {"content": text, "special": True}}))
    _give_twice(tmp_path / "tokenizer.json", '"vocab": {', '"vocab": {"!": 99, ')
    llm = make_llm(tmp_path)
    with pytest.raises(CheckpointError, match="tokenizer.json: key '!' is given twice in one object"):
        llm.generate(["Hello"], SamplingParams(max_tokens=2))
    engine = llm.engine
    assert not engine.requests and engine.block_manager.num_used_blocks == 0
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, detokenize=False))
    assert len(out[0].token_ids) == 3
    llm.close()


def test_engine_loads_the_tokenizer_on_first_text(dense_path):
    llm = make_llm(dense_path)
    lazy = llm.engine.lazy_tokenizer
    assert not lazy.loaded
    assert llm.engine.eos_token_ids == eos_token_ids(dense_path, load_tokenizer(dense_path))
    outs = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, detokenize=False))
    assert len(outs[0].token_ids) >= 1 and not lazy.loaded          # token ids in, token ids out
    out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0))[0]
    assert lazy.loaded and out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert llm.tokenizer is llm.engine.tokenizer


@pytest.mark.slow
def test_startup_imports_no_transformers(dense_path):
    """The whole start-up path (config, weights, engine) without transformers in the process."""
    code = ("import sys; from pcg_engine.llm import LLM; "
            f"llm = LLM({str(dense_path)!r}, device='cpu', max_num_seqs=4, max_model_len=64); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'sklearn', 'tokenizers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_checkpoint_without_a_tokenizer(dense_path, tmp_path):
    """Weights and configs but no vocabulary file: transformers would build an empty tokenizer
    (text -> no tokens, outputs -> ""). Token-id prompts run, with generation_config.json's EOS;
    text prompts and stop strings are refused by name; the engine keeps serving."""
    from pcg_engine.errors import CheckpointError, InvalidRequestError
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(dense_path / name, bare / name)
    llm = make_llm(bare)
    engine = llm.engine
    assert not engine.lazy_tokenizer.available
    assert engine.eos_token_ids == eos_token_ids(bare, None)
    with pytest.raises(InvalidRequestError, match="prompt: is text, but the checkpoint .* has no tokenizer"):
        llm.generate(["hello"], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="stop: stop strings .* use stop_token_ids") as info:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, stop=["x"]))
    assert info.value.field == "stop"
    with pytest.raises(CheckpointError, match="has no tokenizer"):
        llm.tokenizer
    assert not engine.requests
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.text == ""
    with_tok = make_llm(dense_path).generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0,
                                                                          ignore_eos=True))[0]
    assert out.token_ids == with_tok.token_ids


def test_tokenizer_eos_outside_the_model_vocabulary_is_refused(tok_copy):
    """Found by probing: a tokenizer whose EOS id lies beyond config.json's vocab_size was taken, and
    that token can never be sampled, so every request ran to max_tokens."""
    want = load_tokenizer(tok_copy).eos_token_id
    assert want < 1024 and want in eos_token_ids(tok_copy, LazyTokenizer(tok_copy), vocab_size=1024)   # in range: taken
    text = json.loads((tok_copy / "tokenizer_config.json").read_text())["eos_token"]
    _edit(tok_copy, "tokenizer_config.json", lambda d: d.update(
        added_tokens_decoder={"5000": {"content": text, "special": True}}))
    with pytest.raises(CheckpointError) as info:
        eos_token_ids(tok_copy, LazyTokenizer(tok_copy), vocab_size=1024)
    assert str(info.value) == (f"{tok_copy}: the tokenizer's eos token has id 5000, outside the model's vocabulary; "
                               "allowed: 0..1023 (config.json's vocab_size)")



def test_text_beyond_a_smaller_model_vocabulary_names_the_tokenizer(dense_path, tok_copy):
    """Found by probing: a tokenizer larger than config.json's vocab_size (the two of different
    models) encoded some text to ids the model has no row for, and the refusal read
    "prompt_token_ids: token 797 at position 0 is outside the vocabulary": ids the caller never gave.
    Now the text prompt is refused naming the mismatch; the batch keeps running and nothing is queued."""
    from safetensors.torch import load_file, save_file

    from pcg_engine.errors import InvalidRequestError
    vocab = 512                                      # the tokenizer holds 1024 tokens
    weights = load_file(str(dense_path / "model.safetensors"))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:vocab].clone()   # tied head
    save_file(weights, str(tok_copy / "model.safetensors"))
    _edit(tok_copy, "config.json", lambda d: d.update(vocab_size=vocab))
    llm = make_llm(tok_copy)
    text = "zebra quantum xylophone"
    assert max(llm.tokenizer.encode(text)) >= vocab
    engine = llm.engine
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False), request_id="a")
    engine.step()
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(text, SamplingParams(max_tokens=2))
    assert info.value.field == "prompt"
    assert str(info.value).startswith(f"prompt: the text encodes to token {max(llm.tokenizer.encode(text))}, "
                                      f"beyond the model's vocabulary 0..{vocab - 1} (config.json's vocab_size): "
                                      f"the tokenizer of {tok_copy} holds 1024 tokens")
    assert list(engine.requests) == ["a"]
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.requests and engine.block_manager.num_used_blocks == 0
    llm.close()


@pytest.mark.parametrize("generation_config", ["missing", "without eos_token_id", "eos_token_id null"])
def test_eos_from_config_json_when_generation_config_gives_none(dense_path, tmp_path, generation_config):
    """As transformers' generate() does (GenerationConfig.from_model_config): without
    generation_config.json, or with one that has no eos_token_id, config.json's eos_token_id is
    the EOS. It was ignored: a checkpoint without that file and without a tokenizer (weights and
    config.json, as a conversion leaves them) ran every request to max_tokens. A file that says
    null means no EOS of its own, and config.json's is not taken over it."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(dense_path / name, bare / name)
    config_eos = json.loads((bare / "config.json").read_text())["eos_token_id"]
    assert isinstance(config_eos, int)
    if generation_config != "missing":
        data = json.loads((dense_path / "generation_config.json").read_text())
        if generation_config == "without eos_token_id":
            del data["eos_token_id"]
        else:
            data["eos_token_id"] = None
        (bare / "generation_config.json").write_text(json.dumps(data))
    want = set() if generation_config == "eos_token_id null" else {config_eos}
    assert eos_token_ids(bare, LazyTokenizer(bare), vocab_size=1024) == want
    assert make_llm(bare).engine.eos_token_ids == want


def test_a_prompt_past_the_tokenizers_model_max_length_gives_no_transformers_warning(tok_copy, dense_path):
    """The engine's limit is max_model_len; transformers' "Token indices sequence length is longer
    than the specified maximum sequence length" (the tokenizer's model_max_length) was printed for a
    prompt the engine then ran, or truncated as asked."""
    shutil.copy(dense_path / "model.safetensors", tok_copy / "model.safetensors")
    _edit(tok_copy, "tokenizer_config.json", lambda d: d.update(model_max_length=8))
    import logging

    class Records(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    # transformers' own handler writes to the stderr of its import (not what capfd captures): a
    # handler of ours on its logger sees what it would print.
    records, logger = Records(), logging.getLogger("transformers")
    logger.addHandler(records)
    try:
        llm = make_llm(tok_copy)
        out = llm.generate(["hello world " * 10], SamplingParams(max_tokens=2, temperature=0))[0]
    finally:
        logger.removeHandler(records)
    assert not [m for m in records.messages if "Token indices" in m]
    assert len(out.prompt_token_ids) > llm.tokenizer.model_max_length == 8 and len(out.token_ids) == 2


@pytest.mark.parametrize("limit", ["4096", [4096], True])
def test_model_max_length_that_is_not_a_number_is_named(tok_copy, limit):
    """Found by review: tokenizer_config.json's model_max_length as a string loaded, then every
    text prompt failed inside transformers with a bare TypeError ('>' not supported between int and
    str), naming neither the file nor the field. The load now refuses it."""
    _edit(tok_copy, "tokenizer_config.json", lambda d: d.update(model_max_length=limit))
    with pytest.raises(CheckpointError) as info:
        load_tokenizer(tok_copy)
    assert str(info.value) == (f"{tok_copy / 'tokenizer_config.json'}: model_max_length is {limit!r}; allowed: a "
                               "number of tokens (or no such key)")
    _edit(tok_copy, "tokenizer_config.json", lambda d: d.update(model_max_length=4096))
    assert load_tokenizer(tok_copy).model_max_length == 4096
