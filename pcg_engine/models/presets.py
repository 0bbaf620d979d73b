"""Model presets: name -> Hugging Face config fields (published Qwen3 shapes, or tiny test shapes).

Field names follow the published Qwen3 `config.json` files. transformers 5 rewrites some of them
when it serialises a config (`rope_theta` -> `rope_parameters`, `num_experts` ->
`num_local_experts`, `torch_dtype` -> `dtype`); `config_json` keeps both spellings so that a
reader written against either the hub's files or transformers 5's output finds what it expects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pcg_engine.errors import ConfigError
from pcg_engine.models.tokenizer_maker import special_token_ids

# Vocab of the tokenizer trained for the published-shape presets. Their model vocab (151936) is
# larger, as in real checkpoints whose embedding is padded beyond the tokenizer.
LARGE_TOKENIZER_VOCAB = 8192
TINY_VOCAB = 1024

_COMMON = {
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_scaling": None,
    "use_sliding_window": False,
    "sliding_window": None,
    "initializer_range": 0.02,
    "use_cache": True,
}

_MOE = {
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}


@dataclass(frozen=True)
class Preset:
    name: str
    fields: dict = field(repr=False)
    tokenizer_vocab: int
    # Tiny models get a larger init so random greedy decoding is peaked and varied (see
    # checkpoint_maker); published shapes use the usual std 0.02, speed does not depend on it.
    tiny: bool

    @property
    def is_moe(self) -> bool:
        return self.fields["model_type"] == "qwen3_moe"


def _dense(layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, tied, max_pos, dtype) -> dict:
    return {
        **_COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "num_hidden_layers": layers,
        "max_window_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "max_position_embeddings": max_pos,
        "torch_dtype": dtype,
    }


def _moe(layers, hidden, heads, kv_heads, head_dim, experts, top_k, moe_inter, inter, vocab, max_pos,
         dtype) -> dict:
    fields = _dense(layers, hidden, heads, kv_heads, head_dim, inter, vocab, False, max_pos, dtype)
    fields.update(_MOE)
    fields.update({
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": moe_inter,
    })
    return fields


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("tiny-qwen3", _dense(4, 64, 4, 2, 32, 128, TINY_VOCAB, True, 4096, "float32"), TINY_VOCAB, True),
        Preset("tiny-qwen3-moe", _moe(3, 64, 4, 2, 32, 8, 2, 32, 128, TINY_VOCAB, 4096, "float32"),
               TINY_VOCAB, True),
        Preset("qwen3-0.6b", _dense(28, 1024, 16, 8, 128, 3072, 151936, True, 40960, "bfloat16"),
               LARGE_TOKENIZER_VOCAB, False),
        Preset("qwen3-8b", _dense(36, 4096, 32, 8, 128, 12288, 151936, False, 40960, "bfloat16"),
               LARGE_TOKENIZER_VOCAB, False),
        Preset("qwen3-30b-a3b", _moe(48, 2048, 32, 4, 128, 128, 8, 768, 6144, 151936, 40960, "bfloat16"),
               LARGE_TOKENIZER_VOCAB, False),
    )
}

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError("preset", f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def resolve_dtype(preset: Preset, dtype: str | None) -> str:
    """The torch dtype name for the weights: the preset's own unless overridden."""
    if dtype is None:
        return preset.fields["torch_dtype"]
    if str(dtype).removeprefix("torch.") not in DTYPES:
        raise ConfigError("dtype", f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[str(dtype).removeprefix("torch.")]


def preset_fields(name: str, num_layers: int | None = None) -> dict:
    """The preset's config fields, with its first `num_layers` layers only where given: every
    layer at the published shape, for timing a model per layer on a disk its whole checkpoint
    does not fit (Qwen3-30B-A3B: 61 GB)."""
    preset = get_preset(name)
    fields = dict(preset.fields)
    if num_layers is not None:
        top = preset.fields["num_hidden_layers"]
        if type(num_layers) is not int or not 1 <= num_layers <= top:
            raise ConfigError("num_layers", f"must be an integer in [1, {top}] ({name} has {top} layers), "
                                            f"got {num_layers!r}")
        fields["num_hidden_layers"] = num_layers
        fields["max_window_layers"] = min(fields["max_window_layers"], num_layers)
    return fields


def hf_config(name: str, dtype: str | None = None, num_layers: int | None = None):
    """The transformers config object (Qwen3Config / Qwen3MoeConfig) for a preset (preset_fields)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    preset = get_preset(name)
    fields = dict(preset_fields(name, num_layers), **special_token_ids_for_config())
    fields["torch_dtype"] = resolve_dtype(preset, dtype)
    cls = Qwen3MoeConfig if preset.is_moe else Qwen3Config
    return cls(**fields)


def special_token_ids_for_config() -> dict[str, int]:
    ids = special_token_ids()
    return {k: ids[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


# PretrainedConfig bookkeeping that says nothing about the model; omitted to keep config.json readable.
_GENERIC_KEYS = {
    "_name_or_path", "id2label", "label2id", "problem_type", "chunk_size_feed_forward",
    "output_hidden_states", "output_attentions", "return_dict", "is_encoder_decoder",
}


def config_json(name: str, dtype: str | None = None, num_layers: int | None = None) -> dict:
    """The dict written as config.json: transformers 5's serialisation plus the published aliases."""
    preset = get_preset(name)
    config = hf_config(name, dtype, num_layers)
    data = {k: v for k, v in config.to_dict().items() if k not in _GENERIC_KEYS}
    data["architectures"] = list(preset.fields["architectures"])
    data["rope_theta"] = preset.fields["rope_theta"]
    data["torch_dtype"] = resolve_dtype(preset, dtype)
    if preset.is_moe:
        data["num_experts"] = preset.fields["num_experts"]
    return data
