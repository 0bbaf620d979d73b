"""Host time of one CUDA-graph launch: CUDAGraph.replay() against graph_launch.launcher (the driver's
cuGraphLaunch), for graphs of 1 and of 6 small kernels, alternated.

    python scripts/bench_graph_launch.py [--launches 20000] [--rounds 3] [--json PATH]

The kernels are tiny (a 4 KiB elementwise op), so the GPU keeps up with the host and the loop's wall
time is the host's launch path; the queue is drained every 500 launches so that it never fills.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pcg_engine.compile import graph_launch  # noqa: E402


def capture(kernels: int):
    x = torch.randn(1024, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            x.mul_(0.999)
    return graph, x


def host_us(fn, launches: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(launches):
        fn()
        if i % 500 == 499:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / launches * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    for kernels in (1, 6):
        graph, _ = capture(kernels)
        raw = graph_launch.launcher(graph)
        if raw == graph.replay:
            raise SystemExit("graph_launch.launcher fell back to replay(): no raw launch on this machine")
        host_us(graph.replay, 1000)
        host_us(raw, 1000)
        for r in range(args.rounds):
            for name, fn in (("replay", graph.replay), ("raw", raw)):
                us = host_us(fn, args.launches)
                rows.append(dict(kernels=kernels, method=name, round=r, us_per_launch=us))
                print(f"{kernels} kernel(s), {name:6s} round {r}: {us:.2f} µs a launch")
    for kernels in (1, 6):
        best = {m: min(r["us_per_launch"] for r in rows if r["kernels"] == kernels and r["method"] == m)
                for m in ("replay", "raw")}
        print(f"{kernels} kernel(s): best replay {best['replay']:.2f} µs, raw {best['raw']:.2f} µs, "
              f"saved {best['replay'] - best['raw']:.2f} µs a launch")
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "graph_launch", "torch": torch.__version__,
                                               "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
