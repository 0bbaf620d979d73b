"""Pinning the thread that runs engine steps to one CPU core while it steps.

Why: batch-1 decode in `piecewise` mode is host-bound (about 60 graph replays and attention launches
a step, each from Python), and on the H200 host its host time moved between 0.9 and 1.7 ms a step
from one run to the next. The same runs under `taskset -c 2` read 0.90-0.92 ms every time, and
piecewise TPOT fell from 1.21-1.70 ms to 1.07-1.09 (docs/PERF.md, session 15); four cores
(`taskset -c 2-5`) gave 1.10-1.14. full_decode, which waits on the GPU, did not move. The likely
reason: a thread that blocks on the GPU and is woken on another core finds that core's L1/L2 cold
(each of the host's 16 cores has its own 2 MB L2), and the step's Python touches a lot of memory.

What is pinned: only the calling thread (Linux's sched_setaffinity with pid 0), only while it steps
(LLM.generate, LLM.stream, the load test's engine thread, `with engine.stepping():` around a loop
of step() calls), and back to the thread's own mask afterwards: threads and processes that the
user starts later would inherit a one-core mask. The core is the one the thread is running on when
it starts stepping (or EngineConfig.cpu_pin's number). A thread whose mask is one core already
(taskset, an outer pin) is left alone.
"""

from __future__ import annotations

import os

_CAN_PIN = hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")
# A/B switch (read at import): pin every thread of the process, not only the stepping one, as
# `taskset -c N` does (session 15's question: is it the other threads?).
_ALL_THREADS = os.environ.get("PCG_CPU_PIN_ALL", "0") == "1"


def current_cpu() -> int | None:
    """The core the calling thread last ran on (field 39 of /proc/thread-self/stat), None where
    that file does not exist."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def allowed_cpus() -> set[int]:
    """The cores this thread may run on (every core where affinity cannot be read)."""
    return os.sched_getaffinity(0) if _CAN_PIN else set(range(os.cpu_count() or 1))


class ThreadPin:
    """Context manager: the calling thread runs on one core inside it (see the module docstring).
    cpu=None: the core it is on at entry. Re-entrant: nested, the inner one does nothing."""

    def __init__(self, cpu: int | None = None):
        self.cpu = cpu
        self.pinned_to: int | None = None       # the core, while pinned by this object
        self._saved: set[int] | None = None

    def __enter__(self) -> "ThreadPin":
        if not _CAN_PIN or self._saved is not None:
            return self
        mask = os.sched_getaffinity(0)
        if len(mask) <= 1:
            return self                          # pinned already (taskset, an outer pin)
        cpu = self.cpu if self.cpu is not None else current_cpu()
        if cpu not in mask:                      # unknown, or a core this thread may not use
            return self
        os.sched_setaffinity(0, {cpu})
        self._saved, self.pinned_to = mask, cpu
        self._others = {}
        if _ALL_THREADS:
            for tid in map(int, os.listdir("/proc/self/task")):
                try:
                    self._others[tid] = os.sched_getaffinity(tid)
                    os.sched_setaffinity(tid, {cpu})
                except OSError:
                    pass                         # the thread ended meanwhile
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            saved, self._saved, self.pinned_to = self._saved, None, None
            for tid, mask in self._others.items():
                try:
                    os.sched_setaffinity(tid, mask)
                except OSError:
                    pass
            os.sched_setaffinity(0, saved)
