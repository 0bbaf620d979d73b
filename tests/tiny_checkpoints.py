"""The tiny checkpoints every test layer uses, built once per session under pytest's base temp dir."""

from pathlib import Path


def build_tiny(base: Path, preset: str) -> Path:
    """The tiny checkpoint of `preset` under `base` (built once; later calls find it)."""
    from pcg_engine.models.checkpoint_maker import ensure_checkpoint
    return ensure_checkpoint(preset, Path(base) / "checkpoints" / preset, seed=0)
