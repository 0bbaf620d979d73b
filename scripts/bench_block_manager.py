"""Host time of the block manager's batch paths at P4's shape: a decode step in which N running
requests each need one new block while every free block is cached (grow evicts), and one in which
N requests each fill a block (publishing, with its sha256).

    python scripts/bench_block_manager.py --rows 256 --reps 60 [--base-ref HEAD~1]

With --base-ref, block_manager.py and bulk_publish.py of that commit (with this tree's other modules)
run in the same process, alternated with this tree's, on identical set-ups: the comparison holds
however fast the machine runs at the moment (docs/PERF.md, session 16: this host's CPU speed changes within seconds).
Prints min and median microseconds per call.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from pcg_engine.engine import block_manager as this_tree  # noqa: E402

BS = 16


def source_module(ref: str, name: str):
    """pcg_engine/engine/<name>.py as it was at `ref`, as a module of its own."""
    src = subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:pcg_engine/engine/{name}.py"],
                         capture_output=True, text=True, check=True).stdout
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(f"{name}_{ref}", loader=None))
    exec(compile(src, f"{ref}:{name}.py", "exec"), module.__dict__)
    return module


def module_at(ref: str):
    """block_manager.py as it was at `ref`, calling bulk_publish.py's publish_rows as it was there too."""
    module = source_module(ref, "block_manager")
    module.publish_rows = source_module(ref, "bulk_publish").publish_rows
    return module


def grow_case(mod, n: int):
    """n requests holding one block each; every other free block published and freed (cached)."""
    m = mod.BlockManager(4096, BS, True)
    rids = [f"r{i}" for i in range(n)]
    for rid in rids:
        m._tables[rid] = [m._pop_free()]
    cached = [m._pop_free() for _ in range(m.num_free_blocks)]
    for i, block_id in enumerate(cached):
        block = m.blocks[block_id]
        block.hash, block.ref_count = i.to_bytes(32, "little"), 0
        m._hash_to_block[block.hash] = block_id
        m._free_cached[block_id] = None
    return lambda: m.grow(rids, [1] * n)


def publish_case(mod, n: int):
    """n requests each with two published blocks and a third just filled, rows of one token array."""
    m = mod.BlockManager(4096, BS, True)
    tokens = np.random.default_rng(0).integers(0, 150_000, size=(n, 64 * BS), dtype=np.int64)
    requests = []
    for i in range(n):
        rid = f"r{i}"
        m._tables[rid] = [m._pop_free() for _ in range(4)]
        m._hashes[rid] = [bytes(32), bytes(32)]
        requests.append(SimpleNamespace(request_id=rid))
    rows, num_full = np.arange(n), np.full(n, 3)
    return lambda: m.cache_full_blocks_rows(requests, tokens, rows, num_full)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--base-ref", default=None, help="a commit whose block manager runs alternated with this tree's")
    args = p.parse_args(argv)
    trees = {"this tree": this_tree}
    if args.base_ref:
        trees = {args.base_ref: module_at(args.base_ref), **trees}
    for case_name, case in (("grow, evicting", grow_case), ("publish", publish_case)):
        times = {name: [] for name in trees}
        for _ in range(args.reps):
            for name, mod in trees.items():
                call = case(mod, args.rows)
                t0 = time.perf_counter()
                call()
                times[name].append((time.perf_counter() - t0) * 1e6)
        for name, ts in times.items():
            print(f"{case_name:16s} {args.rows} rows, {name:>10s}: min {min(ts):7.1f} us, "
                  f"median {statistics.median(ts):7.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
