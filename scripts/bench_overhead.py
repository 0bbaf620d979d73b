"""Thin wrapper: same as `pcg bench overhead ...` (see pcg_engine/bench/overhead.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # runs from a checkout without installing

from pcg_engine.bench.overhead import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
