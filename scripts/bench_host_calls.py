"""Host µs a call of the torch calls left on a decode step's host path, against the driver's own.

    python scripts/bench_host_calls.py [--rows 256] [--json PATH]

Each call is issued in runs of 200 (the device synchronised between runs, outside the timing, so
the launch queue never fills); the figure is the median over 7 repetitions of the per-call mean.
Rows: a step's staged words from pinned memory by Tensor.copy_ and by engine/driver_copy.py, the
previous step's tokens device to device by copy_ (async steps), torch.empty of the size of the
argmax output (no longer made a step), and a torch.cuda.Event record. CUDA only. (Session 25's
first version also timed cuMemcpyDtoDAsync for the tokens: ~0.5 µs below copy_, not kept.)
"""

import argparse
import json
import statistics
import time

import torch

from pcg_engine.engine import driver_copy


def per_call_us(fn, runs: int = 200, reps: int = 7) -> float:
    means = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(runs):
            fn()
        means.append((time.perf_counter() - t0) / runs * 1e6)
    torch.cuda.synchronize()
    return statistics.median(means)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    R = args.rows
    words = 4 * R + 256                          # a decode step's staged words, about
    src = torch.zeros(words, dtype=torch.int64, pin_memory=True)
    dst = torch.zeros(words, dtype=torch.int64, device="cuda")
    tokens = torch.zeros(R, dtype=torch.int64, device="cuda")
    ids = torch.zeros(R, dtype=torch.int64, device="cuda")
    copier = driver_copy.for_device(torch.device("cuda"))
    assert copier is not None, "no driver copies here"
    h2d = ((dst.data_ptr(), src.data_ptr(), 8 * words),)
    event, stream = torch.cuda.Event(), torch.cuda.current_stream()
    rows = {
        "copy_ H2D (pinned, non_blocking)": lambda: dst.copy_(src, non_blocking=True),
        "driver H2D": lambda: copier.host_to_device(h2d),
        "copy_ D2D": lambda: ids.copy_(tokens, non_blocking=True),
        "torch.empty(R, int64, cuda)": lambda: torch.empty(R, dtype=torch.int64, device="cuda"),
        "Event.record(stream)": lambda: event.record(stream),
    }
    for fn in rows.values():                      # warm every path once
        per_call_us(fn, runs=20, reps=1)
    # Measured twice, interleaved, so that a host's drift shows as a difference between passes.
    results = {name: [] for name in rows}
    for _ in range(2):
        for name, fn in rows.items():
            results[name].append(per_call_us(fn))
    for name, values in results.items():
        print(f"{name:36s} " + "  ".join(f"{v:7.2f}" for v in values) + " µs a call")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": R, "staged_words": words, "us_per_call": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
