"""Where a decode step's host time goes, by wall-clock timers (not cProfile): a diagnostic.

    python scripts/step_timers.py --model /tmp/models/qwen3-0.6b --mode piecewise --requests 1

cProfile's per-call overhead (~1 µs) is the size of what a piecewise step is made of (57 launches
of a few µs), so its shares mislead there. This script instead (1) times --steps plain engine
steps (wall ms a step), (2) wraps the step's phases and, in piecewise mode, every graphed piece and
every eager attention call in perf_counter accumulators and reports µs a step for each (the
wrappers add ~0.2 µs a call; on CUDA a bucket's replay program runs its graphs and launches
without the split module, so only `forward` shows them: PCG_REPLAY_PROGRAM=0 splits them out), (3) on CUDA, times bare loops of one piece's graph replay
(host µs a call, synchronised after the loop) and counts the
synchronisations torch reports during a few steps (torch.cuda.set_sync_debug_mode).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections import defaultdict

import torch

from pcg_engine.bench import common
from pcg_engine.bench.profile import wrap_phases

TIMES: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def timed(fn, label):
    clock = time.perf_counter

    def wrapper(*args, **kwargs):
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[label] += clock() - t0
            CALLS[label] += 1
    return wrapper


def install(engine, split, attention) -> None:
    wrap_phases(engine, lambda fn, phase: timed(fn, "forward(full graph)" if phase == "full_graph" else phase))
    if split is not None:
        for name, value in list(split.__dict__.items()):
            if name.startswith("submod_") and callable(value):
                label = "attention calls" if name in attention else "pieces"
                split.__dict__[name] = timed(value, label)


def _split_module(runner):
    """The split GraphModule of a compiled forward (call before install() wraps forward_fn) and
    the names of its attention submodules."""
    backend = getattr(runner.forward_fn, "backend", None)
    split = getattr(backend, "split_module", None)
    attention = {s.name for s in getattr(backend, "submodules", []) if s.is_splitting_op}
    return split, attention


def run_steps(engine, n: int) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def micro(pool, loops: int) -> dict:
    """Bare host cost of one piece's replay (CUDA only)."""
    out = {}
    pieces = getattr(pool, "pieces", None)
    if not pieces or not torch.cuda.is_available():
        return out
    entry = next((p.entries[b] for p in pieces for b in sorted(p.entries)), None)
    if entry is not None:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(loops):
            entry.graph.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        out["replay_host_us"] = 1e6 * (t1 - t0) / loops
        out["replay_total_us"] = 1e6 * (time.perf_counter() - t0) / loops
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--mode", default="piecewise")
    p.add_argument("--requests", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sync", action="store_true", help="async_scheduling off")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    kw = {"mode": args.mode, "max_num_seqs": max(args.requests, 1)}
    if args.sync:
        kw["async_scheduling"] = False
    llm = common.build_llm(common.resolve_model(args.model), **kw)
    engine = llm.engine
    ids, _, _ = common.add_random_requests(llm, args.requests, args.prompt_len, 4 * args.steps + 100)
    common.step_until_decoding(engine, ids)
    run_steps(engine, 20)
    result = {"mode": engine.runner.mode, "requests": args.requests,
              "plain_ms_per_step": [1e3 * run_steps(engine, args.steps) for _ in range(3)]}

    if torch.cuda.is_available():
        syncs = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(5):
                    engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sorted({str(w.message)[:160] for w in caught})
        result["sync_warnings_in_5_steps"] = len(caught)
        result["sync_kinds"] = syncs

    split, attention = _split_module(engine.runner)
    install(engine, split, attention)
    TIMES.clear()
    CALLS.clear()
    wall = run_steps(engine, args.steps)
    result["timed_ms_per_step"] = 1e3 * wall
    result["us_per_step"] = {k: 1e6 * v / args.steps for k, v in sorted(TIMES.items(), key=lambda kv: -kv[1])}
    result["calls_per_step"] = {k: v / args.steps for k, v in CALLS.items()}
    result.update(micro(getattr(engine.runner, "graph_pool", None), 200))
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
