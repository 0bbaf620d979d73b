"""The tiny checkpoints every test layer uses, built once per session under pytest's base temp dir."""

import os
import shutil
from pathlib import Path


def build_tiny(base: Path, preset: str) -> Path:
    """The tiny checkpoint of `preset` under `base` (built once; later calls find it)."""
    from pcg_engine.models.checkpoint_maker import make_checkpoint

    final = Path(base) / "checkpoints" / preset
    if not (final / "config.json").exists():
        # Build aside, then rename: an interrupted build never looks finished.
        tmp = final.with_name(final.name + ".building")
        shutil.rmtree(tmp, ignore_errors=True)
        make_checkpoint(preset, tmp, seed=0)
        os.rename(tmp, final)
    return final
