"""Host cost of one eager forward as the full decode graphs capture it, and Triton's launch path's share.

    python scripts/forward_host.py --model M [--buckets 1,8,64,256] [--iters 20] [--json PATH]

Why: a warm P5 start runs the eager model ~70 times at capture (a warm-up and the captured run per
full decode bucket), ~14 ms of host a forward for Qwen3-0.6B (session 12, scripts/bench_capture.py
--engine), and eager mode decodes at ~10 ms a token. About 190 of a forward's launches go through
Triton's JIT (`JITFunction.run`: the binder, the specialisation key, launch metadata), and only its
last call is the C launcher. Before making those launches cheaper, this says how much of a forward
they are: per bucket, the forward's host ms (synchronised after each forward, so the GPU never
holds the host back), then the same with `JITFunction.run` and the nvidia launcher's `__call__`
wrapped in perf_counter timers: ms inside the JIT (launcher included) and inside the launcher, with
the launches counted by kernel. What a direct launch could save is about JIT - launcher.

GPU only. Builds LLM(model, mode="full_decode") and times `full_graphs.dummy_forward(bucket)`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter

import torch


@torch.inference_mode()   # as capture_all runs them (outside it every op would also record autograd state)
def _time_forwards(graphs, bucket: int, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graphs.dummy_forward(bucket)
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return times


class _Timers:
    """JITFunction.run and the launcher's __call__, wrapped with perf_counter accumulators."""

    def __init__(self):
        from triton.runtime.jit import JITFunction
        self.JITFunction = JITFunction
        self.launcher_cls = None
        try:
            from triton.backends.nvidia.driver import CudaLauncher
            self.launcher_cls = CudaLauncher
        except ImportError:
            pass
        self.jit_s = 0.0
        self.launch_s = 0.0
        self.by_kernel: Counter = Counter()

    def __enter__(self):
        self.run = self.JITFunction.run
        self.JITFunction.run = self._timed(self.run, "jit_s", count=True)
        if self.launcher_cls is not None:
            self.call = self.launcher_cls.__call__
            self.launcher_cls.__call__ = self._timed(self.call, "launch_s")
        return self

    def _timed(self, method, total: str, count: bool = False):
        """method, adding its wall time to self.<total> (and counting calls by kernel name)."""
        timers = self

        def timed(obj, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(obj, *args, **kwargs)
            finally:
                setattr(timers, total, getattr(timers, total) + time.perf_counter() - t0)
                if count:
                    timers.by_kernel[obj.__name__] += 1
        return timed

    def __exit__(self, *exc):
        self.JITFunction.run = self.run
        if self.launcher_cls is not None:
            self.launcher_cls.__call__ = self.call


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--buckets", default="1,8,64,256")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--cprofile", type=int, default=0, metavar="BUCKET",
                   help="also print a cProfile of 10 forwards at this bucket (by own time and by cumulative time)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("forward_host.py needs a CUDA device")
    from pcg_engine.llm import LLM
    llm = LLM(args.model, mode="full_decode")
    graphs = llm.engine.runner.full_graphs
    rows = []
    for bucket in (int(b) for b in args.buckets.split(",")):
        if bucket not in graphs.buckets:
            continue
        _time_forwards(graphs, bucket, 3)
        plain = _time_forwards(graphs, bucket, args.iters)
        with _Timers() as timers:
            timed = _time_forwards(graphs, bucket, args.iters)
        n = args.iters
        row = {"bucket": bucket, "forward_ms": 1e3 * statistics.median(plain),
               "forward_timed_ms": 1e3 * statistics.median(timed),
               "jit_ms": 1e3 * timers.jit_s / n, "launcher_ms": 1e3 * timers.launch_s / n,
               "launches": sum(timers.by_kernel.values()) / n,
               "by_kernel": {k: v / n for k, v in timers.by_kernel.most_common()}}
        rows.append(row)
        print(f"bucket {bucket:4}: forward {row['forward_ms']:.2f} ms ({row['forward_timed_ms']:.2f} timed); "
              f"inside the JIT {row['jit_ms']:.2f} ms, of it the launcher {row['launcher_ms']:.2f} ms; "
              f"{row['launches']:.0f} launches: " + ", ".join(f"{k} {v:.0f}" for k, v in row["by_kernel"].items()))
    if args.cprofile:
        import cProfile
        import io
        import pstats
        _time_forwards(graphs, args.cprofile, 3)
        prof = cProfile.Profile()
        prof.enable()
        _time_forwards(graphs, args.cprofile, 10)
        prof.disable()
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(order).print_stats(45)
            print(text.getvalue())
    llm.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "forward_host", "model": args.model, "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
