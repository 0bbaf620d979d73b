"""Host cost of capturing one piece graph, split by phase, and of the variants that could cut it.

    python scripts/bench_capture.py [--graphs 400] [--json PATH]

Why: a warm P5 start spends 2-3.4 s capturing ~440 graphs (full_and_piecewise, Qwen3-0.6B), ~5-7
ms a graph, although a piece is a handful of kernels. Session 4's cProfile of a start put ~2.5 ms
a graph in CUDAGraph.capture_begin and as much in capture_end. This script captures a stand-in
piece (six kernels: two GEMMs, a norm, an activation, adds) many times into one shared pool, the
way compile/cuda_graph.py does, and times each phase per capture, in order, so that a cost that
grows with the number of graphs already in the pool shows in the quarters. Variants:

  engine       compile/cuda_graph.capture as the engine calls it (warm-up, begin, run, end)
  no_warmup    the same without the warm-up run
  synced       torch.cuda.synchronize() before capture_begin (is begin waiting for the GPU?)
  thread_local capture_error_mode="thread_local"
  relaxed      capture_error_mode="relaxed"
  keep_graph   CUDAGraph(keep_graph=True): capture_end without instantiate, instantiate timed alone
  own_pool     each graph in a pool of its own (is the shared pool's size the cost?)

With --engine MODEL, the engine's own captures are timed instead: compile/cuda_graph.capture (which
the piece graphs and the full decode graphs both call) is replaced by an instrumented copy, an LLM
is built in full_and_piecewise twice (the second start finds the compile caches warm), once with
capture as it is and once with torch.cuda.synchronize() before each capture_begin (timed apart:
a begin that waits for the GPU's queue moves into the sync), and with the engine alive the stand-in
variants above run again (is it the engine's state that makes a begin slow?).

GPU only. Prints one table (µs a capture, by phase and by quarter of the captures) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pcg_engine.compile.cuda_graph import GraphPool, capture


def make_piece(tokens: int, hidden: int, device):
    w1 = torch.randn(hidden, 3 * hidden, device=device, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(3 * hidden, hidden, device=device, dtype=torch.bfloat16) * 0.02
    norm = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)

    def piece(x):
        h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * norm
        y = h @ w1
        y = torch.nn.functional.silu(y) * y
        return y @ w2 + x

    return piece, x


def run_variant(name: str, n: int, tokens: int, hidden: int) -> dict:
    device = torch.device("cuda")
    pool = GraphPool(device)
    piece, x = make_piece(tokens, hidden, device)
    phases = {"warmup": [], "begin": [], "run": [], "end": [], "instantiate": [], "replay": [], "total": []}
    mode = {"thread_local": "thread_local", "relaxed": "relaxed"}.get(name, "global")
    graphs = []
    current = torch.cuda.current_stream(device)
    torch.cuda.synchronize()
    for _ in range(n):
        t_start = time.perf_counter()
        if name == "engine":
            t0 = time.perf_counter()
            graph, out = capture(pool, piece, x)
            phases["run"].append(time.perf_counter() - t0)
        else:
            graph = torch.cuda.CUDAGraph(keep_graph=True) if name == "keep_graph" else torch.cuda.CUDAGraph()
            handle = torch.cuda.graph_pool_handle() if name == "own_pool" else pool.pool
            pool.stream.wait_stream(current)
            with torch.cuda.stream(pool.stream):
                t0 = time.perf_counter()
                if name != "no_warmup":
                    piece(x)
                t1 = time.perf_counter()
                if name == "synced":
                    torch.cuda.synchronize()
                graph.capture_begin(pool=handle, capture_error_mode=mode)
                t2 = time.perf_counter()
                out = piece(x)
                t3 = time.perf_counter()
                graph.capture_end()
                t4 = time.perf_counter()
                if name == "keep_graph":
                    graph.instantiate()
                t5 = time.perf_counter()
            current.wait_stream(pool.stream)
            phases["warmup"].append(t1 - t0)
            phases["begin"].append(t2 - t1)
            phases["run"].append(t3 - t2)
            phases["end"].append(t4 - t3)
            phases["instantiate"].append(t5 - t4)
        t6 = time.perf_counter()
        graph.replay()
        phases["replay"].append(time.perf_counter() - t6)
        phases["total"].append(time.perf_counter() - t_start)
        graphs.append((graph, out))
    torch.cuda.synchronize()
    # Steady replay cost of one of them, for scale.
    g = graphs[len(graphs) // 2][0]
    t0 = time.perf_counter()
    for _ in range(200):
        g.replay()
    replay_us = (time.perf_counter() - t0) / 200 * 1e6
    torch.cuda.synchronize()
    q = max(n // 4, 1)
    row = {"variant": name, "graphs": n, "steady_replay_us": replay_us}
    for phase, values in phases.items():
        if values:
            row[f"{phase}_us"] = statistics.mean(values) * 1e6
    row["total_us_by_quarter"] = [statistics.mean(phases["total"][i:i + q]) * 1e6 for i in range(0, n, q)][:4]
    del graphs
    pool.release()
    return row


def _instrumented_capture(records: list, synced: bool):
    """compile/cuda_graph.capture with each phase timed into records (one dict a capture)."""
    def capture_timed(pool, fn, *args, warmups: int = 1):
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(pool.device)
        pool.stream.wait_stream(current)
        with torch.cuda.stream(pool.stream):
            t0 = time.perf_counter()
            for _ in range(warmups):
                fn(*args)
            t1 = time.perf_counter()
            if synced:
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            graph.capture_begin(pool=pool.pool)
            t3 = time.perf_counter()
            try:
                outputs = fn(*args)
            finally:
                t4 = time.perf_counter()
                graph.capture_end()
            t5 = time.perf_counter()
        current.wait_stream(pool.stream)
        records.append({"kind": "full" if warmups > 1 else "piece", "warmup": t1 - t0, "sync": t2 - t1,
                        "begin": t3 - t2, "run": t4 - t3, "end": t5 - t4})
        return graph, outputs
    return capture_timed


def run_engine(model: str, synced: bool) -> dict:
    from pcg_engine.compile import cuda_graph, full_graph
    from pcg_engine.llm import LLM
    records: list = []
    original = cuda_graph.capture
    cuda_graph.capture = full_graph.capture = _instrumented_capture(records, synced)
    try:
        t0 = time.perf_counter()
        llm = LLM(model, mode="full_and_piecewise")
        build_s = time.perf_counter() - t0
    finally:
        cuda_graph.capture = full_graph.capture = original
    timings = dict(llm.engine.runner.timings)
    row = {"variant": f"engine {'synced' if synced else 'as is'}", "build_s": build_s,
           "capture_s": timings.get("capture_s"), "saved_trace_loaded": timings.get("saved_trace_loaded")}
    for kind in ("piece", "full"):
        rs = [r for r in records if r["kind"] == kind]
        row[kind] = {"captures": len(rs), **{f"{k}_ms_total": 1e3 * sum(r[k] for r in rs)
                                             for k in ("warmup", "sync", "begin", "run", "end")}}
        row[kind]["begin_ms_max"] = 1e3 * max((r["begin"] for r in rs), default=0.0)
    return row, llm


def main_engine(args) -> int:
    rows = []
    for synced in (False, True):
        row, llm = run_engine(args.engine, synced)
        rows.append(row)
        if synced:   # the stand-in's captures with this engine alive
            rows.append({"alive": [run_variant(v, 100, args.tokens, args.hidden) for v in ("engine", "synced", "no_warmup")]})
        llm.close()
        del llm
    for r in rows:
        if "alive" in r:
            for a in r["alive"]:
                print(f"  stand-in {a['variant']:10} with the engine alive: begin {a.get('begin_us', float('nan')):.0f} µs, "
                      f"end {a.get('end_us', float('nan')):.0f} µs, total {a['total_us']:.0f} µs")
            continue
        print(f"{r['variant']}: build {r['build_s']:.2f} s, capture_s {r['capture_s']:.2f} (trace loaded {r['saved_trace_loaded']})")
        for kind in ("piece", "full"):
            k = r[kind]
            print(f"  {kind:5} {k['captures']:4} captures, ms in total: warm-up {k['warmup_ms_total']:.0f}, "
                  f"sync {k['sync_ms_total']:.0f}, begin {k['begin_ms_total']:.0f} (max {k['begin_ms_max']:.1f}), "
                  f"run {k['run_ms_total']:.0f}, end {k['end_ms_total']:.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "capture_engine", "model": args.engine, "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graphs", type=int, default=400)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--variants", default="engine,no_warmup,synced,thread_local,relaxed,keep_graph,own_pool")
    p.add_argument("--json", default=None)
    p.add_argument("--engine", default=None, metavar="MODEL", help="time the engine's captures (module docstring)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_capture.py needs a CUDA device")
    if args.engine:
        return main_engine(args)
    # One untimed round first: lazy module loading, cuBLAS handles, the allocator's first segments.
    run_variant("engine", 20, args.tokens, args.hidden)
    rows = [run_variant(v.strip(), args.graphs, args.tokens, args.hidden) for v in args.variants.split(",")]
    cols = ["warmup_us", "begin_us", "run_us", "end_us", "instantiate_us", "replay_us", "total_us", "steady_replay_us"]
    print(f"{'variant':14}" + "".join(f"{c[:-3]:>12}" for c in cols) + "   total by quarter (µs)")
    for r in rows:
        print(f"{r['variant']:14}" + "".join(f"{r.get(c, float('nan')):12.1f}" for c in cols)
              + "   " + " / ".join(f"{v:.0f}" for v in r["total_us_by_quarter"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "capture", "torch": torch.__version__, "device": torch.cuda.get_device_name(),
                       "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
