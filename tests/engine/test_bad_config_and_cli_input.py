"""Bad settings and bad CLI input get a clear error naming the field (or flag) and what it allows,
before anything is loaded: EngineConfig's device, and `pcg generate --prompts-file`."""

import argparse
import json
import re

import numpy as np
import pytest

from pcg_engine.cli import _read_prompts
from pcg_engine.config import EngineConfig
from pcg_engine.errors import ConfigError


@pytest.mark.parametrize("device", ["bogus", "cuda:x", "cpu:0", "", "CUDA", "cuda:", " cpu"])
def test_device_outside_the_allowed_forms(device):
    with pytest.raises(ConfigError, match="device: got .*allowed: auto, cpu, cuda or cuda:N") as e:
        EngineConfig(device=device)
    assert e.value.field == "device"


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_forms_accepted(device):
    assert EngineConfig(device=device).device == device


@pytest.mark.parametrize("field, value, allowed", [
    ("seed", "s", "an int in"), ("seed", 2**64, "an int in"), ("seed", 1.5, "an int in"),
    ("async_scheduling", "yes", "None, True or False"), ("kernels", "nope", "None, True or False"),
    ("enable_prefix_caching", 2, "True or False"), ("fuse", None, "True or False"),
    ("compile_cache", "no", "True or False"), ("show_progress", 1, "True or False"),
    ("compile_cache_dir", 123, "None or a directory path"),
    ("gpu_memory_utilization", "0.5", "a number in (0, 1]"), ("gpu_memory_utilization", True, "a number in (0, 1]"),
    ("max_num_seqs", True, "1..4096"), ("block_size", 16.0, "a power of two"),
    ("cudagraph_buckets", "8", "None or a non-empty list"), ("decode_buckets", [1, True], "None or a non-empty list"),
])
def test_field_of_the_wrong_type_is_named(field, value, allowed):
    """Before, these reached torch (seed: a RuntimeError from manual_seed), compared a string with
    a number (TypeError), or were taken as truthy values without a word."""
    with pytest.raises(ConfigError, match=f"{field}: got ") as e:
        EngineConfig(**{field: value})
    assert e.value.field == field and allowed in str(e.value)


def test_numpy_numbers_are_taken_as_the_plain_ones_they_stand_for():
    """Found by probing (session 26): max_num_seqs=np.int64(4) was refused as "got np.int64(4);
    allowed: 1..4096", a value inside the range it named. numpy's bools are the Python bools they
    stand for too (session 31: np.bool_(True) was refused as "got np.True_; allowed: True or False")."""
    cfg = EngineConfig(max_num_seqs=np.int64(4), block_size=np.int32(32), seed=np.uint8(7),
                       gpu_memory_utilization=np.float32(0.5))
    assert (cfg.max_num_seqs, cfg.block_size, cfg.seed) == (4, 32, 7)
    assert [type(v) for v in (cfg.max_num_seqs, cfg.block_size, cfg.seed)] == [int, int, int]
    assert type(cfg.gpu_memory_utilization) is float and cfg.gpu_memory_utilization == 0.5
    with pytest.raises(ConfigError, match="max_num_seqs: got 0; allowed: 1..4096"):
        EngineConfig(max_num_seqs=np.int64(0))
    flags = EngineConfig(enable_prefix_caching=np.bool_(False), async_scheduling=np.bool_(True))
    assert (flags.enable_prefix_caching, flags.async_scheduling) == (False, True)
    assert type(flags.enable_prefix_caching) is bool and type(flags.async_scheduling) is bool
    with pytest.raises(ConfigError, match="enable_prefix_caching: got "):
        EngineConfig(enable_prefix_caching=np.int64(1))


@pytest.mark.parametrize("value", ["", "  "])
def test_blank_compile_cache_dir_is_refused(capsys, value):
    """Found by fuzzing `pcg generate --compile-cache-dir`: "" (an unset shell variable,
    --compile-cache-dir "$DIR") named the working directory, and a compiled mode wrote its cache
    entries there without a word; "  " a directory of that name in it. Refused, as a blank model is."""
    from pcg_engine import cli
    with pytest.raises(ConfigError, match="compile_cache_dir: got .*; allowed: None or a directory path"):
        EngineConfig(compile_cache_dir=value)
    assert cli.main(["generate", "--device", "cpu", "--prompt", "hi", "--compile-cache-dir", value]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --compile-cache-dir (compile_cache_dir): got {value!r}; "
                                               "allowed: a directory path (not blank)")


def test_kernels_without_fuse_is_refused():
    """kernels=True with fuse=False loaded the model without any kernel (the fuse transform is what
    switches them on), without a word: the MoE layers ran the reference loop, not the grouped GEMM."""
    with pytest.raises(ConfigError, match="kernels: got True; allowed: None or False with fuse=False") as e:
        EngineConfig(kernels=True, fuse=False)
    assert e.value.field == "kernels"
    assert EngineConfig(kernels=False, fuse=False).kernels is False
    from pcg_engine.models.loader import load_model   # the same rule where a model is loaded directly
    with pytest.raises(ValueError, match="kernels: got True; allowed: None or False with fuse=False"):
        load_model("/nonexistent", fuse=False, kernels=True)
    assert EngineConfig(fuse=False).kernels is None and EngineConfig(kernels=True).fuse is True


@pytest.mark.parametrize("field, value, allowed", [
    ("max_num_batched_tokens", 10**9, "1..262144"), ("max_num_batched_tokens", 2**18 + 1, "1..262144"),
    ("max_num_batched_tokens", 0, "1..262144"), ("max_num_seqs", 10**9, "1..4096"),
])
def test_sizes_beyond_their_bound_are_refused(field, value, allowed):
    """Found by probing: max_num_batched_tokens=10**9 was taken, and the engine's start failed in the
    step buffers' allocation (torch's allocator asking for 24 GB, or the OOM killer ending the process)."""
    with pytest.raises(ConfigError) as e:
        EngineConfig(**{field: value})
    assert e.value.field == field and str(e.value) == f"{field}: got {value}; allowed: {allowed}"


@pytest.mark.parametrize("field", ["num_kv_blocks", "cpu_kv_blocks"])
def test_a_kv_cache_too_small_for_any_request_is_refused(tiny_paths, field):
    """Found by probing: num_kv_blocks=2 with block_size=1 left one usable token (block 0 is the
    scratch block) and the engine started, then refused every request, a 1-token prompt with
    max_tokens=1 included, with "allowed: at most 0 prompt tokens". The smallest caches allowed
    serve that request."""
    from engine_helpers import assert_drained, make_llm
    from pcg_engine.sampling_params import SamplingParams
    with pytest.raises(ConfigError, match=rf"^{field}: got 2; allowed: .*>= 3 with block_size 1 ") as e:
        EngineConfig(**{field: 2, "block_size": 1})
    assert e.value.field == field
    for block_size, blocks in ((1, 3), (2, 2)):
        llm = make_llm(tiny_paths["tiny-qwen3"], block_size=block_size, **{field: blocks})
        out = llm.generate([[5]], SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False))[0]
        assert len(out.token_ids) == 1 and out.finish_reason == "length"
        assert_drained(llm.engine)


def test_the_largest_step_budget_is_taken(tiny_paths):
    """At the bound the engine starts (its per-token buffers ~32 MB) and serves."""
    from engine_helpers import make_llm
    from pcg_engine.config import MAX_NUM_BATCHED_TOKENS
    from pcg_engine.sampling_params import SamplingParams
    llm = make_llm(tiny_paths["tiny-qwen3"], max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False))
    assert len(out[0].token_ids) == 2
    llm.close()


def test_fields_of_the_right_type_still_pass(tmp_path):
    config = EngineConfig(seed=-1, async_scheduling=False, kernels=None, compile_cache_dir=tmp_path,
                          gpu_memory_utilization=1, cudagraph_buckets=(1, 8), decode_buckets=[1, 2])
    assert config.seed == -1 and config.compile_cache_dir == tmp_path


@pytest.mark.parametrize("model", [123, b"/tmp", "", "  ", ["/tmp"]])
def test_model_that_is_not_a_directory_path_is_named(model):
    """Found by probing: LLM(123) looked for a directory "123", LLM(b"/path") for one named
    "b'/path'", and LLM("") loaded the working directory (or failed with "config.json: missing")."""
    from pcg_engine.llm import LLM
    with pytest.raises(ConfigError) as e:
        LLM(model, device="cpu")
    assert e.value.field == "model"
    assert str(e.value) == f"model: got {model!r}; allowed: None (the bundled tiny model) or a checkpoint directory path"


def test_checkpoint_directory_this_user_cannot_read_is_named(tiny_paths, monkeypatch):
    """Found by review (as a user without the rights; root reads any mode, so the refusal is
    simulated): a checkpoint directory of mode 000, 444 or 111 failed with a bare PermissionError
    from Path.is_file() naming tokenizer.json or config.json, not the directory at fault."""
    import os

    from pcg_engine.errors import CheckpointError
    from pcg_engine.llm import LLM
    from pcg_engine.models import model_config
    path = tiny_paths["tiny-qwen3"]
    real = os.listdir

    def listdir(p):
        if os.path.abspath(p) == os.path.abspath(path):
            raise PermissionError(13, "Permission denied", str(p))
        return real(p)
    monkeypatch.setattr(model_config.os, "listdir", listdir)
    with pytest.raises(CheckpointError) as e:
        LLM(path, device="cpu")
    assert str(e.value) == (f"{path}: checkpoint directory cannot be read (Permission denied); this user needs "
                            "read and search permission on it (chmod u+rx)")


def test_model_as_a_path_object_is_taken(tiny_paths):
    from pcg_engine.llm import LLM
    llm = LLM(tiny_paths["tiny-qwen3"], device="cpu", max_model_len=64)      # a pathlib.Path
    assert llm.config.model == str(tiny_paths["tiny-qwen3"])
    llm.close()
    assert EngineConfig(model=tiny_paths["tiny-qwen3"]).model == tiny_paths["tiny-qwen3"]


def test_max_model_len_beyond_the_checkpoint_is_refused(tiny_paths):
    """max_model_len above config.json's max_position_embeddings (4096 for tiny-qwen3) is refused
    before the weights load; up to it is fine."""
    from engine_helpers import make_llm
    from pcg_engine.models.loader import load_config
    path = tiny_paths["tiny-qwen3"]
    limit = load_config(path).max_position_embeddings
    for value in (limit + 1, 10**9):
        with pytest.raises(ConfigError, match=f"max_model_len: got {value}; allowed: 2..{limit} ") as e:
            make_llm(path, max_model_len=value)
        assert e.value.field == "max_model_len"
    llm = make_llm(path, max_model_len=limit)
    assert llm.engine.max_model_len == limit
    llm.close()


def test_buckets_with_auto_mode_on_the_cpu_are_named(tiny_paths):
    """mode 'auto' is eager on the CPU, which captures no graphs: a bucket list was ignored without a
    word. A warning naming the mode 'auto' runs here, once the device is known; the engine serves."""
    from engine_helpers import make_llm
    with pytest.warns(UserWarning, match=r"EngineConfig: cudagraph_buckets=\[1, 8\] has no effect in mode "
                                         r"'auto', which runs 'eager' here \(it shapes the graphs of piecewise "
                                         r"and full_and_piecewise\)"):
        llm = make_llm(tiny_paths["tiny-qwen3"], cudagraph_buckets=[1, 8])
    assert llm.engine.runner.mode == "eager"
    llm.close()


def test_cpu_device_resolves_to_itself():
    assert EngineConfig(device="cpu").resolved_device() == "cpu"


def _args(path):
    return argparse.Namespace(prompt=[], prompts_file=str(path))


def test_prompts_file_plain_lines_and_jsonl(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text('first\n\n{"prompt": "second"}\nthird é\n{"prompt": [5, 6]}\n', encoding="utf-8")
    assert _read_prompts(_args(path)) == ["first", "second", "third é", [5, 6]]


def test_prompts_file_dash_reads_stdin(monkeypatch):
    import io
    import sys
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'one\r\n{"prompt": [5, 6]}\n')))
    assert _read_prompts(_args("-")) == ["one", [5, 6]]


def test_prompts_file_with_a_byte_order_mark(tmp_path):
    """A UTF-8 BOM (Windows editors) is not part of line 1: the first JSONL object was run as the
    text prompt '\\ufeff{"prompt": ...}', and load-test's --dataset called line 1 'not valid JSON'."""
    from pcg_engine.bench.load_test_requests import read_dataset
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "first"}\n{"prompt": [5, 6]}\n')
    assert _read_prompts(_args(path)) == ["first", [5, 6]]
    assert read_dataset(str(path)) == [(1, "first", None), (2, [5, 6], None)]
    path.write_bytes(b"\xef\xbb\xbfplain\n")
    assert _read_prompts(_args(path)) == ["plain"]
    # Two such files joined by `cat`: the second mark starts a later line (found by a review: that
    # line's JSON ran as a text prompt at the flags' max_tokens).
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "max_tokens": 3}\n\xef\xbb\xbf{"prompt": "b", "max_tokens": 3}\n')
    assert _read_prompts(_args(path)) == ["a", "b"]
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n\xef\xbb\xbf{"prompt": "b", "output_len": 3}\n')
    assert read_dataset(str(path)) == [(1, "a", None), (2, "b", 3)]


def test_a_dataset_line_of_text_is_not_told_to_start_with_a_brace(tmp_path):
    """Found by a review: the hint about lines starting with '{' was given for any line that is not
    JSON, 'Hello world' in a load-test dataset (which takes JSON lines only) among them."""
    from pcg_engine.bench.load_test_requests import read_dataset
    path = tmp_path / "d.jsonl"
    path.write_text("Hello world\n")
    with pytest.raises(SystemExit) as e:
        read_dataset(str(path))
    assert "line 1 is not valid JSON" in str(e.value) and "starts with '{'" not in str(e.value)


@pytest.mark.parametrize("content, expected", [
    (b"ok\n{\"prompt\": \"x\"\n", "line 2 is not valid JSON"),
    # a text prompt that starts with "{": how to give it (session 31's probe)
    (b"{set} theory\n", "line 1 is not valid JSON (Expecting property name enclosed in double quotes): {set} "
                         "theory (a line that starts with '{' is read as a JSON object; give such a text prompt as "
                         "{\"prompt\": \"...\"})"),
    (b"{\"text\": \"x\"}\n", "line 1: JSONL line without a 'prompt' field"),
    (b"\xff\xfe bad\n", "is not UTF-8 text"),
    # the line, not just the byte offset; a byte-order mark counts in the offset
    (b"\xef\xbb\xbfok\r\nfine\n\nbad \xc3\n", "is not UTF-8 text: line 4: invalid continuation byte at byte 17"),
    (b"\n\n", "holds no prompt (every line is blank)"),     # (it said "give --prompt ... or --prompts-file")
    # a bare number joined its neighbours into one token-id prompt
    (b'{"prompt": 5}\n{"prompt": 6}\n', "line 1: 'prompt' must be a string or a non-empty list of token ids, got 5"),
    (b'{"prompt": []}\n', "line 1: 'prompt' must be a string"),
    (b'{"prompt": [5, "x"]}\n', "line 1: 'prompt' must be a string"),
    # past json's own limits: a RecursionError / ValueError traceback before
    (b'ok\n{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}\n", "line 2 is not valid JSON here (nested deeper"),
    (b'{"prompt": "x", "n": ' + b"9" * 5000 + b"}\n", "line 1 is not valid JSON here (Exceeds the limit"),
])
def test_prompts_file_bad_content_is_named(tmp_path, content, expected):
    path = tmp_path / "p.txt"
    path.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        _read_prompts(_args(path))
    assert expected in str(e.value) and "--prompts-file" in str(e.value)


@pytest.mark.parametrize("content", ["", "\n  \n\n", "\ufeff\n"])
def test_prompts_file_without_a_prompt_is_named(tmp_path, content):
    """Found by probing: an empty or blank file said "give --prompt (repeatable) or --prompts-file"
    to a command that had given --prompts-file."""
    path = tmp_path / "p.txt"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(SystemExit, match=f"^--prompts-file: {re.escape(str(path))} holds no prompt \\(every line "
                                         "is blank\\)"):
        _read_prompts(argparse.Namespace(prompt=[], prompts_file=str(path)))
    with pytest.raises(SystemExit, match=r"^give --prompt \(repeatable\) or --prompts-file$"):
        _read_prompts(argparse.Namespace(prompt=[], prompts_file=None))


def test_prompts_file_line_sampling_fields_are_read_and_output_len_is_refused(tmp_path):
    """{"prompt": "hi", "max_tokens": 3} once ran with --max-tokens' value, the line's dropped without
    a word; such a line is now the prompt's own parameter (test_cli_generate_flags.py runs it).
    Other fields (a dataset's "id") are ignored; a load-test dataset's output_len is refused."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "id": 7}\n{"prompt": "b", "max_tokens": 3, "logprobs": 2}\n')
    args = argparse.Namespace(prompt=["c"], prompts_file=str(path), max_tokens=32)
    overrides = []
    assert _read_prompts(args, overrides=overrides) == ["c", "a", "b"]
    assert overrides == [None, None, {"max_tokens": 3, "logprobs": 2}]
    path.write_text('{"prompt": "b", "output_len": 2}\n')
    with pytest.raises(SystemExit, match=r"line 1: 'output_len' \(a load-test dataset's output length\) is not read "
                                         r"from a prompt line; give the line \"max_tokens\" \(or --max-tokens for "
                                         r"all\)$"):
        _read_prompts(args)


def test_prompts_file_prompt_token_ids_and_nulls(tmp_path):
    """Found by probing (session 41): a line's "prompt_token_ids" beside "prompt" was ignored as an
    unknown key (the line ran its text alone), and alone it was "a line without a 'prompt' field";
    "max_tokens": null was refused as "got None" where it can only mean the flag's value."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt_token_ids": [5, 6]}\n{"prompt": "b", "max_tokens": null, "seed": null}\n')
    args = argparse.Namespace(prompt=[], prompts_file=str(path))
    overrides = []
    assert _read_prompts(args, overrides=overrides) == [[5, 6], "b"]
    assert overrides == [None, None]          # null: the flag's value, for every field (seed's --seed too)
    path.write_text('{"prompt": null, "prompt_token_ids": [7], "stop": null}\n')
    assert _read_prompts(args) == [[7]]
    path.write_text('{"prompt": "x", "token_ids": [1]}\n')
    with pytest.raises(SystemExit, match=r"line 1: 'token_ids' is not read from a prompt line; give token ids as "
                                         r"'prompt' or 'prompt_token_ids'$"):
        _read_prompts(args)
    path.write_text('{"prompt": "hi", "prompt_token_ids": [1, 2]}\n')
    with pytest.raises(SystemExit, match=r"line 1: give either 'prompt' or 'prompt_token_ids', not both$"):
        _read_prompts(args)
    path.write_text('{"prompt_token_ids": "hi"}\n')
    with pytest.raises(SystemExit, match=r"line 1: 'prompt_token_ids' must be a non-empty list of token ids, "
                                         r"got \"hi\"$"):
        _read_prompts(args)


@pytest.mark.parametrize("key, meant", [
    ("temprature", "temperature"), ("stop_token_id", "stop_token_ids"), ("max-tokens", "max_tokens"),
    ("maxTokens", "max_tokens"), ("max_new_tokens", "max_tokens"), ("Seed", "seed"), ("logprob", "logprobs"),
    ("top_logprobs", "logprobs"),
])
def test_prompts_file_misspelt_sampling_field_is_refused(tmp_path, key, meant):
    """Found by fuzzing: a line's keys other than the sampling fields are ignored (a dataset's "id"),
    so {"prompt": "a", "temprature": 0.9} ran greedy, at the flags' temperature, without a word; a
    key that reads as a misspelt field is refused, naming the line, the key and the field."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok", "id": 3, "label": "x", "source": "web"}\n'
                    + json.dumps({"prompt": "a", key: 1}) + "\n")
    with pytest.raises(SystemExit, match=f"^--prompts-file: line 2: {key!r} is not a sampling field; did you mean "
                                         f"{meant!r}\\? \\(allowed: max_tokens, temperature, "):
        _read_prompts(_args(path))
    path.write_text('{"prompt": "ok", "id": 3, "label": "x", "source": "web", "tokens": 5}\n')
    assert _read_prompts(_args(path)) == ["ok"]      # other keys still pass
    # (a review: one edit from the 4-letter "stop" and "seed" refused ordinary keys that ran before)
    path.write_text('{"prompt": "ok", "step": 1, "shop": 2, "seen": 3, "need": 4, "speed": 5, "top": 6}\n')
    assert _read_prompts(_args(path)) == ["ok"]


@pytest.mark.parametrize("key", ["sampling_params", "params", "options"])
def test_prompts_file_nested_sampling_fields_are_refused(tmp_path, key):
    """Found by a review: {"prompt": "hi", "sampling_params": {"max_tokens": 2}} (a request body's
    shape in other APIs) ran at --max-tokens' value without a word: the object was an ignored key."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok", "meta": {"source": "web"}}\n'
                    + json.dumps({"prompt": "a", key: {"max_tokens": 2, "seed": 1, "other": 3}}) + "\n")
    with pytest.raises(SystemExit) as e:
        _read_prompts(_args(path))
    assert str(e.value) == (f"--prompts-file: line 2: {key!r} holds sampling fields (max_tokens, seed); give them "
                            "at the top level of the line, beside 'prompt'")


@pytest.mark.parametrize("key, why", [
    ("best_of", "add the prompt again with another seed"), ("logit_bias", "not implemented"),
    # found by a review: these ran without a word (a banned word sampled first)
    ("bad_words", "not implemented"), ("allowed_token_ids", "not implemented"),
    ("chat_template_kwargs", "not implemented \\(--chat renders"),
    ("do_sample", "give temperature instead \\(0: greedy\\)"), ("prompt_logprobs", "not implemented"),
    ("include_stop_str_in_output", "not implemented"),
])
def test_prompts_file_other_engines_sampling_option_is_refused(tmp_path, key, why):
    """Found by probing: vLLM's / OpenAI's / transformers' sampling keys on a line (best_of,
    logit_bias, do_sample, ...) were ignored as unknown keys: the prompt ran without them, exit 0."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n' + json.dumps({"prompt": "a", key: 1}) + "\n")
    with pytest.raises(SystemExit, match=f"^--prompts-file: line 2: {key!r} is another engine's sampling option "
                                         f"that pcg-engine does not take: {why}"):
        _read_prompts(_args(path))


@pytest.mark.parametrize("line, key", [
    ('{"prompt": "a", "max_tokens": 3, "max_tokens": 500}', "max_tokens"),
    ('{"prompt": "a", "prompt": "b"}', "prompt"),
    ('{"prompt": "a", "stop": ["x"], "stop": null}', "stop"),
])
def test_prompts_file_key_given_twice_is_refused(tmp_path, line, key):
    """Found by fuzzing: json.loads keeps a repeated key's last value, so a line giving max_tokens
    (or its prompt) twice ran one of them without a word about the other. Refused naming the line
    and the key, as checkpoint JSON files are (models/json_file.py); --dataset reads lines alike."""
    from pcg_engine.bench.load_test_requests import read_dataset
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    expected = f"line 2: key {key!r} is given twice in one object; which value is meant cannot be told"
    with pytest.raises(SystemExit, match=f"^--prompts-file: {re.escape(expected)}$"):
        _read_prompts(_args(path))
    with pytest.raises(SystemExit, match=f"^--dataset: {re.escape(expected)}$"):
        read_dataset(str(path))


@pytest.mark.parametrize("name", ["missing.txt", "."])
def test_prompts_file_unreadable_is_named(tmp_path, name):
    with pytest.raises(SystemExit, match="--prompts-file: cannot read"):
        _read_prompts(_args(tmp_path / name))


def test_calls_after_close_name_the_closed_engine(tiny_paths):
    """generate, stream, add_request, step and reset_prefix_cache on a closed engine raise EngineClosedError (was an
    AttributeError from inside the step, after the request had been queued); close twice is fine."""
    from engine_helpers import make_llm
    from pcg_engine.errors import EngineClosedError
    llm = make_llm(tiny_paths["tiny-qwen3"])
    assert [len(o.token_ids) for o in llm.generate([[5, 6, 7]], {"max_tokens": 2})] == [2]
    llm.close()
    llm.close()
    with pytest.raises(EngineClosedError, match="add_request: the engine is closed"):
        llm.generate([[5, 6, 7]], {"max_tokens": 2})
    with pytest.raises(EngineClosedError):
        list(llm.stream([5, 6, 7], {"max_tokens": 2}))
    with pytest.raises(EngineClosedError, match="step: the engine is closed"):
        llm.engine.step()
    with pytest.raises(EngineClosedError, match="reset_prefix_cache: the engine is closed"):
        llm.reset_prefix_cache()
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()



@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_stream_and_an_abort_after_close_name_the_closed_engine(tiny_paths, async_scheduling):
    """A stream started before close() and resumed after it raised a RuntimeError saying another
    caller of engine.step() had taken its final output; abort_request said the request was not one
    of the engine's. Both now raise EngineClosedError."""
    from engine_helpers import make_llm
    from pcg_engine.errors import EngineClosedError
    llm = make_llm(tiny_paths["tiny-qwen3"], async_scheduling=async_scheduling)
    params = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    rid = llm.engine.add_request([5, 6, 7], params)
    llm.engine.step()
    stream = llm.stream([8, 9, 10], params)
    next(stream)
    llm.close()
    with pytest.raises(EngineClosedError, match="stream: the engine is closed"):
        next(stream)
    with pytest.raises(EngineClosedError, match="abort_request: the engine is closed"):
        llm.engine.abort_request(rid)
    stream.close()


def test_close_in_a_generate_callback_names_the_closed_engine(tiny_paths):
    """The callback closing the engine: generate raises EngineClosedError, not that another caller
    of engine.step() took its outputs."""
    from engine_helpers import make_llm
    from pcg_engine.errors import EngineClosedError
    llm = make_llm(tiny_paths["tiny-qwen3"])
    with pytest.raises(EngineClosedError, match="step: the engine is closed"):
        llm.generate([[5, 6, 7], [8, 9]], {"max_tokens": 4}, on_output=lambda out: llm.close())

def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    from pcg_engine import cli

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "cmd_generate", interrupted)
    assert cli.main(["generate", "--prompt", "hi"]) == 130
    assert capsys.readouterr().err.strip() == "pcg: interrupted"


def test_generate_error_is_one_line_with_brackets_kept(tmp_path, capsys):
    """An error that quotes user text with [brackets] prints it as is (not as rich markup), on one
    line however narrow the terminal."""
    from pcg_engine import cli
    missing = tmp_path / ("deep" * 20) / "model[bold]x"
    assert cli.main(["generate", "--model", str(missing), "--prompt", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --model: {missing}: checkpoint directory does not exist"


def test_chat_with_token_id_prompts_is_one_line(tiny_paths, tmp_path, capsys):
    """--chat applies a text template: a token-id prompt from a JSONL file is named, not a jinja
    TypeError."""
    from pcg_engine import cli
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n\n{"prompt": [5, 6, 7]}\n')      # (named "prompt 1", counting from 0)
    assert cli.main(["generate", "--model", str(tiny_paths["tiny-qwen3"]), "--device", "cpu", "--chat",
                     "--prompts-file", str(path), "--max-tokens", "2"]) == 2
    assert capsys.readouterr().err.strip().endswith("error: --chat: --prompts-file: line 3: the prompt is token "
                                                   "ids; the chat template needs text prompts")


@pytest.mark.parametrize("lines, flags, expected", [
    # named the --prompt flag, for a prompt from the file
    ('\n\n{"prompt": ""}\n', ["--prompt", "hi"],
     "--prompts-file: line 3: prompt: is empty; give at least one character or token (none of them was run)"),
    # "--prompt #1: ... (prompt 0 of 2; ...)": one prompt, two numbers
    (None, ["--prompt", "hi", "--prompt", "there", "--max-tokens", "64"],
     "--prompt #1: --max-tokens (max_tokens): prompt has 1 tokens and max_tokens is 64, beyond max_model_len 64; "
     "max_tokens allowed: 1..63 (or set --truncate-prompt-tokens to shorten the prompt) (none of them was run)"),
    # said "prompt 1 of 2" only: the file's line had to be counted out (blank lines left out)
    ('ok\n\n{"prompt": [5, 99999]}\n', [],
     "--prompts-file: line 3: token 99999 at position 1 is outside the vocabulary"),
    ('{"prompt": [5, 99999]}\n', ["--stream"],
     "--prompts-file: line 1: token 99999 at position 1 is outside the vocabulary"),
    ('ok\n{"prompt": ' + str([5] * 60) + '}\n', ["--max-tokens", "10"],
     "--prompts-file: line 2: --max-tokens (max_tokens): prompt has 60 tokens and max_tokens is 10, beyond "
     "max_model_len 64; max_tokens allowed: 1..4"),
    (None, ["--prompt", "hi", "--prompt", ""], "--prompt #2: prompt: is empty"),
    (None, ["--prompt", ""], "--prompt (prompt): is empty"),       # the only prompt: the flag says it
], ids=["empty-line-prompt", "first-prompt-flag", "ids-outside-vocab", "stream", "too-long", "second-prompt-flag",
        "only-prompt"])
def test_refused_prompt_names_its_file_line(tiny_paths, tmp_path, capsys, lines, flags, expected):
    from pcg_engine import cli
    if lines is not None:
        (tmp_path / "p.jsonl").write_text(lines)
        flags = ["--prompts-file", str(tmp_path / "p.jsonl"), *flags]
    assert cli.main(["generate", "--model", str(tiny_paths["tiny-qwen3"]), "--device", "cpu",
                     "--max-model-len", "64", "--max-tokens", "2", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {expected}"), err[-1]


def test_truncate_prompt_tokens_flag_runs_a_prompt_the_context_refused(tiny_paths, capsys):
    """The refusal of a too-long prompt says "or set truncate_prompt_tokens", which generate had no
    flag for; --truncate-prompt-tokens keeps the prompt's last N tokens, and a bad N is named."""
    import json
    from pcg_engine import cli
    base = ["generate", "--model", str(tiny_paths["tiny-qwen3"]), "--device", "cpu", "--max-model-len", "64",
            "--max-tokens", "4", "--ignore-eos", "--json", "--prompt", " ".join(["hello"] * 80)]
    assert cli.main(base) == 2
    assert "or set --truncate-prompt-tokens" in capsys.readouterr().err
    assert cli.main([*base, "--truncate-prompt-tokens", "20"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 4
    assert cli.main([*base, "--truncate-prompt-tokens", "0"]) == 2
    assert "--truncate-prompt-tokens (truncate_prompt_tokens):" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_stream_refuses_a_bad_prompt_before_running_any(tiny_paths, capsys, monkeypatch, extra):
    """Found by probing: --stream ran the prompts before a bad one (under --json their outputs were
    never printed), then exited 2; generate() refuses the batch before running any of it."""
    from pcg_engine import cli
    from pcg_engine.llm import LLM
    engines = []
    real_init = LLM.__init__

    def keep(self, *a, **k):
        real_init(self, *a, **k)
        engines.append(self.engine)
    monkeypatch.setattr(LLM, "__init__", keep)
    assert cli.main(["generate", "--model", str(tiny_paths["tiny-qwen3"]), "--device", "cpu", "--max-model-len", "64",
                     "--max-tokens", "2", "--stream", "--prompt", "hi", "--prompt", "there", "--prompt", "",
                     *extra]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.strip().splitlines()[-1] == (
        "error: --prompt #3: prompt: is empty; give at least one character or token (none of them was run)")
    engine, = engines
    assert engine.stats.steps == 0 and not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.num_used_blocks == 0
    # good prompts stream as before
    assert cli.main(["generate", "--model", str(tiny_paths["tiny-qwen3"]), "--device", "cpu", "--max-model-len", "64",
                     "--max-tokens", "2", "--stream", "--prompt", "hi", "--prompt", "there", *extra]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len([line for line in lines if '"delta"' not in line]) == 2 and engines[1].stats.steps > 0   # --json: and deltas


def _with_chat_template(src, dst, template):
    """dst: checkpoint src (files linked) whose tokenizer's chat template is `template` (None: none)."""
    import os
    for f in src.iterdir():
        if f.name == "tokenizer_config.json":
            config = json.loads(f.read_text())
            config.pop("chat_template", None)
            if template is not None:
                config["chat_template"] = template
            (dst / f.name).write_text(json.dumps(config))
        elif f.name != "chat_template.jinja":
            os.symlink(f, dst / f.name)
    return dst


def _chat_error(path, capsys) -> str:
    from pcg_engine import cli
    assert cli.main(["generate", "--model", str(path), "--device", "cpu", "--chat", "--prompt", "hi",
                     "--max-tokens", "2"]) == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_chat_without_a_chat_template_names_the_flag(tiny_paths, tmp_path, capsys):
    """Before: transformers' 'Cannot use chat template functions because tokenizer.chat_template is
    not set...', naming neither --chat nor the checkpoint."""
    path = _with_chat_template(tiny_paths["tiny-qwen3"], tmp_path, None)
    assert _chat_error(path, capsys) == (
        f"error: --chat: the tokenizer of {tmp_path} has no chat template (chat_template.jinja, or "
        "chat_template in tokenizer_config.json); leave out --chat to send the prompts as they are")


def test_chat_on_a_checkpoint_without_a_tokenizer_names_the_flag(tiny_paths, tmp_path, capsys):
    """Found by probing: it said "... has no tokenizer (...): give prompts as token ids", naming
    neither --chat nor a way out (--chat refuses token ids)."""
    import shutil
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_paths["tiny-qwen3"] / name, tmp_path / name)
    line = _chat_error(tmp_path, capsys)
    assert line.startswith(f"error: --chat: the checkpoint {tmp_path} has no tokenizer (") and \
        line.endswith(", so no chat template; leave out --chat and give the prompts as token ids"), line


def test_stop_without_a_tokenizer_names_the_stop_token_flag(tiny_paths, tmp_path, capsys):
    """Found by probing: `--stop x` on a checkpoint without a tokenizer said "use stop_token_ids"."""
    import shutil
    from pcg_engine import cli
    ckpt = tmp_path / "bare"
    ckpt.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_paths["tiny-qwen3"] / name, ckpt / name)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [5, 6, 7]}\n')
    assert cli.main(["generate", "--model", str(ckpt), "--device", "cpu", "--prompts-file", str(prompts),
                     "--stop", "x", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --prompts-file: line 1: --stop (stop): ") and err.endswith("; use --stop-token-id"), err


@pytest.mark.parametrize("template, error", [
    ("{{ raise_exception('only system and user roles') }}", "TemplateError: only system and user roles"),
    ("{% if %}", "TemplateSyntaxError: "),
])
def test_chat_template_that_fails_names_the_flag(tiny_paths, tmp_path, capsys, template, error):
    """Found by probing: a checkpoint's chat template that refuses the messages (raise_exception, as
    real templates do) or does not parse ended `pcg generate --chat` in a jinja2 traceback, exit 1."""
    path = _with_chat_template(tiny_paths["tiny-qwen3"], tmp_path, template)
    line = _chat_error(path, capsys)
    assert line.startswith(f"error: --chat: --prompt: the chat template of {tmp_path} failed: {error}"), line


def test_chat_template_that_makes_empty_text_names_the_template(tiny_paths, tmp_path, capsys):
    """Found by a review: a template that rendered "" was refused as "--prompt (prompt): is empty",
    blaming the prompt the user gave."""
    path = _with_chat_template(tiny_paths["tiny-qwen3"], tmp_path, '{{ "" }}')
    line = _chat_error(path, capsys)
    assert line == (f"error: --chat: --prompt: the chat template of {tmp_path} made empty text of the conversation; "
                    "leave out --chat to send the prompts as they are"), line


def test_cli_refusals_raised_as_system_exit_are_one_error_line(tmp_path, capsys):
    """--prompts-file problems (and the other SystemExit("...") refusals) exit 2 with 'error:', like
    argparse's and the engine's (they exited 1 with the bare message)."""
    from pcg_engine import cli
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": 5}\n')
    assert cli.main(["generate", "--device", "cpu", "--prompts-file", str(path)]) == 2
    assert capsys.readouterr().err.strip() == ("error: --prompts-file: line 1: 'prompt' must be a string or a "
                                               "non-empty list of token ids, got 5")
    assert cli.main(["generate", "--device", "cpu", "--prompts-file", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: --prompts-file: cannot read")
    with pytest.raises(SystemExit) as e:          # argparse's own exit is untouched
        cli.main(["generate", "--max-tokens", "many"])
    assert e.value.code == 2


@pytest.mark.parametrize("flags, expected", [
    (["--max-num-seqs", "0"], "error: --max-num-seqs (max_num_seqs): got 0; allowed: 1..4096"),
    (["--max-num-seqs=0"], "error: --max-num-seqs (max_num_seqs): got 0"),
    (["--max-num-batched-tokens", "1000000000"],
     "error: --max-num-batched-tokens (max_num_batched_tokens): got 1000000000; allowed: 1..262144"),
    # refused before an engine is built, naming the flags (common.refuse_too_long)
    (["--input-len", "250", "--output-len", "10", "--max-model-len", "256"],
     "error: --input-len / --output-len: the longest request is 250 prompt + 10 output tokens, more than "
     "max_model_len 256"),
])
def test_bench_refused_setting_is_one_line(capsys, flags, expected):
    """pcg bench: a setting the engine refuses is one line and exit 2 (it was a traceback, exit 1)."""
    from pcg_engine import cli
    assert cli.main(["bench", "latency", "--device", "cpu", "--model", "tiny-qwen3", "--modes", "eager",
                     "--num-iters", "1", "--warmup-iters", "0", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()       # after the bench's own progress lines
    assert err[-1].startswith(expected) and not any("Traceback" in line for line in err)


@pytest.mark.parametrize("bench", [["latency", "--device", "cpu", "--model", "tiny-qwen3"], ["kernels"]])
@pytest.mark.parametrize("where, expected", [("dir", "is a directory"), ("under-file", "is a file, not a directory"),
                                             ("empty", "an empty path; give a file path"),
                                             ("dash", "'-' is not standard output here"),
                                             # found by probing (session 41): replaced by a plain file, or a
                                             # dangling one's target created; a FIFO hung the parse
                                             ("link", "is a symbolic link (to "), ("fifo", "is not a regular file")])
def test_bench_json_path_refused_before_running(tmp_path, capsys, where, expected, bench):
    """--json naming a directory, or a path under a file, is refused at once (it failed after the
    whole benchmark had run, with a traceback and no results; kernels' with an IsADirectoryError
    traceback, even on a CPU). An empty path was called "a directory"."""
    from pcg_engine import cli
    (tmp_path / "afile").write_text("x")
    import os
    os.symlink(tmp_path / "missing.json", tmp_path / "link.json")
    os.mkfifo(tmp_path / "fifo")
    path = {"dir": str(tmp_path), "under-file": str(tmp_path / "afile" / "out.json"), "empty": "", "dash": "-",
            "link": str(tmp_path / "link.json"), "fifo": str(tmp_path / "fifo")}[where]
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *bench, "--json", path])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--json" in err and expected in err and "building the engine" not in err
    assert not (tmp_path / "missing.json").exists() and os.path.islink(tmp_path / "link.json")


def test_bench_json_in_a_directory_it_cannot_write_is_refused(tmp_path, monkeypatch):
    """Found by probing (session 41): a writable file in a read-only directory passed, and the
    results were lost after the whole run (they are written beside the file, then moved over it)."""
    import os
    from pcg_engine.bench import common
    target = tmp_path / "out.json"
    target.write_text("{}")
    real_access = os.access
    monkeypatch.setattr(common.os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real_access(p, mode))
    with pytest.raises(argparse.ArgumentTypeError, match="its directory .* is not writable"):
        common.json_path(str(target))


@pytest.mark.parametrize("flags, expected", [
    (["--max-tokens", "0"], "error: --max-tokens (max_tokens): must be an integer >= 1, got 0"),
    (["--top-p", "2"], "error: --top-p (top_p): must be a finite number in (0, 1], got 2.0"),
    (["--max-num-seqs", "0"], "error: --max-num-seqs (max_num_seqs): got 0; allowed: 1..4096"),
])
def test_generate_errors_name_the_flag(capsys, flags, expected):
    """pcg generate: an engine error names the flag the user typed, with the field it sets."""
    from pcg_engine import cli
    assert cli.main(["generate", "--device", "cpu", "--prompt", "hi", *flags]) == 2
    assert capsys.readouterr().err.strip() == expected


@pytest.mark.parametrize("argv, expected", [
    # a ValueError traceback from int() (and a size of 0 taken), before
    (["overhead", "--host-only", "--batch-sizes", "16,abc"], "--batch-sizes: must be an integer in 1..4096, got 'abc'"),
    (["overhead", "--host-only", "--batch-sizes", "0"], "--batch-sizes: must be an integer in 1..4096, got 0"),
    # a FileExistsError traceback from makedirs, before
    (["profile", "--out-dir", "{afile}"], "--out-dir: '{afile}': {afile} is a file, not a directory"),
    (["startup", "--profile-dir", "{afile}/x"], "--profile-dir: '{afile}/x': {afile} is a file, not a directory"),
    # a traceback after the whole host-only run, before
    (["overhead", "--host-only", "--host-profile", "{afile}/x"], "--host-profile: '{afile}/x': {afile} is a file, "
     "not a directory"),
    # ignored without a word outside the host-only run, before
    (["overhead", "--batch-sizes", "16"], "error: --batch-sizes: only with --host-only, the run that reads it"),
    (["overhead", "--host-profile", "p.prof"], "error: --host-profile: only with --host-only"),
    # the table run's flags with --host-only: ignored and recorded in the JSON as used, before
    (["overhead", "--host-only", "--slots", "8"], "error: --slots: not with --host-only, which does not read it"),
    (["overhead", "--host-only", "--configs", "bogus"], "error: --configs: not with --host-only"),
    (["overhead", "--host-only", "--cpu-compile"], "error: --cpu-compile: not with --host-only"),
    (["overhead", "--host-only", "--requests", "4"], "error: --requests: not with --host-only"),
    (["overhead", "--host-only", "--new-tokens", "4"], "error: --new-tokens: not with --host-only"),
    # a matplotlib traceback after running nothing, and one trace file written twice, before
    (["profile", "--configs", ","], "error: --configs: ',' names no config; known: eager,"),
    (["profile", "--configs", "eager, eager"], "error: --configs: 'eager, eager' names a config twice"),
    # "max_num_seqs: got 5000", a name the command line does not have, before
    (["overhead", "--slots", "5000"], "argument --slots: must be an integer in 1..4096, got 5000"),
    (["overhead", "--host-only", "--batch-sizes", "16,5000"], "argument --batch-sizes: must be an integer in "
     "1..4096, got 5000"),
    (["profile", "--requests", "5000"], "argument --requests: must be an integer in 1..4096, got 5000"),
    (["load-test", "--sweep-start", "2"], "error: --sweep-start: only with --sweep-rates"),
    (["startup", "--warm-repeats", "3"], "error: --warm-repeats: only with --warm-ab"),
    # a traceback after the whole run, before
    (["latency", "--json", "/proc/pcg_probe.json"], "--json: '/proc/pcg_probe.json' cannot be written"),
    # the last suffix won without a word, before
    (["latency", "--modes", "eager+sync+async"], "--modes: 'eager+sync+async' repeats a suffix or gives both"),
    (["latency", "--modes", "eager+async+async"], "--modes: 'eager+async+async' repeats a suffix"),
    # the requests ran in turns under the title "batch 3", before
    (["latency", "--batch-size", "3", "--max-num-seqs", "1"], "error: --batch-size: 3 requests at once, but "
     "--max-num-seqs 1 runs at most that many"),
    # the same with max_num_seqs left at its default (found by a review: 300 ran as "batch 300")
    (["latency", "--batch-size", "300"], "error: --batch-size: 300 requests at once, but --max-num-seqs 256 "
     "(the default) runs at most that many"),
    # "must be a number > 0, got inf", before
    (["load-test", "--burstiness", "inf"], "--burstiness must be a finite number > 0, got inf"),
    # the known configs in a new order each run, before
    (["overhead", "--configs", "foo"], "error: --configs: unknown ['foo']; known: eager, fused, fused + async, "
     "full graphs, full graphs + async, piecewise, piecewise + async"),
    # the child process's ConfigError traceback, before
    (["startup", "--mode", "piecwise"], "--mode: invalid choice: 'piecwise'"),
    # bench load: torch's AttributeError / RuntimeError tracebacks, before
    (["load", "--dtype", "bogus"], "error: --dtype (dtype): got 'bogus'; allowed: auto, bfloat16, float16, float32 (or bf16, fp16, fp32)"),
    (["load", "--device", "tpu"], "error: --device (device): got 'tpu'; allowed: auto, cpu, cuda or cuda:N"),
    # --input-min was dropped without a word, before
    (["throughput", "--input-len", "5", "--input-min", "7"],
     "error: pcg bench throughput: --input-len replaces --input-min/--input-max; give one or the other, "
     "not --input-len with --input-min"),
])
def test_bench_flags_refused_before_running(tmp_path, capsys, argv, expected):
    from pcg_engine import cli
    afile = tmp_path / "afile"
    afile.write_text("x")
    argv = [a.format(afile=afile) for a in argv]
    try:
        device = [] if "--device" in argv else ["--device", "cpu"]
        code = cli.main(["bench", *argv, *device, "--model", "tiny-qwen3"])
    except SystemExit as e:          # argparse's own refusal
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and expected.format(afile=afile) in err, err
    assert "Traceback" not in err and "building the engine" not in err


@pytest.mark.parametrize("where", ["missing", "a file"])
def test_generate_names_model_for_a_path_that_is_no_checkpoint(tmp_path, capsys, where):
    """It said "error: /x: checkpoint directory does not exist", naming no flag, after an empty line
    (the spinner's stop, on a stderr that is not a terminal)."""
    from pcg_engine import cli
    path = tmp_path / "x"
    if where == "a file":
        path.write_text("x")
    assert cli.main(["generate", "--device", "cpu", "--model", str(path), "--prompt", "hi"]) == 2
    reason = "checkpoint directory does not exist" if where == "missing" else "a file, not a checkpoint directory"
    err = capsys.readouterr().err
    assert err.startswith(f"error: --model: {path}: {reason}") and err.count("\n") == 1, err


@pytest.mark.parametrize("flags, start, end", [
    (["--prompt", "hello world " * 40], "error: --prompt: prompt has ", "(or set --truncate-prompt-tokens to shorten the "
     "prompt)\n"),
    (["--prompt", "hi", "--max-tokens", "100"], "error: --max-tokens (max_tokens): prompt has ",
     "(or set --truncate-prompt-tokens to shorten the prompt)\n"),
])
def test_generate_names_flags_not_api_fields_for_a_long_prompt(capsys, flags, start, end):
    """Found by probing: "error: prompt_token_ids: prompt has 701 tokens ... (or set
    truncate_prompt_tokens ...)": the API's names, for a prompt given by --prompt and a remedy
    that is a flag."""
    from pcg_engine import cli
    assert cli.main(["generate", "--device", "cpu", "--max-model-len", "64", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(start) and err.endswith(end) and "prompt_token_ids" not in err, err


@pytest.mark.parametrize("flags, line", [
    (["--max-model-len", "1"], "error: --max-model-len (max_model_len): got 1; allowed: an int >= 2\n"),
    (["--num-kv-blocks", "0"], "error: --num-kv-blocks (num_kv_blocks): got 0; allowed: an int >= 2\n"),
    (["--logprobs", "21"], "error: --logprobs (logprobs): must be an integer in [0, 20], got 21\n"),
    (["--truncate-prompt-tokens", "0"],
     "error: --truncate-prompt-tokens (truncate_prompt_tokens): must be an integer >= 1, got 0\n"),
    (["--mode", "full_decode"], "error: --mode (mode): 'full_decode' replays whole-step CUDA graphs and needs a "
     "graph-safe attention backend; 'torch' is not; allowed with it: eager, compile, piecewise (or "
     "--attention-backend triton, which on the CPU needs TRITON_INTERPRET=1)\n"),
])
def test_flag_error_offers_no_none(capsys, flags, line):
    """Found by probing: "allowed: None or an int >= 2": None is the API's value for "the engine
    decides"; on the command line that is leaving the flag out."""
    from pcg_engine import cli
    assert cli.main(["generate", "--device", "cpu", "--prompt", "hi", *flags]) == 2
    assert capsys.readouterr().err == line


def test_bench_without_a_name_lists_the_benchmarks(capsys):
    """It said "the following arguments are required: name, rest" (the parser's variable names)."""
    from pcg_engine import cli
    assert cli.main(["bench"]) == 2
    assert capsys.readouterr().err == ("error: pcg bench: name a benchmark: latency, throughput, load-test, overhead, "
                                       "profile, kernels, load, startup (`pcg bench NAME --help` for its flags)\n")


def test_generate_names_mode_for_a_full_graph_mode_on_the_torch_backend(capsys):
    from pcg_engine import cli
    assert cli.main(["generate", "--device", "cpu", "--prompt", "hi", "--mode", "full_decode"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --mode (mode): 'full_decode' replays whole-step")


@pytest.mark.parametrize("argv, expected", [
    (["--prompt", "caf\udce9"], "error: --prompt: not UTF-8 text: an undecodable byte at character 4 of "
                                 "caf\\udce9; give the text in UTF-8"),
    (["--prompt", "hi", "--stop", "\udcff"], "error: --stop: not UTF-8 text: an undecodable byte at character 1"),
    (["--model", "", "--prompt", "hi"], "error: --model: got ''; allowed: a checkpoint directory, or leave out "
                                        "--model for the bundled tiny model"),
])
def test_command_line_text_that_cannot_be_used_is_named(argv, expected, capsys):
    """Found by probing (session 31): a Latin-1 byte in --prompt or --stop (kept by Python as a lone
    surrogate) failed in the tokenizer as "surrogates not allowed at character N"; --model "" read
    the working directory ("--model: config.json: missing")."""
    from pcg_engine import cli
    assert cli.main(["generate", "--device", "cpu", *argv]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(expected)


def test_chat_json_shows_the_prompt_as_given(tiny_paths, capsys):
    """Found by probing (session 31): under --chat, --json's "prompt" was the template's output
    ("<|im_start|>user\\nhi..."), not what the user typed; that is now "chat_prompt" beside it."""
    from pcg_engine import cli
    assert cli.main(["generate", "--model", str(tiny_paths["tiny-qwen3"]), "--device", "cpu", "--chat", "--json",
                     "--prompt", "hi", "--max-tokens", "2"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["prompt"] == "hi"
    assert "hi" in row["chat_prompt"] and row["chat_prompt"] != "hi"


def test_start_spinner_names_only_what_the_start_does():
    """Found by probing (session 31): the spinner said "capturing graphs" in every mode but eager,
    also in compile and on the CPU (--mode auto runs eager there), where nothing is captured."""
    from pcg_engine.cli import _start_words
    assert _start_words(dict(device="cpu", mode="auto")) == ""
    assert _start_words(dict(device="cpu", mode="eager")) == ""
    assert _start_words(dict(device="cpu", mode="compile")) == " and compiling"
    assert _start_words(dict(device="cpu", mode="piecewise")) == " and compiling"
    assert _start_words(dict(device="cpu", mode="no such mode")) == ""
