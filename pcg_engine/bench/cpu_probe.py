"""How fast the calling thread runs a fixed piece of host work right now: a calibration that
benchmarks record beside their own figures.

Why: on the H200 host, host-bound work runs at a different speed in each process. Batch-1
piecewise decode reads ~1.07 ms a token in one process and 1.2-1.7 ms in the next; eager prefill's
TTFT of 8 x 512 tokens read 39-80 ms over 13 processes of one call (session 16), with no order by
commit. Sessions 13-16 ruled out the core, the other threads, glibc's arenas and huge pages.

What it found (docs/PERF.md, session 16, calls 3-4): in twenty fresh processes with no engine, the
Python workload took ~3.7 ms in ten and ~7.5-8.7 ms in the other ten; on each of the 16 cores in
turn, every core was slow at times, flipping within a second or so. The host (a KVM guest) runs
any thread at one of two speeds 2x apart, and P1's piecewise TPOT follows the probe taken before
its timed part (1.05-1.13 ms at 3.6-4.9 ms, 1.34 ms at 7.9). So host-bound figures compare only
with this probe beside them.

Two workloads, each timed `repeats` times (the minimum is the core's speed with the least
interference, the median what a step meets):
- python: interpreter work like a scheduler's (attribute and dict access, list appends, calls);
- torch: small CPU tensor ops through the dispatcher, like a launch's host path.
"""

from __future__ import annotations

import statistics
import time

import torch


class _Row:
    __slots__ = ("tokens", "computed")

    def __init__(self):
        self.tokens: list[int] = []
        self.computed = 0


def _python_work(n: int) -> int:
    rows = [_Row() for _ in range(64)]
    table: dict[int, int] = {}
    total = 0
    for i in range(n):
        row = rows[i & 63]
        row.tokens.append(i)
        row.computed += 1
        table[i & 1023] = table.get(i & 1023, 0) + row.computed
        total += len(row.tokens) & 7
    return total


def _torch_work(n: int) -> float:
    a = torch.ones(8)
    acc = torch.zeros(8)
    for _ in range(n):
        acc.add_(a.mul(2))
    return float(acc[0])


def probe(repeats: int = 7, python_iters: int = 20000, torch_iters: int = 400) -> dict[str, float]:
    """Microseconds a run of each workload: min and median over `repeats` runs (about 10-20 ms in
    all on a server core)."""
    out: dict[str, float] = {}
    for name, fn, n in (("python", _python_work, python_iters), ("torch", _torch_work, torch_iters)):
        fn(n // 10)   # first-call costs (allocations, dispatcher caches) outside the timing
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(n)
            times.append((time.perf_counter() - t0) * 1e6)
        out[f"{name}_min_us"] = min(times)
        out[f"{name}_median_us"] = statistics.median(times)
    return out


def summary(before: dict, after: dict) -> str:
    """One line for logs: each workload's median before and after the timed part."""
    return ", ".join(f"{name} {before[f'{name}_median_us']:.0f} -> {after[f'{name}_median_us']:.0f} us"
                     for name in ("python", "torch"))
