"""The tiny checkpoints every test layer uses, built once per session under pytest's base temp dir."""

from pathlib import Path


def build_tiny(base: Path, preset: str) -> Path:
    """The tiny checkpoint of `preset` under `base` (built once; later calls find it)."""
    from pcg_engine.models.checkpoint_maker import ensure_checkpoint
    return ensure_checkpoint(preset, Path(base) / "checkpoints" / preset, seed=0)


def build_tiny_variant(base: Path, name: str, preset: str = "tiny-qwen3-moe", **fields) -> Path:
    """A tiny checkpoint of `preset` with config fields replaced (e.g. num_experts_per_tok=1), under
    `base` as `name` (built once; later calls find it). Weights are drawn for the new shapes."""
    from pcg_engine.models import presets
    from pcg_engine.models.checkpoint_maker import ensure_checkpoint

    spec = presets.get_preset(preset)
    presets.PRESETS[name] = presets.Preset(name, dict(spec.fields, **fields), spec.tokenizer_vocab, spec.tiny)
    try:
        return ensure_checkpoint(name, Path(base) / "checkpoints" / name, seed=0)
    finally:
        del presets.PRESETS[name]
