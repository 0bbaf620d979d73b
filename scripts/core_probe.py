"""Is the host slow on some CPU cores? bench/cpu_probe.py's fixed host work on each core in turn.

    python scripts/core_probe.py --sweeps 3 --json cores.json

Session 16 found that fresh bare processes on the H200 host (a 16-vCPU KVM guest) run the probe's
Python at one of two speeds, ~3.7 or ~7.5-8.7 ms, ten processes each out of twenty. If the speed
belongs to the vCPU (say, one whose physical core a neighbour shares), each core reads the same
in every sweep and a thread pinned to a fast core stays fast; if it moves over time, the sweeps
disagree. Prints one row a core: its median in each sweep.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pcg_engine.bench import cpu_probe  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweeps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    allowed = sorted(os.sched_getaffinity(0))
    table = {c: [] for c in allowed}
    try:
        for _ in range(args.sweeps):
            for c in allowed:
                os.sched_setaffinity(0, {c})
                table[c].append(cpu_probe.probe(repeats=args.repeats))
    finally:
        os.sched_setaffinity(0, allowed)
    print("core  python median us per sweep            torch median us per sweep")
    for c, runs in table.items():
        print(f"{c:4d}  " + " ".join(f"{r['python_median_us']:7.0f}" for r in runs) + "    "
              + " ".join(f"{r['torch_median_us']:7.0f}" for r in runs))
    if args.json:
        Path(args.json).write_text(json.dumps({"cores": {str(c): runs for c, runs in table.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
