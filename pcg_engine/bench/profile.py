"""Step profile: torch.profiler over a few decode steps per configuration.

    pcg bench profile --model qwen3-0.6b --configs "eager,fused,full graphs,piecewise" --out-dir prof

For each configuration: a Chrome trace (open in chrome://tracing or Perfetto), kernels per decode
step, device busy vs idle time per step and the idle gaps between kernels; and one PNG with a few
steps of every configuration, one row each: device busy intervals under the host phases.

Host phases are torch.profiler.record_function ranges put around engine methods from outside (the
engine files stay untouched): pcg.step, pcg.schedule, pcg.prepare, pcg.forward, pcg.lm_head,
pcg.sample, pcg.resolve. Without CUDA there is no device timeline: "kernels" are then the top-level
CPU ops of the engine thread and "idle" is host time between them (Python overhead); the JSON and
the table say so.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from pcg_engine.bench import common, profile_analysis
from pcg_engine.bench.overhead import CONFIGS as OVERHEAD_CONFIGS

# The overhead table's configs and the CUDA default mode. They share one process, and a process's
# later engine decodes ~3% slower with PDL on (docs/PERF.md, session 19; bench/common.py's
# --process-per-mode): compare a config with itself across runs, or profile one config a run.
CONFIGS = OVERHEAD_CONFIGS + [("full + piecewise + async",
                               dict(mode="full_and_piecewise", fuse=True, async_scheduling=True))]
GRAPH_MODES = ("full_decode", "full_and_piecewise")


def _labelled(fn, label: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    return wrapper


def wrap_phases(engine, wrap) -> None:
    """Replace each phase of the engine's step by wrap(method, phase), as instance attributes (the
    engine files stay untouched). Phases: step, resolve, sample, schedule, prepare, forward,
    full_graph (the full decode graphs' forward, where the mode has them), lm_head."""
    runner = engine.runner
    engine.step = wrap(engine.step, "step")
    engine._resolve = wrap(engine._resolve, "resolve")
    engine.sampler = wrap(engine.sampler, "sample")
    engine.scheduler.schedule = wrap(engine.scheduler.schedule, "schedule")
    runner.batch.prepare = wrap(runner.batch.prepare, "prepare")
    runner.forward_fn = wrap(runner.forward_fn, "forward")
    if getattr(runner, "full_graphs", None) is not None:
        runner.full_graphs.run = wrap(runner.full_graphs.run, "full_graph")
    runner.model.__dict__["compute_logits"] = wrap(runner.model.compute_logits, "lm_head")


def install_labels(engine) -> None:
    """Wrap the engine's phases in record_function ranges (both forwards are pcg.forward)."""
    wrap_phases(engine, lambda fn, phase: _labelled(fn, "pcg.forward" if phase == "full_graph" else f"pcg.{phase}"))


def output_tokens(args) -> int:
    """Each request's max_tokens: the steps until all decode, the warm-up and profiled steps, with a
    margin (without the first, early requests finished inside the profile: 25 of 64 left)."""
    budget = common.EngineConfig(**common.engine_kwargs(args)).max_num_batched_tokens
    return common.steps_before_decoding(args.requests, args.prompt_len, budget) + args.warm_steps + args.steps + 8


def profile_config(name: str, kw: dict, args, model: str, out_dir: Path, on_cuda: bool) -> dict:
    llm = common.build_llm(model, **{**common.engine_kwargs(args), "max_num_seqs": args.requests, **kw})
    engine = llm.engine
    install_labels(engine)
    ids, _, _ = common.add_random_requests(llm, args.requests, args.prompt_len, output_tokens(args), args.seed)
    common.step_until_decoding(engine, ids)
    for _ in range(args.warm_steps):
        engine.step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        if on_cuda:
            torch.cuda.synchronize()
    common.refuse_unless_all_running(engine, ids, f"--requests {args.requests}")
    slug = "".join(c if c.isalnum() else "_" for c in name)
    trace_path = out_dir / f"trace_{slug}.json"
    prof.export_chrome_trace(str(trace_path))
    for rid in ids:
        if rid in engine.requests:
            engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    mode = engine.runner.mode
    llm.close()
    del llm, engine
    with open(trace_path, encoding="utf-8") as f:
        trace = json.load(f)
    result = profile_analysis.analyze(trace, on_cuda)
    result.update(config=name, engine_mode=mode, trace=str(trace_path))
    return result


def default_configs(on_cuda: bool) -> str:
    return "eager,fused,full graphs,piecewise" if on_cuda else "eager,fused"


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pcg bench profile", description=__doc__.split("\n\n")[0],
                                formatter_class=common.HelpFormatter)
    common.add_common_args(p)
    names = ", ".join(n for n, _ in CONFIGS)
    p.add_argument("--configs", default=None, help=f"comma-separated, from: {names} "
                   "(default: eager, fused, and on CUDA full graphs, piecewise)")
    p.add_argument("--requests", type=common.max_num_seqs_flag, default=16, help="running decode requests (= max_num_seqs)")
    p.add_argument("--prompt-len", type=common.int_at_least(1), default=32)
    p.add_argument("--steps", type=common.int_at_least(1), default=5, help="decode steps profiled")
    p.add_argument("--warm-steps", type=common.int_at_least(0), default=3, help="decode steps run before profiling")
    p.add_argument("--timeline-steps", type=common.int_at_least(1), default=3, help="steps shown in the PNG")
    p.add_argument("--out-dir", default="profile_out", type=common.directory_path)
    p.add_argument("--kernel-table", action="store_true", help="print each config's device time by kernel name")
    return p


def main(argv=None) -> int:
    from rich.console import Console
    args = make_parser().parse_args(argv)
    common.refuse_max_num_seqs(args, "--requests")
    console = Console(stderr=True)
    on_cuda = torch.cuda.is_available() and not args.device.startswith("cpu")
    table = dict(CONFIGS)
    names = [c.strip() for c in (args.configs or default_configs(on_cuda)).split(",") if c.strip()]
    # (found by a review: "," ran nothing and ended in a matplotlib traceback; a config named twice
    # wrote its trace twice to one file)
    if not names:
        raise SystemExit(f"--configs: {args.configs!r} names no config; known: {', '.join(table)}")
    if len(set(names)) < len(names):
        raise SystemExit(f"--configs: {args.configs!r} names a config twice; each runs once (one trace file each)")
    for n in names:
        if n not in table:
            raise SystemExit(f"--configs: unknown {n!r}; known: {', '.join(table)}")
        if not on_cuda and table[n]["mode"] in GRAPH_MODES:
            raise SystemExit(f"--configs: {n!r} needs CUDA (whole-step graphs)")
    model = common.resolve_model(args.model, args.seed)
    common.refuse_too_long(args, model, args.prompt_len, output_tokens(args), "--prompt-len / --steps / --warm-steps")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for n in names:
        with console.status(f"profiling {n}"):
            results.append(profile_config(n, table[n], args, model, out_dir, on_cuda))
    png = out_dir / "timeline.png"
    try:
        profile_analysis.plot_timeline(results, args.timeline_steps, png, on_cuda)
    except ImportError as e:      # matplotlib is optional (the "bench" extra): keep the traces and numbers
        console.print(f"[yellow]no timeline PNG: {e} (pip install matplotlib)[/yellow]")
        png = None
    unit = "kernels" if on_cuda else "CPU ops"
    common.print_table(f"decode step profile ({results[0]['events']})",
                       ["config", f"{unit}/step", "busy ms/step", "idle ms/step", "idle %",
                        "idle % from step 2", "of it outside graphs %", "gaps/step", "gap median µs", "gap p90 µs", "gap max µs"],
                       [[r["config"], r["kernels_per_step"], r["busy_ms_per_step"], r["idle_ms_per_step"],
                         100 * r["idle_fraction"], 100 * r["steady_idle_fraction"], 100 * r["steady_idle_outside_graphs_fraction"], r["gaps_per_step"], r["gaps_us"]["median"], r["gaps_us"]["p90"],
                         r["gaps_us"]["max"]] for r in results])
    for r in results:
        # A phase at 0 did not run: e.g. "sample" while the engine takes its greedy argmax fast path.
        console.print(f"{r['config']}: host phases ms/step " + ", ".join(
            f"{k} {v:.3f}" for k, v in r["phases_ms_per_step"].items() if v) + f"; trace {r['trace']}")
    if args.kernel_table:
        for r in results:
            common.print_table(f"{r['config']}: {unit} by name, per step (top {len(r['kernel_table'])})",
                               ["name", "calls", "µs", "µs a call", "share %"],
                               [[k["kernel"][:90], k["calls_per_step"], k["us_per_step"], k["us_per_call"],
                                 100 * k["share"]] for k in r["kernel_table"]])
    if png is not None:
        console.print(f"timeline: {png}")
    payload = {"benchmark": "profile", **common.env_record(model, args.device), "config": common.config_record(args),
               "configs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in results],
               "timeline_png": None if png is None else str(png)}
    common.write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
