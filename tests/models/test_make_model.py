"""The checkpoint maker writes directories that transformers itself loads, offline, unchanged."""

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pcg_engine.errors import ConfigError
from pcg_engine.models import checkpoint_maker as cm
from pcg_engine.models import presets, tokenizer_maker

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

TINY = ("tiny-qwen3", "tiny-qwen3-moe")
TEXT = "Héllo wörld, naïve café — 你好，世界 🙂🚀👩‍💻 def f(x): return x ** 2\n"


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return {p: cm.make_checkpoint(p, tmp_path_factory.mktemp(p)) for p in TINY}


def read_tensors(path):
    files = sorted(path.glob("*.safetensors"))
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                assert k not in out, f"{k} stored twice"
                out[k] = sf.get_tensor(k)
    return out


def test_tokenizer_loads_offline_and_round_trips(tiny_dirs):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dirs["tiny-qwen3"])
    ids = tokenizer_maker.special_token_ids()
    assert len(tok) == presets.TINY_VOCAB
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == ids["eos_token_id"] == 2
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == ids["pad_token_id"] == 0
    assert tok.convert_tokens_to_ids("<|im_start|>") == ids["im_start_token_id"] == 1
    enc = tok.encode(TEXT)
    assert tok.decode(enc) == TEXT
    assert max(enc) < presets.TINY_VOCAB
    # Specials are single tokens, never split into bytes.
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 2


def test_chat_template_renders_qwen_style(tiny_dirs):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dirs["tiny-qwen3"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 你好"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nhéllo 你好<|im_end|>\n<|im_start|>assistant\n")
    assert not tok.apply_chat_template(messages, tokenize=False).endswith("assistant\n")


@pytest.mark.parametrize("preset", TINY)
def test_transformers_loads_with_no_missing_or_unexpected_keys(tiny_dirs, preset):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs[preset], output_loading_info=True)
    assert type(model).__name__ == presets.get_preset(preset).fields["architectures"][0]
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    specs = cm.tensor_specs(presets.get_preset(preset).fields)
    stored = read_tensors(tiny_dirs[preset])
    assert [n for n, _, _ in specs] == list(dict.fromkeys(n for n, _, _ in specs))
    assert {n: tuple(s) for n, s, _ in specs} == {k: tuple(v.shape) for k, v in stored.items()}
    assert all(v.dtype == torch.float32 for v in stored.values())
    assert ("lm_head.weight" in stored) == (preset == "tiny-qwen3-moe")  # only the dense one is tied


@pytest.mark.parametrize("preset", TINY)
def test_tiny_models_generate_varied_peaked_greedy_text(tiny_dirs, preset):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs[preset])
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dirs[preset])
    prompt = tok("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    out = model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    new = out.sequences[0, prompt.shape[1]:]
    assert len(set(new.tolist())) >= 10, new.tolist()
    probs = torch.cat(out.logits).softmax(-1)
    assert probs.max(-1).values.median() > 0.5  # peaked: greedy has a clear winner most steps


def test_generation_config_matches_tokenizer(tiny_dirs):
    d = tiny_dirs["tiny-qwen3"]
    gen = json.loads((d / "generation_config.json").read_text())
    cfg = json.loads((d / "config.json").read_text())
    assert gen["eos_token_id"] == [2, 0] and gen["pad_token_id"] == 0 and gen["bos_token_id"] == 0
    assert cfg["eos_token_id"] == 2 and cfg["vocab_size"] == presets.TINY_VOCAB
    # Published spellings next to transformers 5's, for readers of raw config.json.
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 1e6
    assert cfg["torch_dtype"] == "float32"


def test_same_seed_same_bytes_other_seed_differs(tiny_dirs, tmp_path):
    parser = cm.add_arguments(__import__("argparse").ArgumentParser())
    again = cm.run(parser.parse_args(["--preset", "tiny-qwen3", "--out", str(tmp_path / "a")]))
    first = tiny_dirs["tiny-qwen3"]
    assert (again / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()
    name, shape, kind = cm.tensor_specs(presets.get_preset("tiny-qwen3").fields)[2]
    a = cm.make_tensor(name, shape, kind, True, 0, torch.float32, "cpu")
    assert torch.equal(a, read_tensors(first)[name])
    assert not torch.equal(a, cm.make_tensor(name, shape, kind, True, 1, torch.float32, "cpu"))


def test_sharding_covers_every_tensor_once_and_loads(tiny_dirs, tmp_path):
    d = cm.make_checkpoint("tiny-qwen3-moe", tmp_path, max_shard_size="100KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (d / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    seen = []
    for s in shards:
        with safe_open(str(s), "pt") as sf:
            keys = list(sf.keys())
            assert all(index["weight_map"][k] == s.name for k in keys)
            assert len(keys) == 1 or sum(sf.get_tensor(k).nbytes for k in keys) <= 100_000
            seen += keys
    assert sorted(seen) == sorted(index["weight_map"]) and len(seen) == len(set(seen))
    tensors = read_tensors(d)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    # Values do not depend on sharding.
    whole = read_tensors(tiny_dirs["tiny-qwen3-moe"])
    assert all(torch.equal(tensors[k], whole[k]) for k in whole)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"])


def test_bf16_override_writes_bf16(tmp_path):
    d = cm.make_checkpoint("tiny-qwen3", tmp_path, dtype="bf16", seed=3)
    assert all(t.dtype == torch.bfloat16 for t in read_tensors(d).values())
    assert json.loads((d / "config.json").read_text())["torch_dtype"] == "bfloat16"


PUBLISHED = {
    # layers, hidden, heads, kv heads, head_dim, intermediate, tied, parameters (published)
    "qwen3-0.6b": (28, 1024, 16, 8, 128, 3072, True, 596_049_920),
    "qwen3-8b": (36, 4096, 32, 8, 128, 12288, False, 8_190_735_360),
    "qwen3-30b-a3b": (48, 2048, 32, 4, 128, 6144, False, 30_532_122_624),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_large_presets_have_published_shapes(preset):
    layers, hidden, heads, kv, head_dim, inter, tied, params = PUBLISHED[preset]
    cfg = presets.config_json(preset)
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"],
            cfg["tie_word_embeddings"]) == (layers, hidden, heads, kv, head_dim, inter, tied)
    assert cfg["vocab_size"] == 151936 and cfg["rope_theta"] == 1e6 and cfg["rms_norm_eps"] == 1e-6
    assert cfg["torch_dtype"] == "bfloat16" and cfg["max_position_embeddings"] == 40960
    if preset == "qwen3-30b-a3b":
        assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (128, 8, 768)
        assert cfg["norm_topk_prob"] is True and cfg["mlp_only_layers"] == []
    # Shapes only: the HF model on the meta device allocates nothing.
    config = presets.hf_config(preset)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    hf = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    ours = sum(math.prod(s) for _, s, _ in cm.tensor_specs(presets.get_preset(preset).fields))
    assert hf == ours == params


@pytest.mark.parametrize("preset", TINY)
def test_first_layers_only_are_the_whole_presets_first_layers(tiny_dirs, tmp_path, preset):
    """--num-layers N: a checkpoint of the preset's first N layers, each tensor what the whole
    preset holds under its name, a config saying N layers, loadable by transformers."""
    d = cm.make_checkpoint(preset, tmp_path, num_layers=2)
    cfg = json.loads((d / "config.json").read_text())
    whole_cfg = json.loads((tiny_dirs[preset] / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 < whole_cfg["num_hidden_layers"]
    per_layer = ("num_hidden_layers", "max_window_layers", "layer_types")    # layer_types: one a layer
    assert len(cfg.get("layer_types", [None] * 2)) == 2
    assert ({k: v for k, v in cfg.items() if k not in per_layer}
            == {k: v for k, v in whole_cfg.items() if k not in per_layer})
    part, whole = read_tensors(d), read_tensors(tiny_dirs[preset])
    assert part and set(part) < set(whole)
    assert {k for k in whole if k.startswith("model.layers.")} - set(part) == \
        {k for k in whole if k.startswith("model.layers.") and int(k.split(".")[2]) >= 2}
    assert all(torch.equal(t, whole[k]) for k, t in part.items())
    _, info = transformers.AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"])
    top = whole_cfg["num_hidden_layers"]       # all of them: the whole preset
    assert presets.preset_fields(preset, top) == presets.get_preset(preset).fields


def test_shards_plan_like_transformers():
    specs = [("a", (10,), "norm"), ("b", (30,), "norm"), ("c", (100,), "norm"), ("d", (5,), "norm")]
    plan = cm.plan_shards(specs, torch.float32, 160)
    assert [[s[0] for s in shard] for shard in plan] == [["a", "b"], ["c"], ["d"]]
    assert cm.parse_size("2GB") == 2 * 10**9 and cm.parse_size("1KiB") == 1024 and cm.parse_size(7) == 7


@pytest.mark.parametrize("kwargs, field", [
    ({"preset": "qwen4"}, "preset"),
    ({"dtype": "int8"}, "dtype"),
    ({"max_shard_size": "lots"}, "max_shard_size"),
    ({"seed": -1}, "seed"),
    ({"device": "tpu"}, "device"),
    ({"num_layers": 0}, "num_layers"),
    ({"num_layers": 5}, "num_layers"),
    ({"num_layers": 2.0}, "num_layers"),
])
def test_bad_arguments_name_the_field(tmp_path, kwargs, field):
    args = {"preset": "tiny-qwen3", "out_dir": tmp_path, **kwargs}
    with pytest.raises(ConfigError, match=field):
        cm.make_checkpoint(**args)


def test_ensure_default_model_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = cm.ensure_default_model()
    assert path == cm.default_model_dir() and path.is_relative_to(tmp_path)
    assert path.name.startswith("tiny-qwen3-") and (path / "model.safetensors").exists()
    stamp = os.stat(path / "model.safetensors").st_mtime_ns
    assert cm.ensure_default_model() == path
    assert os.stat(path / "model.safetensors").st_mtime_ns == stamp
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp dir left behind


def test_an_unusable_user_cache_is_named_not_a_traceback(tmp_path, monkeypatch, capsys):
    """XDG_CACHE_HOME a file (or the disk full while the default model is written): a ConfigError
    naming the model and XDG_CACHE_HOME, and `pcg generate` prints one line and exits 2 (a raw
    NotADirectoryError traceback before)."""
    from pcg_engine import cli
    a_file = tmp_path / "f"
    a_file.write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(a_file))
    with pytest.raises(ConfigError, match=r"^model: the tiny-qwen3 checkpoint .*XDG_CACHE_HOME.*Not a directory") as e:
        cm.ensure_default_model()
    assert e.value.field == "model"
    assert cli.main(["generate", "--device", "cpu", "--prompt", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --model (model): the tiny-qwen3 checkpoint is built on first use")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(cm, "make_checkpoint", no_space)
    with pytest.raises(ConfigError, match="No space left on device"):
        cm.ensure_default_model()
    assert list(cm.default_model_dir().parent.iterdir()) == []      # nothing half-built left


def _cli_args(out, **over):
    import argparse
    return argparse.Namespace(**{"preset": "tiny-qwen3", "out": str(out), "seed": 0, "max_shard_size": "2GB",
                                 "dtype": None, "device": "cpu", "overwrite": False, **over})


def test_cli_refuses_a_directory_with_files_unless_overwrite(tmp_path, monkeypatch):
    """make-model replaces config.json and deletes model*.safetensors: into a directory that holds
    files (someone's own checkpoint) only with --overwrite; an empty --out (the current directory)
    is refused."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "model-00001-of-00009.safetensors").write_text("important")
    (theirs / "config.json").write_text('{"mine": 1}')
    with pytest.raises(SystemExit, match=r"--out: .*theirs is not empty.*--overwrite"):
        cm.run(_cli_args(theirs))
    assert (theirs / "model-00001-of-00009.safetensors").read_text() == "important"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="--out: is empty"):
        cm.run(_cli_args(""))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["theirs"]
    # files that only look like weights by their names stay (found by probing, session 41: the glob
    # model*.safetensors* deleted them)
    (theirs / "model_notes.safetensors.md").write_text("notes")
    (theirs / "model.safetensors.index.json.bak").write_text("backup")
    (theirs / "model.safetensors.index.json").write_text("{}")
    path = cm.run(_cli_args(theirs, overwrite=True))
    assert not (theirs / "model-00001-of-00009.safetensors").exists() and (path / "model.safetensors").exists()
    assert not (theirs / "model.safetensors.index.json").exists()
    assert (theirs / "model_notes.safetensors.md").read_text() == "notes"
    assert (theirs / "model.safetensors.index.json.bak").read_text() == "backup"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (cm.run(_cli_args(empty)) / "config.json").exists()     # an empty directory is fine


@pytest.mark.parametrize("over, named", [({"max_shard_size": "bogus"}, "--max-shard-size \\(max_shard_size\\)"),
                                         ({"max_shard_size": "0"}, "--max-shard-size \\(max_shard_size\\)"),
                                         ({"seed": -1}, "--seed \\(seed\\)"),
                                         ({"device": "bogus"}, "--device \\(device\\)"),
                                         ({"num_layers": 9}, "--num-layers \\(num_layers\\)")])
def test_cli_bad_setting_is_one_line_naming_it(tmp_path, over, named):
    """The flag the user typed, not only the setting's name (found by probing: "seed: must be ...")."""
    with pytest.raises(SystemExit, match=f"pcg make-model: {named}: "):
        cm.run(_cli_args(tmp_path / "m", **over))
    assert not (tmp_path / "m").exists()


def test_cli_main_names_the_flag(tmp_path, capsys):
    from pcg_engine import cli
    assert cli.main(["make-model", "--preset", "tiny-qwen3", "--out", str(tmp_path / "m"),
                     "--max-shard-size", "-5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: pcg make-model: --max-shard-size (max_shard_size): ") and "Traceback" not in err


def test_make_model_script_reports_as_the_cli_does(tmp_path, capsys):
    """scripts/make_model.py printed a refusal bare and exited 1; the CLI's form is "error: ..."
    and exit 2. A size that parses to 0 bytes says so ('0.5B' read as "must be positive")."""
    import runpy
    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "make_model.py"))
    assert script["main"](["--preset", "tiny-qwen3", "--out", str(tmp_path / "m"), "--max-shard-size", "0.5B"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: pcg make-model: --max-shard-size (max_shard_size): must be at least 1 byte, "
                   "got '0.5B' (0 bytes)\n")
    assert not (tmp_path / "m").exists()


def test_cli_out_that_cannot_be_a_directory(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(SystemExit, match="--out: .* exists and is not a directory"):
        cm.run(_cli_args(a_file))
    with pytest.raises(SystemExit, match="--out: cannot write the checkpoint in"):
        cm.run(_cli_args(a_file / "below"))      # a directory under a file


@pytest.mark.parametrize("error, message", [
    (OSError(28, "No space left on device"), "--out: cannot write the checkpoint in .*: No space left on device"),
    (KeyboardInterrupt(), None),
])
@pytest.mark.parametrize("given", ["new", "empty"])
def test_cli_write_that_fails_part_way_leaves_nothing_behind(tmp_path, monkeypatch, error, message, given):
    """Found by probing: a write that failed after config.json and the tokenizer (disk full, Ctrl-C)
    left a directory that looked like a checkpoint, without its weights, and a re-run refused it as
    "not empty". A new --out is removed, an empty one emptied again."""
    out = tmp_path / "m"
    if given == "empty":
        out.mkdir()

    def fail(out_dir, *args, **kwargs):
        (out_dir / "model-00001-of-00002.safetensors").write_bytes(b"half")
        raise error
    monkeypatch.setattr(cm, "_write_weights", fail)
    with pytest.raises(SystemExit if message else KeyboardInterrupt, match=message):
        cm.run(_cli_args(out))
    assert (list(out.iterdir()) == []) if given == "empty" else not out.exists()
    monkeypatch.undo()
    assert (cm.run(_cli_args(out)) / "model.safetensors").exists()       # the re-run is not refused


@pytest.mark.parametrize("error, message", [
    (OSError(28, "No space left on device"), "--out: cannot write the checkpoint in .*: No space left on device"),
    (KeyboardInterrupt(), None),
])
def test_cli_overwrite_that_fails_part_way_keeps_the_old_checkpoint(tmp_path, monkeypatch, error, message):
    """Found by probing: --overwrite deleted the old shards and wrote the new config.json before the
    weights, so a run that failed part way left a mix of old and new files, neither checkpoint.
    The new files are now written aside and moved in only once complete."""
    out = tmp_path / "m"
    cm.run(_cli_args(out, max_shard_size="200KB"))          # the checkpoint already there: several shards
    (out / "README.md").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "model.safetensors.index.json" in before
    written = []

    def save_then_fail(tensors, filename, metadata=None):   # the second shard's write fails
        if written:
            raise error
        written.append(filename)
        real_save(tensors, filename, metadata=metadata)
    real_save = cm.save_file
    monkeypatch.setattr(cm, "save_file", save_then_fail)
    with pytest.raises(SystemExit if message else KeyboardInterrupt, match=message):
        cm.run(_cli_args(out, overwrite=True, seed=1, max_shard_size="300KB"))
    assert written
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before    # no file changed, none added
    monkeypatch.undo()
    path = cm.run(_cli_args(out, overwrite=True, seed=1))               # a whole run replaces it
    assert sorted(p.name for p in path.glob("model*")) == ["model.safetensors"]
    assert (out / "README.md").read_text() == "mine" and not list(out.glob(".make-model-*"))
