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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
