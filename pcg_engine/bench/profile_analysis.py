"""Reading a profiler's Chrome trace: device busy intervals, idle gaps, host phases, and a timeline PNG.

The exported trace is the one format every torch version writes the same way ("X" events with
cat, name, ts and dur in microseconds), so the analysis works from it rather than from
profiler internals. With CUDA the device's activity is its kernel / memcpy / memset events. Without
CUDA there is no device: the stand-in is the top-level CPU ops of the thread that ran the steps, and
"idle" between them is host time spent outside ATen (Python, scheduling, bookkeeping).
"""

from __future__ import annotations

import numpy as np

PHASES = ("pcg.schedule", "pcg.prepare", "pcg.forward", "pcg.lm_head", "pcg.sample", "pcg.resolve")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of [start, end) intervals, sorted and non-overlapping."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def top_level(events: list[dict]) -> list[dict]:
    """Events not nested inside an earlier one (ops call ops: count and time only the outermost)."""
    out, end = [], -np.inf
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def kernel_table(kernels: list[dict], steps: int, top: int = 25) -> list[dict]:
    """Device time by kernel name, largest first: calls and µs per step, and the share of the busy
    time. Two modes' tables side by side say which kernels one of them adds or makes slower."""
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e["name"], []).append(e["dur"])
    totals = {name: sum(d) for name, d in by_name.items()}
    busy = sum(totals.values()) or 1e-9
    rows = [{"kernel": name, "calls_per_step": len(by_name[name]) / steps, "us_per_step": t / steps,
             "us_per_call": t / len(by_name[name]), "share": t / busy}
            for name, t in sorted(totals.items(), key=lambda kv: -kv[1])]
    return rows[:top]


def analyze(trace: dict, on_cuda: bool) -> dict:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"] == "pcg.step"),
                   key=lambda e: e["ts"])
    if not steps:
        raise RuntimeError("no pcg.step ranges in the trace: were the labels installed?")
    n = len(steps)
    if on_cuda:
        device = [e for e in events if e.get("cat") in DEVICE_CATS]
        kernels = [e for e in device if e.get("cat") == "kernel"]
        what = "CUDA kernels (device timeline)"
    else:
        tid = steps[0]["tid"]
        kernels = device = top_level([e for e in events if e.get("cat") == "cpu_op" and e["tid"] == tid])
        what = "CPU ops: no GPU, so busy = top-level ATen ops, idle = host time between them"
    busy = merge([(e["ts"], e["ts"] + e["dur"]) for e in device])
    if on_cuda and busy:
        span = (busy[0][0], busy[-1][1])
    else:
        span = (steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"])
    busy_us = sum(e - s for s, e in busy)
    span_us = max(span[1] - span[0], 1e-9)
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:])]
    phases = {p: 0.0 for p in PHASES}
    phase_intervals: dict[str, list] = {p: [] for p in PHASES}
    for e in events:
        if e.get("cat") == "user_annotation" and e["name"] in phases:
            phases[e["name"]] += e["dur"]
            phase_intervals[e["name"]].append((e["ts"], e["ts"] + e["dur"]))
    # Steady state: the benchmark synchronises before the profiler starts, which drains the async
    # pipeline, so the first profiled step always starts behind an idle GPU. Idle from the second
    # step's start on is what a long run sees; both figures are reported.
    steady_from = max(span[0], steps[1]["ts"]) if n > 1 else span[0]
    steady_busy = sum(max(0.0, e - max(s, steady_from)) for s, e in busy)
    steady_span = max(span[1] - steady_from, 1e-9)
    g = np.asarray(gaps) if gaps else np.zeros(1)
    # Of the steady idle, the part inside one CUDA graph launch: the gap between two device events
    # of the same launch (the profiler gives every kernel of a graph replay the correlation id of
    # its cudaGraphLaunch). That is the GPU's own ~0.4 µs scheduling between a graph's nodes, which
    # no host work can fill; the rest (between replays, eager launches and copies) is the idle the
    # host or the launch path causes: issue 6's "idle between decode steps".
    in_graph_us = 0.0
    if on_cuda:
        dev = sorted(device, key=lambda e: e["ts"])
        for a, b in zip(dev, dev[1:]):
            gap = b["ts"] - max(a["ts"] + a["dur"], steady_from)
            ca = a.get("args", {}).get("correlation")
            if gap > 0 and ca is not None and ca == b.get("args", {}).get("correlation"):
                in_graph_us += gap
    steady_idle = steady_span - steady_busy
    return {
        "events": what,
        "steps": n,
        "kernels_per_step": len(kernels) / n,
        "busy_ms_per_step": busy_us / 1000 / n,
        "idle_ms_per_step": (span_us - busy_us) / 1000 / n,
        "idle_fraction": (span_us - busy_us) / span_us,
        "steady_idle_fraction": steady_idle / steady_span,
        # From step 2: idle inside graph replays vs outside them (see above); they add up.
        "steady_idle_in_graphs_fraction": min(in_graph_us, steady_idle) / steady_span,
        "steady_idle_outside_graphs_fraction": max(steady_idle - in_graph_us, 0.0) / steady_span,
        "host_ms_per_step": sum(s["dur"] for s in steps) / 1000 / n,
        "gaps_per_step": len(gaps) / n,
        "gaps_us": {"mean": float(g.mean()), "median": float(np.median(g)), "p90": float(np.percentile(g, 90)),
                    "max": float(g.max())},
        "phases_ms_per_step": {p.split(".")[1]: v / 1000 / n for p, v in phases.items()},
        "kernel_table": kernel_table(kernels, n),
        "_timeline": {"steps": [(s["ts"], s["ts"] + s["dur"]) for s in steps], "busy": busy,
                      "phases": phase_intervals},
    }


def plot_timeline(results: list[dict], num_steps: int, path, on_cuda: bool) -> None:
    """One row per configuration: host phases above, device busy intervals below, first steps only."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(PHASES, ("#4e79a7", "#f28e2b", "#59a14f", "#76b7b2", "#e15759", "#b07aa1")))
    fig, axes = plt.subplots(len(results), 1, figsize=(14, 1.9 * len(results) + 0.6), squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        tl = r["_timeline"]
        k = min(num_steps, len(tl["steps"]))
        t0 = tl["steps"][0][0]
        t1 = tl["steps"][k][0] if k < len(tl["steps"]) else max(tl["steps"][-1][1], tl["busy"][-1][1] if tl["busy"] else 0)

        def clip(iv):
            return [((max(s, t0) - t0) / 1000, (min(e, t1) - max(s, t0)) / 1000) for s, e in iv if e > t0 and s < t1]
        ax.broken_barh(clip(tl["steps"]), (2.1, 0.8), facecolors="#dddddd", edgecolors="#999999")
        for p in PHASES:
            ax.broken_barh(clip(tl["phases"][p]), (1.1, 0.8), facecolors=colors[p], label=p.split(".")[1])
        ax.broken_barh(clip(tl["busy"]), (0.1, 0.8), facecolors="#222222")
        ax.set_yticks([0.5, 1.5, 2.5], ["GPU busy" if on_cuda else "in ATen op", "host phase", "step"])
        ax.set_xlim(0, (t1 - t0) / 1000)
        ax.set_title(f"{r['config']}: {r['kernels_per_step']:.0f} {'kernels' if on_cuda else 'ops'}/step, "
                     f"idle {100 * r['idle_fraction']:.0f}%", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms from the first profiled step")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=len(PHASES), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
