#!/usr/bin/env python
"""Write a random-weight Hugging Face checkpoint for a preset.

    python scripts/make_model.py --preset qwen3-0.6b --out /data/qwen3-0.6b --device cuda
"""

import argparse
import sys
from pathlib import Path

# Runs from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pcg_engine.models.checkpoint_maker import add_arguments, run  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        run(args)
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        # As `pcg make-model` and argparse report a bad setting: "error: ..." and exit 2 (the bare
        # message and exit 1 Python gives a SystemExit of text, before).
        print(f"error: {e.code}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
