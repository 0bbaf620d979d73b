"""Does a full decode graph captured without a warm-up forward replay slower, and why?

    python scripts/graph_warmup_check.py --model M [--bucket 1] [--replays 2000] [--out DIR]

Why: with a warm-up before the largest bucket's capture only (compile/full_graph.py, session 13),
P1's batch-1 full_decode read 0.885-0.886 ms a token against 0.861-0.863 with a warm-up before
every bucket, alternated on one H200. This builds LLM(model, mode="full_decode") as the engine
does (PCG_FULL_GRAPH_WARMUP_EVERY as set), then times GPU replays (CUDA events, back to back) of:
  engine    the bucket's graph as the start-up captured it;
  warm      the bucket recaptured after a warm-up forward;
  cold-ish  recaptured again without one (everything is warm by now);
and writes each recaptured graph's DOT dump (torch's CUDAGraph debug mode) with its node counts
by kind, so a graph with extra nodes shows.

GPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter

import torch

from pcg_engine.bench.common import replay_us


def recapture(graphs, bucket: int, warmups: int, dump: str | None):
    pool = graphs.pool
    try:   # keep the cudaGraph_t after instantiation, for debug_dump (torch >= 2.9)
        graph = torch.cuda.CUDAGraph(keep_graph=bool(dump))
    except TypeError:
        graph = torch.cuda.CUDAGraph()
    if dump:
        graph.enable_debug_mode()
    with torch.inference_mode(), graphs.capture_context():
        graphs._dummy_batch(bucket)
        current = torch.cuda.current_stream()
        pool.stream.wait_stream(current)
        with torch.cuda.stream(pool.stream):
            for _ in range(warmups):
                graphs._forward(bucket)
            graph.capture_begin(pool=pool.pool)
            try:
                graphs._forward(bucket)
            finally:
                graph.capture_end()
        current.wait_stream(pool.stream)
    counts = {}
    if dump:
        try:
            graph.debug_dump(dump)
            text = open(dump).read()
        except Exception as e:   # the timings matter more than the dump
            return graph, {"dump_error": repr(e)}
        kinds = Counter(re.findall(r'\b(KERNEL|MEMSET|MEMCPY|EMPTY|EVENT_RECORD|WAIT_EVENT|HOST)\b', text))
        names = Counter(re.findall(r'\\n(_[A-Za-z0-9_]+kernel)\\n', text))
        counts = {"kinds": dict(kinds), "kernels": dict(names)}
    return graph, counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--bucket", type=int, default=1)
    p.add_argument("--replays", type=int, default=2000)
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    from pcg_engine.llm import LLM
    llm = LLM(args.model, mode="full_decode")
    graphs = llm.engine.runner.full_graphs
    b = args.bucket
    os.makedirs(args.out, exist_ok=True)
    result = {"warm_every_bucket": graphs.warm_every_bucket, "warmup_runs": graphs.warmup_runs, "bucket": b}
    result["engine_us"] = replay_us(graphs.graphs[b], args.replays)
    warm, result["warm_nodes"] = recapture(graphs, b, 1, os.path.join(args.out, f"graph_b{b}_warm.dot"))
    result["warm_us"] = replay_us(warm, args.replays)
    cold, result["nowarm_nodes"] = recapture(graphs, b, 0, os.path.join(args.out, f"graph_b{b}_nowarm.dot"))
    result["nowarm_us"] = replay_us(cold, args.replays)
    result["engine_again_us"] = replay_us(graphs.graphs[b], args.replays)
    print(json.dumps(result, indent=1))
    with open(os.path.join(args.out, "graph_warmup_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
