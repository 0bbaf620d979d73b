"""The model's config.json, read by the project itself: the fields Qwen3 / Qwen3-MoE use, validated.

Why not transformers' AutoConfig: importing transformers costs seconds of start-up (on the H200 it
pulled in sklearn, torch.distributed's tensor and FSDP modules and an importlib.metadata scan of
every installed package) to read a dozen numbers. transformers remains the reference the tests
compare against and the tokenizer library, loaded only when text is encoded or decoded.

Fields that fix a tensor shape are required: a missing one is an error naming it, where
transformers would fill in its own default (a 4096-wide model) and fail later on the weights.
Optional fields take transformers' defaults. Features the flat model does not implement (scaled
RoPE, sliding-window attention, attention biases, an activation other than SiLU, quantized weights)
are refused by name rather than ignored.
Both spellings of renamed fields are accepted: the hub's (`rope_theta`, `num_experts`,
`rope_scaling`) and transformers 5's serialisation (`rope_parameters`, `num_local_experts`).
"""

import dataclasses
import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from pcg_engine.errors import CheckpointError
from pcg_engine.models.json_file import read_json_object
from pcg_engine.models.regular_file import kind_of

SUPPORTED = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
_REQUIRED = object()


@dataclass(frozen=True)
class ModelConfig:
    """What the flat model and the runner read of a checkpoint's config.json."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int          # dense MLP width (0 for a MoE model whose every layer is sparse)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    # Qwen3-MoE (num_experts 0: a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.is_moe and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def to_json_string(self) -> str:
        """Canonical JSON of every field (the compile cache keys on it)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def _positive_int(v):
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _positive_number(v):
    # Finite: an infinite rms_norm_eps zeroes every norm's output, an infinite rope_theta every rotation.
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v)


def _int_list(v):
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


# name -> (spellings in config.json, check, what the error says is allowed, default)
_COMMON = {
    "vocab_size": (("vocab_size",), _positive_int, "an int > 0", _REQUIRED),
    "hidden_size": (("hidden_size",), _positive_int, "an int > 0", _REQUIRED),
    "num_hidden_layers": (("num_hidden_layers",), _positive_int, "an int > 0", _REQUIRED),
    "num_attention_heads": (("num_attention_heads",), _positive_int, "an int > 0", _REQUIRED),
    "num_key_value_heads": (("num_key_value_heads",), _positive_int, "an int > 0", _REQUIRED),
    "head_dim": (("head_dim",), _positive_int, "an int > 0", None),
    "intermediate_size": (("intermediate_size",), _positive_int, "an int > 0", None),
    "rms_norm_eps": (("rms_norm_eps",), _positive_number, "a finite number > 0", 1e-6),
    # >= 2: a prompt token and one new one (EngineConfig's max_model_len bound). 1 was taken, and
    # every request refused ("allowed: at most 0 prompt tokens"), a max_model_len with "allowed: 2..1".
    "max_position_embeddings": (("max_position_embeddings",), lambda v: _positive_int(v) and v >= 2,
                                "an int >= 2", 32768),
    "tie_word_embeddings": (("tie_word_embeddings",), lambda v: isinstance(v, bool), "true or false", False),
}
_MOE = {
    "num_experts": (("num_experts", "num_local_experts"), _positive_int, "an int > 0", _REQUIRED),
    "num_experts_per_tok": (("num_experts_per_tok",), _positive_int, "an int > 0", _REQUIRED),
    "moe_intermediate_size": (("moe_intermediate_size",), _positive_int, "an int > 0", _REQUIRED),
    "norm_topk_prob": (("norm_topk_prob",), lambda v: isinstance(v, bool), "true or false", False),
    "decoder_sparse_step": (("decoder_sparse_step",), _positive_int, "an int > 0", 1),
    "mlp_only_layers": (("mlp_only_layers",), _int_list, "a list of layer indices", []),
}


def _field(raw: dict, where: str, name: str, spec):
    spellings, ok, allowed, default = spec
    present = [s for s in spellings if raw.get(s) is not None]
    values = {raw[s] for s in present if isinstance(raw[s], (int, float, str, bool))}
    if len(values) > 1:
        raise CheckpointError(f"{where}: fields {' and '.join(map(repr, present))} disagree "
                              f"({', '.join(repr(raw[s]) for s in present)})")
    if not present:
        if default is _REQUIRED:
            raise CheckpointError(f"{where}: field {name!r} is missing (allowed: {allowed})")
        return default
    value = raw[present[0]]
    if not ok(value):
        raise CheckpointError(f"{where}: field {present[0]!r} is {value!r}; allowed: {allowed}")
    return value


def _rope_theta(raw: dict, where: str) -> float:
    """rope_theta from the top level (hub) or rope_parameters (transformers 5); only plain RoPE."""
    for key in ("rope_parameters", "rope_scaling"):
        params = raw.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise CheckpointError(f"{where}: field {key!r} is {params!r}; allowed: an object or null")
        kind = params.get("rope_type", params.get("type"))
        if kind not in (None, "default"):
            raise CheckpointError(f"{where}: field {key!r} asks for rope_type {kind!r}; pcg-engine implements "
                                  "only the default RoPE (rope_type 'default' or no scaling)")
    # transformers 5 reads rope_scaling, when it is given (non-empty), in place of rope_parameters
    # (convert_rope_params_to_dict): the theta is that dict's, else the top level's, else 10000. A
    # theta inside rope_scaling was ignored here, and the model rotated by 10000 where transformers'
    # own rotated by the checkpoint's value: other tokens, without a word.
    used, unused = ("rope_scaling", "rope_parameters") if raw.get("rope_scaling") else ("rope_parameters", "rope_scaling")
    thetas = {k: v for k, v in (("rope_theta", raw.get("rope_theta")),
                                (f"{used}.rope_theta", (raw.get(used) or {}).get("rope_theta")))
              if v is not None}
    for key, value in thetas.items():
        if not _positive_number(value):
            raise CheckpointError(f"{where}: field {key!r} is {value!r}; allowed: a finite number > 0")
    if len(set(thetas.values())) > 1:
        raise CheckpointError(f"{where}: fields {' and '.join(map(repr, thetas))} disagree "
                              f"({', '.join(repr(v) for v in thetas.values())})")
    theta = float(next(iter(thetas.values()), 10000.0))
    ignored = (raw.get(unused) or {}).get("rope_theta")
    if ignored is not None and ignored != theta:
        raise CheckpointError(f"{where}: field '{unused}.rope_theta' is {ignored!r}, but transformers reads "
                              f"'{used}' in its place, which gives rope_theta {theta!r}; keep one of the two fields")
    return theta


# The MLPs compute silu(gate) * up (layers.silu_and_mul, its Triton kernel and the fused MoE);
# transformers' "swish" is the same function. Any other activation would load and run, wrongly.
ACTIVATIONS = ("silu", "swish")


# transformers' defaults for a config.json that leaves the fields out (Qwen3Config, Qwen3MoeConfig).
_HF_SLIDING_WINDOW, _HF_MAX_WINDOW_LAYERS = 4096, 28


def _windowed_layers(raw: dict) -> str | None:
    """Which layers transformers runs with a sliding window, in words, or None where all attend fully.
    use_sliding_window alone decides nothing: Qwen3Config windows the layers from max_window_layers
    on (when layer_types is not given: that list, checked below, decides then), and only with a
    sliding_window (null: none). Qwen3MoeConfig windows every layer. Published Qwen3 configs set
    use_sliding_window false; a true one with every layer full attention was refused before."""
    if not raw.get("use_sliding_window") or raw.get("sliding_window", _HF_SLIDING_WINDOW) is None:
        return None
    if raw.get("model_type") == "qwen3_moe":
        return "every layer"
    if raw.get("layer_types") is not None:
        return None
    first, layers = raw.get("max_window_layers", _HF_MAX_WINDOW_LAYERS), raw.get("num_hidden_layers")
    if isinstance(first, int) and isinstance(layers, int) and first >= layers:
        return None
    return f"layers {first} and on (max_window_layers {first}, num_hidden_layers {layers})"


def _refuse_unsupported(raw: dict, where: str) -> None:
    act = raw.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise CheckpointError(f"{where}: field 'hidden_act' is {act!r}; pcg-engine's MLPs implement only SiLU "
                              f"(allowed: {' or '.join(map(repr, ACTIVATIONS))})")
    windowed = _windowed_layers(raw)
    if windowed:
        allowed = "false, or sliding_window null"
        if raw.get("model_type") != "qwen3_moe":
            allowed += ", or max_window_layers >= num_hidden_layers"
        raise CheckpointError(f"{where}: field 'use_sliding_window' is true with sliding_window "
                              f"{raw.get('sliding_window', _HF_SLIDING_WINDOW)!r}, so transformers gives {windowed} a "
                              f"sliding window; pcg-engine implements only full attention (allowed: {allowed})")
    # transformers 5 writes one entry per layer; a "sliding_attention" one makes that layer's
    # attention windowed, which the attention op does not do.
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list):
            raise CheckpointError(f"{where}: field 'layer_types' is {layer_types!r}; allowed: a list of "
                                  "'full_attention' entries, or null")
        for i, kind in enumerate(layer_types):
            if kind != "full_attention":
                raise CheckpointError(f"{where}: field 'layer_types' gives layer {i} {kind!r}; pcg-engine "
                                      "implements only full attention (allowed: 'full_attention')")
    # Quantized weights need their scales applied or their packing undone, which the flat model
    # does not do: FP8 ones would load cast without their scales, and the scale tensors were refused
    # one by one as "unexpected", never saying why.
    quant = raw.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise CheckpointError(f"{where}: field 'quantization_config' asks for {method!r} quantization; pcg-engine "
                              "loads unquantized weights only (allowed: no quantization_config, or null)")
    if raw.get("attention_bias"):
        raise CheckpointError(f"{where}: field 'attention_bias' is true; the Qwen3 projections have no bias "
                              "(allowed: false)")


FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")


def token_ids_ok(value, vocab_size: int | None) -> bool:
    """An eos_token_id value (config.json's, generation_config.json's): null, a token id (an int,
    not a bool) in 0..vocab_size-1 (any id >= 0 when vocab_size is not known), or a list of them."""
    ids = value if isinstance(value, list) else [value]
    return value is None or all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i
                                and (vocab_size is None or i < vocab_size) for i in ids)


def _check_transformers_fields(raw: dict, where: str, vocab_size: int) -> None:
    """Fields the flat model does not read but transformers does, when the tokenizer is loaded
    (AutoTokenizer reads config.json): a bad one failed there, on the first text prompt, with
    transformers' own error naming neither the file nor what is allowed."""
    eos = raw.get("eos_token_id")
    if not token_ids_ok(eos, vocab_size):
        raise CheckpointError(f"{where}: field 'eos_token_id' is {eos!r}; allowed: a token id in 0..{vocab_size - 1} "
                              "(vocab_size), a list of them, or null")
    for key in ("bos_token_id", "pad_token_id"):     # unused by the engine: only their type is checked
        value = raw.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise CheckpointError(f"{where}: field {key!r} is {value!r}; allowed: a token id (an integer) or null")
    for key in ("torch_dtype", "dtype"):     # the hub's spelling and transformers 5's
        value = raw.get(key)
        if value is not None and value not in FLOAT_DTYPES:
            raise CheckpointError(f"{where}: field {key!r} is {value!r}; allowed: "
                                  f"{', '.join(map(repr, FLOAT_DTYPES))} or null")


def parse_config(raw, where: str = "config.json") -> ModelConfig:
    """A config.json's parsed JSON -> ModelConfig; CheckpointError naming `where` and the field."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: expected a JSON object")
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED), None) if isinstance(archs, list) else None
    if arch is None:
        raise CheckpointError(f"{where}: field 'architectures' is {archs!r}; supported: {sorted(SUPPORTED)}")
    if raw.get("model_type") != SUPPORTED[arch]:
        raise CheckpointError(f"{where}: field 'model_type' is {raw.get('model_type')!r}; "
                              f"{arch} needs {SUPPORTED[arch]!r}")
    _refuse_unsupported(raw, where)
    specs = dict(_COMMON, **(_MOE if SUPPORTED[arch] == "qwen3_moe" else {}))
    values = {name: _field(raw, where, name, spec) for name, spec in specs.items()}
    values["mlp_only_layers"] = tuple(values.get("mlp_only_layers", ()))
    heads, kv_heads = values["num_attention_heads"], values["num_key_value_heads"]
    if heads % kv_heads:
        raise CheckpointError(f"{where}: num_attention_heads ({heads}) must be a multiple of "
                              f"num_key_value_heads ({kv_heads})")
    # RoPE rotates pairs of dimensions: an odd head_dim loaded here and failed on the first prompt, as
    # "the tokenizer cannot be loaded" (transformers validates config.json in AutoTokenizer).
    even = "an even head_dim > 0 (RoPE rotates pairs of dimensions)"
    if values["head_dim"] is None and SUPPORTED[arch] == "qwen3":
        # transformers' Qwen3Config defaults head_dim to 128 (the published models' width), not to
        # hidden_size // heads: 1024 // 16 = 64 loaded a Qwen3-0.6B config without the field at the
        # wrong width, refused by the weights' shapes or, where they fit, giving other tokens.
        values["head_dim"] = 128
    elif values["head_dim"] is None:        # Qwen3MoeConfig has no such default: its model code's
        values["head_dim"] = values["hidden_size"] // heads
        if values["head_dim"] % 2 or not values["head_dim"]:
            raise CheckpointError(f"{where}: no field 'head_dim', and hidden_size ({values['hidden_size']}) // "
                                  f"num_attention_heads ({heads}) is {values['head_dim']}; allowed: {even}: "
                                  "give 'head_dim'")
    elif values["head_dim"] % 2:
        raise CheckpointError(f"{where}: field 'head_dim' is {values['head_dim']}; allowed: an even int > 0 "
                              "(RoPE rotates pairs of dimensions)")
    no_dense_width = values["intermediate_size"] is None
    if no_dense_width:
        values["intermediate_size"] = 0
    config = ModelConfig(architecture=arch, model_type=SUPPORTED[arch], rope_theta=_rope_theta(raw, where),
                         **values)
    if config.is_moe and config.num_experts_per_tok > config.num_experts:
        raise CheckpointError(f"{where}: field 'num_experts_per_tok' is {config.num_experts_per_tok}; allowed: "
                              f"1..num_experts ({config.num_experts})")
    _check_transformers_fields(raw, where, config.vocab_size)
    # One entry per layer, as transformers requires: a list of another length ran here (the flat
    # model does not read it) and failed later, on the first text prompt, as "the tokenizer cannot
    # be loaded" (AutoTokenizer validates config.json), naming neither this file nor the field.
    layer_types = raw.get("layer_types")
    if layer_types is not None and len(layer_types) != config.num_hidden_layers:
        raise CheckpointError(f"{where}: field 'layer_types' has {len(layer_types)} entries; allowed: one per layer, "
                              f"num_hidden_layers ({config.num_hidden_layers}) of them, or null")
    # The first dense layer, found without a list of every layer: num_hidden_layers 10**9 made one of
    # 24 GB here (the loader's size check refuses such a config, once it is read).
    if not config.is_moe or config.decoder_sparse_step > 1:
        dense = 0
    else:
        dense = min((i for i in config.mlp_only_layers if i < config.num_hidden_layers), default=None)
    if dense is not None and no_dense_width:
        raise CheckpointError(f"{where}: field 'intermediate_size' is missing (allowed: an int > 0; layer "
                              f"{dense} has a dense MLP)")
    return config


def read_config(path) -> ModelConfig:
    """<checkpoint>/config.json -> ModelConfig; never runs checkpoint code."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path}: a file, not a checkpoint directory (the directory holding config.json, "
                              "the safetensors shards and the tokenizer files)")
    if not path.is_dir():
        from pcg_engine.models.presets import PRESETS   # imported here: only this message needs it
        hint = ""
        if str(path) in PRESETS:   # LLM("tiny-qwen3"): the CLI's --model takes preset names, LLM does not
            hint = (f"; {str(path)!r} is a preset name: build it with `pcg make-model --preset {path} --out DIR` "
                    "and pass DIR")
        raise CheckpointError(f"{path}: checkpoint directory does not exist{hint}")
    check_readable(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file}: missing (a Hugging Face checkpoint needs config.json)")
    return parse_config(read_json_object(cfg_file), str(cfg_file))   # one object, no key given twice


def check_readable(path: Path) -> None:
    """A checkpoint directory this user can list and enter. Without that, Path.is_file() on a file
    inside raised a bare PermissionError naming the file it probed (tokenizer.json, config.json),
    not the directory whose mode is the cause (found by a review, as a user without the rights)."""
    try:
        names = os.listdir(path)
        (path / "config.json").exists()       # needs search (x) permission, which listing does not
    except PermissionError as e:
        raise CheckpointError(f"{path}: checkpoint directory cannot be read ({e.strerror}); this user needs "
                              "read and search permission on it (chmod u+rx)") from None
    # A named pipe, socket or device among the files: the tokenizer library's open() of one blocked
    # the load for good, and Path.is_file() called a config.json pipe "missing". A directory holds
    # a few dozen entries at most; one stat each, symlinks followed (a hub snapshot's are).
    for name in names:
        try:
            mode = os.stat(path / name).st_mode
        except OSError:
            continue                          # a dangling link: the file's own reader names it if needed
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise CheckpointError(f"{path / name}: is {kind_of(mode)}; a checkpoint directory holds regular "
                                  "files and folders (reading this one would block the load)")


__all__ = ["ModelConfig", "SUPPORTED", "check_readable", "parse_config", "read_config"]
