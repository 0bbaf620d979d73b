"""Write a Hugging Face checkpoint directory with random weights for a preset.

The output is what a hub download would hold: config.json, generation_config.json, tokenizer
files and safetensors weights under the exact parameter names of Qwen3ForCausalLM /
Qwen3MoeForCausalLM (MoE experts one module per expert, as the published Qwen3-MoE files store
them; transformers 5 fuses them into 3-D tensors only when it loads).

Tensors are generated one at a time and a shard is written as soon as it is full, so the 60 GB
30B-A3B preset needs about one shard of memory. Each tensor has its own generator seeded from
(seed, name): its values do not depend on the shard size or on which other tensors exist.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from pcg_engine.cache_home import cache_home
from pcg_engine.errors import ConfigError
from pcg_engine.models import presets, tokenizer_maker

DEFAULT_PRESET = "tiny-qwen3"
_CHUNK_ELEMENTS = 1 << 26  # bounds the float32 scratch when filling a large tensor

# Tiny models: weights of std TINY_GAIN / sqrt(fan_in) make each block's output outweigh the
# embedding it adds to, so the tied LM head does not just echo the input token, and an embedding of
# std TINY_EMBED_STD puts the final logits at std ~ TINY_EMBED_STD * sqrt(hidden) (~4): one clear
# winner per step, rarely a near-tie that rounding on another device could flip. The router gets a
# larger gain for the same reason: top-k expert choice must not hinge on the last bits.
TINY_GAIN = 2.5
TINY_EMBED_STD = 1.5
TINY_ROUTER_GAIN = 6.0
TINY_NORM_NOISE = 0.1  # norms are 1 + noise so a dropped or swapped norm weight changes outputs
LARGE_STD = 0.02


def tensor_specs(fields: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every checkpoint tensor in file order; kind picks the init."""
    h, heads, kv = fields["hidden_size"], fields["num_attention_heads"], fields["num_key_value_heads"]
    hd, vocab = fields["head_dim"], fields["vocab_size"]
    specs = [("model.embed_tokens.weight", (vocab, h), "embed")]
    for i in range(fields["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (h,), "norm"),
            (p + "self_attn.q_proj.weight", (heads * hd, h), "linear"),
            (p + "self_attn.k_proj.weight", (kv * hd, h), "linear"),
            (p + "self_attn.v_proj.weight", (kv * hd, h), "linear"),
            (p + "self_attn.o_proj.weight", (h, heads * hd), "linear"),
            (p + "self_attn.q_norm.weight", (hd,), "norm"),
            (p + "self_attn.k_norm.weight", (hd,), "norm"),
            (p + "post_attention_layernorm.weight", (h,), "norm"),
        ]
        if _is_sparse_layer(fields, i):
            inter = fields["moe_intermediate_size"]
            specs.append((p + "mlp.gate.weight", (fields["num_experts"], h), "router"))
            for e in range(fields["num_experts"]):
                specs += _mlp_specs(f"{p}mlp.experts.{e}.", h, inter)
        else:
            specs += _mlp_specs(p + "mlp.", h, fields["intermediate_size"])
    specs.append(("model.norm.weight", (h,), "norm"))
    if not fields["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (vocab, h), "head"))
    return specs


def _mlp_specs(prefix: str, hidden: int, inter: int) -> list:
    return [
        (prefix + "gate_proj.weight", (inter, hidden), "linear"),
        (prefix + "up_proj.weight", (inter, hidden), "linear"),
        (prefix + "down_proj.weight", (hidden, inter), "linear"),
    ]


def _is_sparse_layer(fields: dict, i: int) -> bool:
    # Qwen3MoeDecoderLayer's rule for choosing a sparse block over a dense MLP.
    return (
        fields.get("num_experts", 0) > 0
        and i not in fields.get("mlp_only_layers", [])
        and (i + 1) % fields.get("decoder_sparse_step", 1) == 0
    )


def _seed_for(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def make_tensor(name: str, shape: tuple, kind: str, tiny: bool, seed: int,
                dtype: torch.dtype, device: str) -> torch.Tensor:
    """One tensor's deterministic random values (float32 draws, rounded once to `dtype`)."""
    gen = torch.Generator(device=device).manual_seed(_seed_for(seed, name))
    if kind == "norm":
        mean, std = 1.0, (TINY_NORM_NOISE if tiny else LARGE_STD)
    elif not tiny:
        mean, std = 0.0, LARGE_STD
    elif kind in ("embed", "head"):
        mean, std = 0.0, TINY_EMBED_STD
    else:
        gain = TINY_ROUTER_GAIN if kind == "router" else TINY_GAIN
        mean, std = 0.0, gain / math.sqrt(shape[-1])
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(-1)
    for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
        n = min(_CHUNK_ELEMENTS, flat.numel() - start)
        draw = torch.randn(n, generator=gen, device=device, dtype=torch.float32)
        draw.mul_(std)
        if mean:
            draw.add_(mean)
        flat[start:start + n] = draw
    return out


def parse_size(size: int | str) -> int:
    """Bytes in '2GB' / '500MB' / '10KiB' / 1000 (decimal units as transformers reads them)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ConfigError("max_shard_size", f"expected e.g. '2GB', '500MB' or bytes, got {size!r}")
    unit = (m.group(2) or "B").upper()
    power = " KMGT".index(unit[0]) if unit != "B" else 0
    base = 1024 if "I" in unit else 1000
    return int(float(m.group(1)) * base**power)


def plan_shards(specs: list, dtype: torch.dtype, max_bytes: int) -> list[list]:
    """Group specs into shards as transformers does: close a shard before it would overflow."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards, current, used = [], [], 0
    for spec in specs:
        nbytes = math.prod(spec[1]) * itemsize
        if current and used + nbytes > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(spec)
        used += nbytes
    if current:
        shards.append(current)
    return shards


def make_checkpoint(preset: str, out_dir: str | os.PathLike, seed: int = 0,
                    max_shard_size: int | str = "2GB", dtype: str | None = None,
                    device: str = "cpu", num_layers: int | None = None) -> Path:
    """Write a complete checkpoint for `preset` into `out_dir` and return its path; `num_layers`:
    only the preset's first layers (presets.preset_fields). A tensor's values depend on its name
    only, so those layers are the whole preset's."""
    spec = presets.get_preset(preset)
    fields = presets.preset_fields(preset, num_layers)
    dtype_name = presets.resolve_dtype(spec, dtype)
    torch_dtype = getattr(torch, dtype_name)
    max_bytes = parse_size(max_shard_size)
    if max_bytes <= 0:
        # ('0.5B' parses, to 0 bytes: "must be positive, got '0.5B'" read as a refusal of 0.5)
        raise ConfigError("max_shard_size", f"must be at least 1 byte, got {max_shard_size!r} ({max_bytes} bytes)")
    if not isinstance(seed, int) or seed < 0:
        raise ConfigError("seed", f"must be a non-negative integer, got {seed!r}")
    _check_device(device)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Everything is written aside, in a hidden directory inside `out` (the same file system, and a
    # place we may write), and moved in only once complete: a run that fails part way (disk full,
    # Ctrl-C) leaves what `out` held untouched. Before, an --overwrite run that failed left the
    # old shards deleted and the new config beside half the new weights.
    staging = Path(tempfile.mkdtemp(prefix=".make-model-", dir=out))
    try:
        config = presets.config_json(preset, dtype_name, num_layers)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _write_generation_config(staging)
        tokenizer_maker.save_tokenizer(staging, spec.tokenizer_vocab, config["max_position_embeddings"])
        _write_weights(staging, tensor_specs(fields), spec.tiny, seed, torch_dtype, device, max_bytes)
        _move_in(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


_SHARD_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")


def _move_in(staging: Path, out: Path) -> None:
    """Replace `out`'s checkpoint files by the complete set written in `staging`: renames within one
    file system, no data written, so nothing here runs out of space or takes long."""
    new = sorted(p.name for p in staging.iterdir())
    # A re-run with another shard count must not leave shards (or an index) of the previous run behind.
    # Only a checkpoint's weight names: the glob model*.safetensors* also took the user's
    # "model_notes.safetensors.md" and "model.safetensors.index.json.bak" (found by probing).
    for stale in out.iterdir():
        if _SHARD_FILE.fullmatch(stale.name) and stale.name not in new and stale.is_file():
            stale.unlink()
    for name in new:
        os.replace(staging / name, out / name)


def _check_device(device: str) -> None:
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ConfigError("device", f"expected 'cpu' or 'cuda[:N]', got {device!r}") from exc
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "'cuda' asked for but this machine has no CUDA device")
    if kind not in ("cpu", "cuda"):
        raise ConfigError("device", f"expected 'cpu' or 'cuda[:N]', got {device!r}")


def _write_generation_config(out: Path) -> None:
    from transformers import GenerationConfig

    ids = tokenizer_maker.special_token_ids()
    # Greedy by default (tests compare tokens); eos is a list, as in Qwen3's own file.
    GenerationConfig(
        bos_token_id=ids["bos_token_id"],
        eos_token_id=[ids["eos_token_id"], ids["pad_token_id"]],
        pad_token_id=ids["pad_token_id"],
        do_sample=False,
    ).save_pretrained(str(out))


def _write_weights(out: Path, specs: list, tiny: bool, seed: int, dtype: torch.dtype,
                   device: str, max_bytes: int) -> None:
    shards = plan_shards(specs, dtype, max_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total = {}, 0
    for filename, shard in zip(names, shards):
        tensors = {}
        for name, shape, kind in shard:
            t = make_tensor(name, shape, kind, tiny, seed, dtype, device).cpu()
            tensors[name] = t
            weight_map[name] = filename
            total += t.numel() * t.element_size()
        save_file(tensors, str(out / filename), metadata={"format": "pt"})
        # safetensors creates files owner-only; a shared model cache needs them readable.
        os.chmod(out / filename, 0o644)
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def default_model_dir() -> Path:
    """Per-user cache path of the default tiny model, keyed by everything that shapes its bytes."""
    import tokenizers
    import transformers

    key = hashlib.sha256()
    for module in (presets, tokenizer_maker, sys.modules[__name__]):
        key.update(Path(module.__file__).read_bytes())
    # The tokenizer corpus is this Python's stdlib source; config.json is transformers' output.
    key.update(f"{sys.version_info[:2]}|{tokenizers.__version__}|{transformers.__version__}".encode())
    return cache_home() / "models" / f"{DEFAULT_PRESET}-{key.hexdigest()[:12]}"


def ensure_checkpoint(preset: str, final: Path, seed: int = 0, device: str = "cpu") -> Path:
    """The checkpoint of `preset` at `final`, built there on first use; later calls return it."""
    final = Path(final)
    if (final / "config.json").exists():
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        # Build aside and rename: a reader never sees a half-written directory, and two processes
        # racing to build both succeed (the loser discards its copy).
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    except OSError as e:     # XDG_CACHE_HOME a file, a read-only home: one line, not a traceback
        raise _unwritable_model_cache(preset, final, e) from None
    try:
        make_checkpoint(preset, tmp, seed=seed, device=device)
        os.rename(tmp, final)
    except OSError as e:
        if not (final / "config.json").exists():
            raise _unwritable_model_cache(preset, final, e) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _unwritable_model_cache(preset: str, final: Path, error: OSError) -> ConfigError:
    return ConfigError("model", f"the {preset} checkpoint is built on first use in {final.parent} (the user cache: "
                                f"$XDG_CACHE_HOME, else ~/.cache), which cannot be written: "
                                f"{error.strerror or error} ({error.filename or final.parent}); set XDG_CACHE_HOME "
                                f"to a writable directory, or give a checkpoint directory as the model")


def ensure_default_model() -> Path:
    """Build the default tiny model on first use; later calls return the cached directory."""
    return ensure_checkpoint(DEFAULT_PRESET, default_model_dir())


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--preset", required=True, choices=sorted(presets.PRESETS))
    parser.add_argument("--out", required=True, help="output checkpoint directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default="2GB", help="e.g. 2GB, 500MB (default 2GB)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                        help="weight dtype (default: the preset's, bf16 for published shapes)")
    parser.add_argument("--device", default="cpu", help="where random values are drawn: cpu|cuda")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="only the preset's first N layers, each at its published shape: a per-layer "
                             "benchmark of a model whose checkpoint does not fit the disk (default: all)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a directory that is not empty (its config, tokenizer and model*.safetensors "
                             "files are replaced or deleted)")
    return parser


def run(args: argparse.Namespace) -> Path:
    """`pcg make-model`: a bad setting or an output directory that cannot be written is reported
    by name in one line, not as a traceback."""
    if not str(args.out).strip():
        raise SystemExit("pcg make-model: --out: is empty; give the checkpoint directory to write")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise SystemExit(f"pcg make-model: --out: {args.out} exists and is not a directory")
    # A directory with files in it may hold someone's own checkpoint: its config would be replaced
    # and its model*.safetensors shards deleted (a stale shard must not outlive a re-run).
    if out.is_dir() and any(out.iterdir()) and not getattr(args, "overwrite", False):
        raise SystemExit(f"pcg make-model: --out: {args.out} is not empty; give a new or empty directory, "
                         "or --overwrite to replace its checkpoint files")
    existed = out.exists()
    fresh = not existed or not any(out.iterdir())     # nothing of anyone's in it yet
    try:
        path = make_checkpoint(args.preset, args.out, seed=args.seed, max_shard_size=args.max_shard_size,
                               dtype=args.dtype, device=args.device, num_layers=getattr(args, "num_layers", None))
    except BaseException as e:
        # make_checkpoint removed what it had written aside; a directory it created for a new --out
        # goes too (a re-run must not be refused as "not empty"), an empty one is emptied again.
        # With --overwrite the old checkpoint files were not touched (they are replaced only once
        # the new set is complete).
        if fresh and out.is_dir():
            if existed:
                for child in out.iterdir():      # the directory stays, empty as it was given
                    if child.is_dir():
                        shutil.rmtree(child, ignore_errors=True)
                    else:
                        child.unlink(missing_ok=True)
            else:
                shutil.rmtree(out, ignore_errors=True)
        if isinstance(e, ConfigError):
            # the flag the user typed, as generate and bench name theirs: "--seed (seed): ..."
            from pcg_engine.cli import _name_the_flag
            raise SystemExit(f"pcg make-model: {_name_the_flag(e, lambda field: hasattr(args, field))}") from None
        if isinstance(e, OSError):
            raise SystemExit(f"pcg make-model: --out: cannot write the checkpoint in {args.out}: "
                             f"{e.strerror or e}") from None
        raise
    print(path)
    return path
