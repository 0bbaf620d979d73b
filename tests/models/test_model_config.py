"""The project's own config.json reader (models/model_config.py): the values transformers would read
for every preset, and errors that name the bad field."""

import json

import pytest

from pcg_engine.errors import CheckpointError
from pcg_engine.models import presets
from pcg_engine.models.model_config import parse_config, read_config

FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim", "intermediate_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "decoder_sparse_step")


def preset_json(name: str) -> dict:
    return json.loads(json.dumps(presets.config_json(name)))    # exactly what config.json holds


@pytest.mark.parametrize("without_head_dim", [False, True])
@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_reads_what_transformers_reads(name, tmp_path, without_head_dim):
    """Every preset's config.json, and the same without head_dim: transformers' Qwen3Config then
    defaults it to 128, while its MoE model code takes hidden_size // num_attention_heads (this
    reader took that for both: 64 for a Qwen3-0.6B config, whose weights are at 128)."""
    from transformers import AutoConfig

    raw = preset_json(name)
    if without_head_dim:
        del raw["head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = read_config(tmp_path)
    theirs = AutoConfig.from_pretrained(str(tmp_path), local_files_only=True)
    for field in FIELDS + (MOE_FIELDS if ours.is_moe else ()):
        want = getattr(theirs, field, None)
        if field == "head_dim" and want is None:      # what the MoE model code does without it
            want = theirs.hidden_size // theirs.num_attention_heads
        assert getattr(ours, field) == want, field
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.is_moe == (raw["model_type"] == "qwen3_moe")
    if ours.is_moe:
        assert list(ours.mlp_only_layers) == list(theirs.mlp_only_layers)
    json.loads(ours.to_json_string())                            # the compile cache's key material


@pytest.mark.parametrize("edit", [
    {"rope_scaling": {"rope_type": "default", "rope_theta": 1e6}},       # theta only inside rope_scaling
    {"rope_scaling": {"rope_type": "default"}},                           # neither: 10000
    {"rope_theta": 5e5, "rope_scaling": {"rope_type": "default"}},        # the top level's
    {"rope_scaling": {}, "rope_parameters": {"rope_type": "default", "rope_theta": 3e5}},   # {}: not given
])
def test_rope_theta_read_as_transformers_reads_rope_scaling(edit, tmp_path):
    """Found by probing: a theta inside rope_scaling (which transformers 5 reads in place of
    rope_parameters) was ignored: 10000 here, the checkpoint's 1e6 in transformers, other tokens."""
    from transformers import AutoConfig

    raw = preset_json("tiny-qwen3")
    for key in ("rope_theta", "rope_parameters", "rope_scaling"):
        raw.pop(key, None)
    raw.update(edit)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    theirs = AutoConfig.from_pretrained(str(tmp_path), local_files_only=True)
    assert read_config(tmp_path).rope_theta == theirs.rope_parameters["rope_theta"]


def test_rope_theta_that_transformers_would_ignore_is_refused():
    """rope_parameters' theta beside a rope_scaling without one: transformers reads rope_scaling alone
    and rotates by 10000; loading that silently (it took rope_parameters' 1e6) gave other tokens."""
    raw = preset_json("tiny-qwen3")
    del raw["rope_theta"]
    raw["rope_scaling"] = {"rope_type": "default"}
    with pytest.raises(CheckpointError, match="field 'rope_parameters.rope_theta' is 1000000.0, but transformers "
                                              "reads 'rope_scaling' in its place, which gives rope_theta 10000.0"):
        parse_config(raw, "ckpt/config.json")


def test_transformers5_spellings_and_defaults():
    raw = preset_json("tiny-qwen3-moe")
    raw["num_local_experts"] = raw.pop("num_experts")
    del raw["rope_theta"]                                        # only rope_parameters left
    for optional in ("head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                     "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
        raw.pop(optional, None)
    cfg = parse_config(raw)
    assert cfg.num_experts == 8 and cfg.rope_theta == 1_000_000.0
    assert cfg.head_dim == cfg.hidden_size // cfg.num_attention_heads
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (1e-6, 32768, False)
    assert (cfg.norm_topk_prob, cfg.decoder_sparse_step, cfg.mlp_only_layers) == (False, 1, ())


@pytest.mark.parametrize("field", ["hidden_size", "num_key_value_heads", "vocab_size", "intermediate_size"])
def test_missing_field_is_named(field, tmp_path):
    raw = preset_json("tiny-qwen3")
    del raw[field]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=f"'{field}' is missing") as info:
        read_config(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


def test_missing_moe_field_is_named():
    raw = preset_json("tiny-qwen3-moe")
    del raw["moe_intermediate_size"]
    with pytest.raises(CheckpointError, match="'moe_intermediate_size' is missing"):
        parse_config(raw)
    raw = preset_json("tiny-qwen3-moe")      # every layer sparse: no dense width needed
    del raw["intermediate_size"]
    assert parse_config(raw).intermediate_size == 0
    raw["mlp_only_layers"] = [1]
    with pytest.raises(CheckpointError, match="'intermediate_size' is missing.*layer 1"):
        parse_config(raw)


@pytest.mark.parametrize("field, value, message", [
    ("hidden_size", 0, "'hidden_size' is 0; allowed: an int > 0"),
    ("num_hidden_layers", "4", "'num_hidden_layers' is '4'"),
    ("num_attention_heads", True, "'num_attention_heads' is True"),
    ("rms_norm_eps", -1.0, "'rms_norm_eps' is -1.0; allowed: a finite number > 0"),
    ("tie_word_embeddings", 1, "'tie_word_embeddings' is 1; allowed: true or false"),
    # found by probing: 1 was taken; every request was then refused, a max_model_len "allowed: 2..1"
    ("max_position_embeddings", 1, "'max_position_embeddings' is 1; allowed: an int >= 2"),
    ("max_position_embeddings", 0, "'max_position_embeddings' is 0; allowed: an int >= 2"),
    ("num_key_value_heads", 3, "num_attention_heads \\(4\\) must be a multiple of num_key_value_heads \\(3\\)"),
    ("rope_theta", 5.0, "'rope_theta' and 'rope_parameters.rope_theta' disagree"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}, "rope_type 'yarn'"),
    ("rope_scaling", {"type": "linear", "factor": 2.0}, "'rope_scaling' asks for rope_type 'linear'"),
    ("attention_bias", True, "'attention_bias' is true"),
    ("model_type", "llama", "'model_type' is 'llama'"),
    ("architectures", "Qwen3ForCausalLM", "'architectures' is 'Qwen3ForCausalLM'"),
])
def test_invalid_field_is_named(field, value, message):
    raw = preset_json("tiny-qwen3")
    raw[field] = value
    with pytest.raises(CheckpointError, match=message):
        parse_config(raw, "ckpt/config.json")


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe"])
@pytest.mark.parametrize("edit", [
    {"use_sliding_window": True, "sliding_window": 8},                                 # the preset: window from layer 4 of 4
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
    {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
    {"use_sliding_window": True, "max_window_layers": 1},                              # transformers' default window 4096
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0, "layer_types": "all full"},
    {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 0},
])
def test_sliding_window_refused_exactly_where_transformers_windows_a_layer(name, edit):
    """transformers (the reference) decides which layers attend through a window: Qwen3Config from
    max_window_layers on, when use_sliding_window and a sliding_window are set and layer_types is
    not given; Qwen3MoeConfig every layer. A config is refused exactly when one layer is windowed
    (use_sliding_window true was refused even where every layer attends fully)."""
    from transformers import AutoConfig
    raw = preset_json(name)
    raw.update(edit)
    if "sliding_window" not in edit:
        del raw["sliding_window"]
    if "layer_types" in edit:
        raw["layer_types"] = ["full_attention"] * raw["num_hidden_layers"]
    hf = AutoConfig.for_model(**raw)
    layer_types = getattr(hf, "layer_types", None) if raw["model_type"] == "qwen3" else None
    windowed = (any(t == "sliding_attention" for t in layer_types) if layer_types is not None
                else hf.sliding_window is not None)
    if windowed:
        with pytest.raises(CheckpointError, match=r"'use_sliding_window' is true .*only full attention"):
            parse_config(raw, "ckpt/config.json")
    else:
        assert parse_config(raw, "ckpt/config.json").num_hidden_layers == raw["num_hidden_layers"]


@pytest.mark.parametrize("edit, message", [
    # Found by probing: an infinite eps loaded and every norm output 0 (the first token was id 0, the
    # request then stopped); an infinite theta alone left RoPE without rotation.
    ({"rms_norm_eps": float("inf")}, "field 'rms_norm_eps' is inf; allowed: a finite number > 0"),
    ({"rope_theta": float("inf"), "rope_parameters": None}, "field 'rope_theta' is inf; allowed: a finite number > 0"),
    ({"rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}},
     "field 'rope_parameters.rope_theta' is inf; allowed: a finite number > 0"),
])
def test_infinite_numbers_are_refused(edit, message):
    raw = preset_json("tiny-qwen3")
    raw.update(edit)
    with pytest.raises(CheckpointError) as info:
        parse_config(raw, "ckpt/config.json")
    assert str(info.value) == f"ckpt/config.json: {message}"


@pytest.mark.parametrize("edit, message", [
    ({"head_dim": 31}, "field 'head_dim' is 31; allowed: an even int > 0 (RoPE rotates pairs of dimensions)"),
    ({"head_dim": None, "hidden_size": 132}, "no field 'head_dim', and hidden_size (132) // num_attention_heads (4) "
                                             "is 33; allowed: an even head_dim > 0 (RoPE rotates pairs of dimensions): "
                                             "give 'head_dim'"),
    ({"head_dim": None, "hidden_size": 3}, "no field 'head_dim', and hidden_size (3) // num_attention_heads (4) "
                                           "is 0; allowed: an even head_dim > 0 (RoPE rotates pairs of dimensions): "
                                           "give 'head_dim'"),
])
def test_odd_head_dim_is_refused(edit, message):
    """Found by probing: a checkpoint of odd head_dim (weights of its shapes) loaded, and the first
    prompt, text or token ids, failed as "the tokenizer cannot be loaded" (transformers validates
    config.json in AutoTokenizer: "RoPE requires an even rotary dimension"), naming neither
    config.json nor the field. (Qwen3-MoE's: a dense Qwen3 config without head_dim takes 128.)"""
    raw = preset_json("tiny-qwen3-moe")
    raw.update(edit)
    with pytest.raises(CheckpointError) as info:
        parse_config(raw, "ckpt/config.json")
    assert str(info.value) == f"ckpt/config.json: {message}"
    raw.update(head_dim=2)
    assert parse_config(raw).head_dim == 2


def test_moe_top_k_beyond_experts():
    raw = preset_json("tiny-qwen3-moe")
    raw["num_experts_per_tok"] = raw["num_experts"] + 1
    with pytest.raises(CheckpointError, match="'num_experts_per_tok' is 9; allowed: 1..num_experts"):
        parse_config(raw)


def test_not_an_object():
    with pytest.raises(CheckpointError, match="expected a JSON object"):
        parse_config([1, 2])


@pytest.mark.parametrize("extra", [-3, 1])
def test_layer_types_of_another_length_than_the_layers(extra):
    """Found by probing: a layer_types list shorter or longer than num_hidden_layers was taken, and the
    first text prompt then failed as "the tokenizer cannot be loaded" (transformers' validation)."""
    raw = preset_json("tiny-qwen3")
    layers = raw["num_hidden_layers"]
    raw["layer_types"] = ["full_attention"] * (layers + extra)
    with pytest.raises(CheckpointError, match=f"ckpt/config.json: field 'layer_types' has {layers + extra} entries; "
                                              f"allowed: one per layer, num_hidden_layers \\({layers}\\) of them, or null"):
        parse_config(raw, "ckpt/config.json")
    raw["layer_types"] = ["full_attention"] * layers
    assert parse_config(raw).num_hidden_layers == layers
