"""Thin wrapper: same as `pcg bench overhead ...` (see pcg_engine/bench/overhead.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # runs from a checkout without installing

from pcg_engine.cli import main  # noqa: E402

if __name__ == "__main__":
    # through the CLI: a refused setting is one error line and exit 2, as `pcg bench` gives (the
    # bare main() let an engine ConfigError out as a traceback)
    sys.exit(main(["bench", "overhead", *sys.argv[1:]]))
