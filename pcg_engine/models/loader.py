"""Load a Hugging Face Qwen3 / Qwen3-MoE checkpoint directory into the flat model.

The model is built with uninitialised storage on the target device, in its final dtype, and filled
from the safetensors shards streamed through two chunk buffers (models/safetensors_reader.py), so a
large model is never copied whole through host memory. Loading never executes checkpoint code: config.json is read
by the project's own validating reader (models/model_config.py; transformers is not imported on the
start-up path) and pickled `.bin` weights are refused.
Every failure names the file and the tensor or field; a failed load leaves no model behind.
"""

import contextlib
import itertools
import json
import math
import os
import re
from pathlib import Path

import torch

from pcg_engine.config import KERNELS_WITHOUT_FUSE
from pcg_engine.errors import CheckpointError
from pcg_engine.models.fuse import fuse as fuse_model
from pcg_engine.models.json_file import read_json_object
from pcg_engine.models.model_config import ModelConfig, read_config
from pcg_engine.models.qwen3 import Qwen3ForCausalLM
from pcg_engine.models.regular_file import kind_of
from pcg_engine.models.safetensors_reader import DTYPES, read_header, read_into

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)$")
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
FLOAT_DTYPE_NAMES = [name for name, dtype in DTYPES.items() if dtype.is_floating_point]


def load_config(path: Path) -> ModelConfig:
    """config.json through the project's own reader (models/model_config.py): no transformers import."""
    return read_config(path)


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        # One object, no key given twice (models/json_file.py): a tensor mapped to two shards is refused.
        weight_map = read_json_object(index).get("weight_map")
        if weight_map is None:
            raise CheckpointError(f"{index}: invalid index (no 'weight_map')")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names, got "
                                  f"{json.dumps(weight_map)[:80]}")
        files = sorted({path / f for f in weight_map.values()})
        if not files:     # (the size check then blamed config.json for "0 weights")
            raise CheckpointError(f"{index}: weight_map lists no tensor; it maps each tensor name to its shard")
        for f in files:
            # A shard outside the checkpoint ("../x", an absolute path) is not this checkpoint's; one in
            # a folder of it is (transformers loads it; it was refused as "outside").
            # Lexically, not resolved: a hub cache's snapshot holds symlinks into its blobs.
            if not Path(os.path.normpath(f)).is_relative_to(Path(os.path.normpath(path))):
                raise CheckpointError(f"{index}: weight file {f.name!r} ({f}) is outside the checkpoint directory")
            if not f.is_file():
                what = f"is {kind_of(f.stat().st_mode)}" if f.exists() else "missing"
                raise CheckpointError(f"{f}: listed in {index.name} but {what}")
        # transformers reads model.safetensors when there is one and ignores the index: beside an
        # index that names other shards, the two would load different weights from one directory.
        single = path / "model.safetensors"
        if single.is_file() and single not in files:
            raise CheckpointError(f"{path}: holds model.safetensors and {index.name}, whose weight_map does not "
                                  "list it; transformers loads model.safetensors, this loader the index's shards: "
                                  "which weights are meant cannot be told. Remove the one not meant")
        return files
    # As transformers: model.safetensors alone where there is one. Every *.safetensors was read, so a
    # LoRA adapter_model.safetensors or a consolidated copy beside it failed the load.
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if files:
        _check_shard_series(path, files)
        return files
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickled:
        raise CheckpointError(f"{path}: only pickled weights found ({', '.join(pickled)}); they can execute "
                              "code when loaded and are refused. Convert them to safetensors.")
    raise CheckpointError(f"{path}: no *.safetensors weight files")


_SHARD_NAME = re.compile(r"^(.*)-(\d+)-of-(\d+)\.safetensors$")


def _check_shard_series(path: Path, files: list[Path]) -> None:
    """Shards named NAME-0000i-of-0000n without their index: each of the n must be there. One lost in
    a copy was reported as "config.json describes more weights than the files hold" or as missing
    tensors, which blames config.json rather than the missing file."""
    series: dict[tuple[str, str], set[int]] = {}     # (stem, "0000n") -> the i present
    for f in files:
        m = _SHARD_NAME.match(f.name)
        if m:
            series.setdefault((m.group(1), m.group(3)), set()).add(int(m.group(2)))
    for (stem, total), have in sorted(series.items()):
        n = int(total)
        lost = n - len({i for i in have if 1 <= i <= n})
        if lost:
            # The first three gaps, found in at most len(have) + 3 steps (a name may claim 10**11 shards).
            first = itertools.islice((i for i in itertools.count(1) if i not in have), min(lost, 3))
            shown = ", ".join(f"{stem}-{i:0{len(total)}d}-of-{total}.safetensors" for i in first)
            more = f" and {lost - 3} more" if lost > 3 else ""
            raise CheckpointError(f"{path}: shard(s) {shown}{more} missing: the directory holds {n - lost} of the "
                                  f"{n} shards of {stem}-*-of-{total}.safetensors and no "
                                  "model.safetensors.index.json")


class _Targets:
    """Maps checkpoint tensor names to (parameter, slice) and tracks which ones were filled."""

    def __init__(self, model):
        self.params = dict(model.named_parameters())
        self.expected: dict[str, tuple] = {}
        for name, p in self.params.items():
            if name.endswith(".w13"):
                prefix, E, I2 = name[: -len(".w13")], p.shape[0], p.shape[1]
                for e in range(E):
                    self.expected[f"{prefix}.experts.{e}.gate_proj.weight"] = (name, e, slice(0, I2 // 2))
                    self.expected[f"{prefix}.experts.{e}.up_proj.weight"] = (name, e, slice(I2 // 2, I2))
            elif name.endswith(".w2"):
                prefix = name[: -len(".w2")]
                for e in range(p.shape[0]):
                    self.expected[f"{prefix}.experts.{e}.down_proj.weight"] = (name, e, slice(None))
            else:
                self.expected[name] = (name, None, slice(None))
        self.tied = getattr(model, "tie_word_embeddings", False)
        self.filled: set[str] = set()
        self.layouts: dict[str, tuple[str, Path]] = {}   # expert parameter -> first tensor filling it, its shard

    def resolve(self, key: str, file: Path):
        """(parameter name, view) for checkpoint tensor `key` of shard `file`, None to skip, or KeyError."""
        if key in self.expected:
            name, e, rows = self.expected[key]
            p = self.params[name]
            if e is not None:
                self._one_layout(name, key, file)
            return key, (p.data[e][rows] if e is not None else p.data)
        m = _FUSED_EXPERTS.match(key)  # transformers 5's own stacked-experts layout
        if m:
            name = f"{m.group(1)}.{'w13' if m.group(2) == 'gate_up_proj' else 'w2'}"
            if name in self.params:
                self._one_layout(name, key, file)
                return name, self.params[name].data
        if self.tied and key == "lm_head.weight":
            return None
        if key.endswith("rotary_emb.inv_freq"):
            return None
        raise KeyError(key)

    def _one_layout(self, param: str, key: str, file: Path) -> None:
        """An expert weight comes stacked (experts.gate_up_proj) or one module per expert
        (experts.N.gate_proj.weight), not both: both fill the same parameter, and the one read last
        would win without a word."""
        first, first_file = self.layouts.setdefault(param, (key, file))
        if bool(_FUSED_EXPERTS.match(first)) != bool(_FUSED_EXPERTS.match(key)):
            pair = [(first, first_file), (key, file)]
            if not _FUSED_EXPERTS.match(first):
                pair.reverse()
            (stacked, s_file), (single, e_file) = pair
            raise CheckpointError(f"layer {param.rsplit('.', 1)[0]}: its experts are stored in two layouts, "
                                  f"stacked ({stacked!r} in {s_file}) and one module per expert ({single!r} in "
                                  f"{e_file}); a checkpoint stores a layer's experts in one of them")

    def mark(self, key: str):
        if key.endswith(".w13") or key.endswith(".w2"):
            prefix = key.rsplit(".", 1)[0]
            kind = key.rsplit(".", 1)[1]
            names = [k for k, v in self.expected.items() if v[0] == f"{prefix}.{kind}"]
            self.filled.update(names)
        else:
            self.filled.add(key)

    def missing(self) -> list[str]:
        return sorted(set(self.expected) - self.filled)


_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def _check_tied_head(file: Path, entry, config: ModelConfig) -> None:
    """A stored LM head of a tied model is read to be compared with the embedding (which serves as
    the head), or as the embedding where it is stored alone; one of another shape says the
    checkpoint is not what config.json describes."""
    expected = (config.vocab_size, config.hidden_size)
    if entry.name == "lm_head.weight" and entry.shape != expected:
        raise CheckpointError(f"{file}: tensor 'lm_head.weight' has shape {entry.shape}; config.json ties it to "
                              f"the embedding (tie_word_embeddings: true), so it must be absent or of shape "
                              f"[vocab_size, hidden_size] = {expected}")


def config_numel(config: ModelConfig) -> int:
    """How many weights the model built for `config` holds, counted without building it."""
    D, V, L, hd = config.hidden_size, config.vocab_size, config.num_hidden_layers, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    per_layer = 2 * D * q + 2 * D * kv + 2 * hd + 2 * D      # q and o, k and v, q/k norms, the two layer norms
    sparse = 0
    if config.is_moe:
        step = config.decoder_sparse_step
        sparse = L // step - len({i for i in config.mlp_only_layers if i < L and (i + 1) % step == 0})
    moe = config.num_experts * D * (1 + 3 * config.moe_intermediate_size)    # router, experts
    head = 0 if config.tie_word_embeddings else V * D
    return V * D + L * per_layer + (L - sparse) * 3 * D * config.intermediate_size + sparse * moe + D + head


_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _check_size(path: Path, config: ModelConfig, headers: dict) -> None:
    """A config.json asking for far more weights than the files hold is refused before the model
    is built: built first, num_hidden_layers 10**9 hung in the constructor, and a typo'd size
    (vocab_size 10**13, 360 layers for 36) failed in the allocator with a bare RuntimeError or
    torch.OutOfMemoryError. Up to twice the stored count, the model is built and the per-tensor
    checks name the missing or misshapen tensors (a missing lm_head, one layer too many)."""
    stored = sum(math.prod(e.shape) for entries in headers.values() for e in entries)
    wanted = config_numel(config)
    if wanted <= 2 * stored:
        return
    layers = {int(m.group(1)) for entries in headers.values() for e in entries if (m := _LAYER.match(e.name))}
    fields = _SIZE_FIELDS + (("num_experts", "moe_intermediate_size") if config.is_moe else ())
    sizes = ", ".join(f"{f} {getattr(config, f)}" for f in fields)
    raise CheckpointError(f"{path / 'config.json'}: describes a model of {wanted:,} weights ({sizes}), more than "
                          f"twice the {stored:,} its weight files hold ({len(layers)} layers); config.json is not "
                          "of these weights")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _check_finite(model, stored_in: dict) -> None:
    """A NaN or infinite weight (a damaged file, or a value beyond the load dtype's range) made every
    output garbage without a word. One float32 sum a tensor, read back at once (~3 ms for Qwen3-0.6B
    on an H200, docs/PERF.md session 22): a non-finite value makes its sum non-finite. A finite sum
    that overflowed is only a suspect: such tensors are checked element by element before anything
    is refused. Runs under load_model's no_grad."""
    params = list(model.named_parameters())
    if not params:
        return
    sums = torch.stack([torch.sum(p, dtype=torch.float32) for _, p in params])
    suspects = (~torch.isfinite(sums)).nonzero().flatten().tolist()
    for i in suspects:
        name, p = params[i]
        bad = int((~torch.isfinite(p)).sum())
        if bad:
            where = stored_in.get(name, "the checkpoint")
            raise CheckpointError(f"{where}: tensor {name!r} holds {bad} NaN or infinite value(s) of {p.numel()} "
                                  f"(in {p.dtype}, the model's dtype); every output would be garbage. The file is "
                                  "damaged, or its values exceed this dtype's range")


# The model is built, filled, checked, compared and fused with autograd off.
@torch.no_grad()
def load_model(path, device="cpu", dtype=None, fuse: bool = True, kernels: bool | None = None):
    """Checkpoint directory -> ready flat model on `device` (fused unless fuse=False)."""
    if kernels and not fuse:
        raise ValueError(f"kernels: got True; allowed: {KERNELS_WITHOUT_FUSE}")
    path = Path(path)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = load_config(path)
    files = weight_files(path)
    headers = {file: read_header(file) for file in files}
    _check_size(path, config, headers)
    # Built in place: uninitialised storage of the final dtype on the target device (the modules
    # skip their random init; layers.Embedding). Not on the meta device + to_empty: meta tensors'
    # empty_like runs through torch._refs, which imports sympy (1 s of a CPU start-up).
    with torch.device(device), _default_dtype(dtype):
        model = Qwen3ForCausalLM(config)
    targets = _Targets(model)
    stored_in: dict[str, Path] = {}     # tensor name -> its shard: a second copy would overwrite the first
    stored_head = None                  # a tied model's stored lm_head.weight, compared with the embedding
    # A tied model saved under the head's name alone (safetensors' save_model keeps the first name
    # of a shared tensor, here lm_head.weight): that tensor is the embedding, as transformers reads
    # it, and is read straight into it.
    head_is_embedding = not any(e.name == "model.embed_tokens.weight" for entries in headers.values() for e in entries)
    for file in files:
        plan = []
        for entry in headers[file]:
            if entry.name in stored_in:
                raise CheckpointError(f"tensor {entry.name!r} is stored twice, in {stored_in[entry.name]} and in "
                                      f"{file}; a checkpoint holds each tensor in one shard")
            stored_in[entry.name] = file
            try:
                resolved = targets.resolve(entry.name, file)
            except KeyError:
                raise CheckpointError(f"{file}: unexpected tensor {entry.name!r} (not part of "
                                      f"{config.architecture} for this config)") from None
            if resolved is None:
                if entry.name != "lm_head.weight":
                    continue
                # Tied, yet stored: some saves keep a copy of the embedding. One that differs is a
                # head transformers uses (it unties them) where the embedding would serve here: read
                # it, in the model's dtype as transformers compares, to check.
                _check_tied_head(file, entry, config)
                if head_is_embedding:
                    resolved = "model.embed_tokens.weight", model.model.embed_tokens.weight.data
                else:
                    stored_head = torch.empty(entry.shape, dtype=dtype, device=device)
                    resolved = None, stored_head
            name, dest = resolved
            if not entry.dtype.is_floating_point:   # copy_ would convert the integers to floats
                raise CheckpointError(f"{file}: tensor {entry.name!r} is stored as {DTYPE_NAMES[entry.dtype]}; "
                                      f"a weight needs a float dtype (allowed: {', '.join(FLOAT_DTYPE_NAMES)})")
            if entry.shape != tuple(dest.shape):
                keys = " ([vocab_size, hidden_size])" if entry.name in _VOCAB_TENSORS else ""
                raise CheckpointError(f"{file}: tensor {entry.name!r} has shape {entry.shape}, "
                                      f"config.json implies {tuple(dest.shape)}{keys}")
            plan.append((entry, dest, name))
        try:
            read_into(file, [(entry, dest) for entry, dest, _ in plan], device)
        except OSError as e:
            raise CheckpointError(f"{file}: unreadable ({e})") from None
        for _, _, name in plan:
            if name is not None:
                targets.mark(name)
    missing = targets.missing()
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{path}: missing tensors {shown}")
    if stored_head is not None and not torch.equal(stored_head, model.model.embed_tokens.weight):
        raise CheckpointError(f"{stored_in['lm_head.weight']}: tensor 'lm_head.weight' differs from "
                              "'model.embed_tokens.weight', but config.json ties them (tie_word_embeddings: true): "
                              "the embedding would serve as the LM head and the stored head be ignored "
                              "(transformers uses the stored one). Set tie_word_embeddings to false to use it, "
                              "or remove it from the checkpoint")
    del stored_head
    _check_finite(model, stored_in)
    model.eval()
    if fuse:
        fuse_model(model, kernels=device.type == "cuda" if kernels is None else kernels)
    model.checkpoint_path = path
    return model
