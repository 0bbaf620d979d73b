"""Where one decode step's time goes, for a given mode and batch: Python (cProfile) and GPU kernels.

    python scripts/host_profile.py --model /tmp/models/qwen3-0.6b --mode piecewise --requests 1

Runs the engine until every request decodes, then (1) cProfile over --steps decode steps, printing the
functions with the most own time (host cost per step = the printed time / steps), and (2) on CUDA,
torch.profiler over the same number of steps, printing the kernels by total GPU time with their
count per step (kernels replayed inside CUDA graphs are listed one by one). A diagnostic to decide
what to optimise, not a benchmark: cProfile inflates Python time, so compare shares, not absolutes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from pcg_engine.bench import common


def restart(engine, ids, prompts, params) -> list:
    """Abort the requests, let the engine drain, add the prompts again: the prefill phase anew."""
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return [engine.add_request(pr, params) for pr in prompts]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint directory or preset name")
    p.add_argument("--mode", default="piecewise")
    p.add_argument("--requests", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--sync", action="store_true", help="async_scheduling off")
    p.add_argument("--prof-out", default=None, help="write the cProfile stats here")
    p.add_argument("--phase", choices=["decode", "prefill"], default="decode",
                   help="prefill: profile the first --steps steps after adding every request (chunked prefill "
                        "mixed with the decodes of requests already in), as P2's start does")
    args = p.parse_args(argv)

    kw = {"mode": args.mode, "max_num_seqs": max(args.requests, 1)}
    if args.sync:
        kw["async_scheduling"] = False
    llm = common.build_llm(common.resolve_model(args.model), **kw)
    engine = llm.engine
    ids, prompts, params = common.add_random_requests(llm, args.requests, args.prompt_len, 3 * args.steps + 40)
    if args.phase == "prefill":   # warm the same step shapes up once, then start over
        for _ in range(args.steps):
            engine.step()
        ids = restart(engine, ids, prompts, params)
    if args.phase == "decode":
        common.step_until_decoding(engine, ids)
        for _ in range(10):
            engine.step()

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    prof.disable()
    wall = time.perf_counter() - t0
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s).sort_stats("tottime")
    stats.print_stats(args.top)
    print(f"=== cProfile, mode {engine.runner.mode}, {args.requests} requests, {args.phase}, {args.steps} steps "
          f"(own time; wall {1000 * wall / args.steps:.2f} ms/step under cProfile)")
    print(s.getvalue())
    if args.prof_out:
        stats.dump_stats(args.prof_out)

    if torch.cuda.is_available():
        if args.phase == "prefill":
            ids = restart(engine, ids, prompts, params)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as tp:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
        totals: dict[str, list] = {}
        for ev in tp.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                t = totals.setdefault(ev.name, [0, 0.0])
                t[0] += 1
                t[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        rows = sorted(totals.items(), key=lambda kv: -kv[1][1])
        all_us = sum(v[1] for _, v in rows)
        n_all = sum(v[0] for _, v in rows)
        print(f"=== GPU kernels per step: {n_all / args.steps:.0f}, GPU µs per step {all_us / args.steps:.1f}")
        for name, (n, us) in rows[:args.top]:
            print(f"{us / args.steps:9.1f} µs/step {n / args.steps:6.1f}/step {us / n:7.2f} µs each  {name[:110]}")
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
