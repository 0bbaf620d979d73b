"""Does batch-1 decode run slower in the seconds after start-up, and what else uses the CPU then?

    python scripts/host_drift.py --model M [--mode full_decode] [--windows 12] [--tokens 128] [--json F]

Why: with a warm-up before the largest full decode bucket only (PCG_FULL_GRAPH_WARMUP_EVERY=0,
session 13) batch-1 full_decode read 0.885 ms a token against 0.861, yet the graphs and the
step's kernels were the same; only the host was slower, every phase of it (pure-Python scheduling
too) 1.5-1.7x in a short profile, while P1's longer run lost just 2.7%. One explanation fits
both: something else holding the GIL (a thread) or the core for a while after start-up ends,
i.e. sooner after ready when start-up is shorter. Piecewise's host-bound TPOT also moved
1.16-1.46 ms between engine builds.

This builds LLM(model, mode), then runs `windows` back-to-back batch-1 generations of `tokens`
tokens each (fresh random prompts) and records per window: seconds since ready, TPOT, the CPU
seconds each thread of this process used (by thread name, from /proc/self/task) and the CPU
seconds of every child process (from /proc), and the GPU's SM and memory clocks where nvidia-smi
exists. Also per window (pcg_engine/bench/proc_stats.py): page faults, the main thread's context
switches, moves between cores and current core, huge-page memory, and the machine's steal time
(a VM's cores lent elsewhere). A TPOT that falls while some thread's
CPU falls to zero, while a clock rises or while steal falls, is the answer. Session 14 ruled threads and children out: piecewise still ran 1.33 ms a token for its
first ~3.5 s and 1.17-1.29 after (docs/PERF.md), hence the clocks. Linux only (reads /proc); GPU
or CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time

import numpy as np

from pcg_engine.bench import common, cpu_probe, latency, proc_stats

_TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(path: str):
    """(comm, utime + stime in seconds, ppid) from a /proc stat file, None if it vanished."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    comm = text[text.index("(") + 1:text.rindex(")")]
    rest = text[text.rindex(")") + 2:].split()
    # fields after comm: state(0) ppid(1) ... utime(11) stime(12)
    return comm, (int(rest[11]) + int(rest[12])) / _TICK, int(rest[1])


def thread_cpu() -> dict[str, float]:
    """CPU seconds by 'name/tid' for each thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        fields = _stat_fields(f"/proc/self/task/{tid}/stat")
        if fields is not None:
            out[f"{fields[0]}/{tid}"] = fields[1]
    return out


def child_cpu() -> dict[str, float]:
    """CPU seconds by 'name/pid' for each live child process of this one."""
    me, out = os.getpid(), {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            fields = _stat_fields(f"/proc/{pid}/stat")
            if fields is not None and fields[2] == me:
                out[f"{fields[0]}/{pid}"] = fields[1]
    return out


def gpu_clocks() -> dict | None:
    """SM and memory clocks (MHz) of the GPUs nvidia-smi lists, read between windows (a
    subprocess, ~50 ms, outside the timed generations); None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        text = subprocess.run([exe, "--query-gpu=clocks.sm,clocks.mem", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [line.split(",") for line in text.strip().splitlines() if line.count(",") == 1]
    return {"sm_mhz": [int(a) for a, _ in rows], "mem_mhz": [int(b) for _, b in rows]} if rows else None


def steal_seconds() -> float:
    """The whole machine's steal seconds (the hypervisor gave the VM's cores to someone else)."""
    try:
        with open("/proc/stat") as f:
            cpu = f.readline().split()   # cpu user nice system idle iowait irq softirq steal ...
        return int(cpu[8]) / _TICK if len(cpu) > 8 else 0.0
    except (OSError, ValueError, IndexError):
        return 0.0


def host_signals() -> dict:
    """What the machine did to this process (pcg_engine/bench/proc_stats.py: page faults, the main
    thread's context switches, moves between cores and current core, huge-page memory) and the
    machine's steal seconds."""
    return {**proc_stats.snapshot(), "steal_s": steal_seconds()}


def _delta(after: dict, before: dict) -> dict:
    return {k: round(v - before.get(k, 0.0), 3) for k, v in after.items() if v - before.get(k, 0.0) > 0.0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--mode", default="full_decode")
    p.add_argument("--windows", type=int, default=12)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--json")
    args = p.parse_args(argv)

    t0 = time.monotonic()
    llm = common.build_llm(common.resolve_model(args.model), mode=args.mode)
    ready = time.monotonic()
    rng = np.random.default_rng(0)
    pool = common.token_pool(llm)
    params = common.bench_params(args.tokens)
    windows = []
    for w in range(args.windows):
        # The host's speed on fixed work just before the window (bench/cpu_probe.py), outside the
        # window's own CPU and OS figures, which start after it.
        probe = cpu_probe.probe(repeats=3)
        threads, children, signals = thread_cpu(), child_cpu(), host_signals()
        start = time.monotonic() - ready
        row = latency.one_iteration(llm, common.random_prompts(rng, pool, [args.input_len]), params)[0]
        now_threads, now_children = thread_cpu(), child_cpu()
        clocks, now_signals = gpu_clocks(), host_signals()
        host = {**proc_stats.delta(signals, now_signals),
                "steal_s": round(now_signals["steal_s"] - signals["steal_s"], 2)}
        windows.append({"window": w, "since_ready_s": round(start, 2), "tpot_ms": round(row["tpot_ms"], 4),
                        "cpu_probe_python_us": round(probe["python_median_us"]),
                        "thread_cpu_s": _delta(now_threads, threads), "child_cpu_s": _delta(now_children, children),
                        "gpu_clocks": clocks, "host": host})
        print(f"window {w:2d} +{start:6.2f} s  TPOT {row['tpot_ms']:.3f} ms  probe {probe['python_median_us']:.0f} us  "
              f"threads {windows[-1]['thread_cpu_s']}  "
              f"children {windows[-1]['child_cpu_s']}  host {host}" + (f"  SM/mem MHz {clocks['sm_mhz']}/{clocks['mem_mhz']}"
                                                          if clocks else ""), flush=True)
    payload = {"model": args.model, "mode": args.mode, "start_s": round(ready - t0, 2),
               "env": {k: v for k, v in os.environ.items() if k.startswith("PCG_")},
               "threads_at_ready": sorted(thread_cpu()), "windows": windows, "commit": common.git_commit(),
               "thp": proc_stats.thp_mode()}
    common.write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
