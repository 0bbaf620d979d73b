"""The overhead table of the chapter "Removing overhead" (its `run.py overhead`), on this engine.

    pcg bench overhead --requests 16 --slots 16 --new-tokens 64
    pcg bench overhead --host-only --batch-sizes 16,64,256          # P4, see host_overhead.py

One line per configuration, each layer of the design switched on in turn:

    eager                 unfused weights, no Triton kernels, synchronous loop
    fused                 Q/K/V and gate/up fused at load (Triton kernels on CUDA only)
    fused + async         ... and async scheduling
    full graphs (+ async) whole-step CUDA graphs for decode steps (mode full_decode)
    piecewise (+ async)   compiled pieces between attentions, CUDA graphs per token bucket

same_tokens says whether greedy decoding produced exactly the eager configuration's tokens. The
eager configuration is a different computation in rounding (unfused weights, PyTorch ops), so the
check is only as sharp as the logits' margins. With random weights at published shapes (all we can
make without a hub) the logits are nearly flat, and in bf16 a last-bit difference in a fused
kernel flips an argmax, and with it the rest of that sequence (the fused configurations then agree
with each other and with none of them wrong). The protocol therefore has two runs:

    pcg bench overhead --requests 256 --slots 256                    # tok/s, host ms: bf16
    pcg bench overhead --requests 256 --slots 256 --dtype float32    # same_tokens: every config

In float32 (Triton's dots in IEEE mode, no TF32) the rounding noise is ~1e-7, far below the random
model's argmax margins, so a true there says every layer of the design computes the same function
as eager; the bf16 run reports same_tokens_as_fused, which must be true whatever the dtype
(graphs, piecewise and async scheduling change no rounding). On a
CPU the graph configurations are skipped (nothing to capture; the piecewise split runs compiled but
ungraphed with --cpu-compile, which is slow to compile), as the chapter's CPU table shows.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from pcg_engine.bench import common
from pcg_engine.config import MAX_NUM_SEQS

CONFIGS = [
    ("eager", dict(mode="eager", fuse=False, kernels=False, async_scheduling=False)),
    ("fused", dict(mode="eager", fuse=True, async_scheduling=False)),
    ("fused + async", dict(mode="eager", fuse=True, async_scheduling=True)),
    ("full graphs", dict(mode="full_decode", fuse=True, async_scheduling=False)),
    ("full graphs + async", dict(mode="full_decode", fuse=True, async_scheduling=True)),
    ("piecewise", dict(mode="piecewise", fuse=True, async_scheduling=False)),
    ("piecewise + async", dict(mode="piecewise", fuse=True, async_scheduling=True)),
]


def pick_configs(args, on_cuda: bool) -> tuple[list, list[str]]:
    """(configs to run, notes on those skipped). eager always runs: it is the token reference."""
    wanted = None if args.configs is None else {c.strip() for c in args.configs.split(",")}
    known = {name for name, _ in CONFIGS}
    if wanted is not None and wanted - known:
        # (known in the table's order: a set's was a new order each run)
        raise SystemExit(f"--configs: unknown {sorted(wanted - known)}; known: {', '.join(n for n, _ in CONFIGS)}")
    chosen, notes = [], []
    for name, kw in CONFIGS:
        if wanted is not None and name not in wanted and name != "eager":
            continue
        if not on_cuda and kw["mode"] == "full_decode":
            notes.append(f"{name}: skipped, whole-step CUDA graphs need a CUDA device")
            continue
        if not on_cuda and kw["mode"] == "piecewise" and not args.cpu_compile:
            notes.append(f"{name}: skipped on CPU (no graphs to capture; --cpu-compile runs the compiled split)")
            continue
        chosen.append((name, kw))
    return chosen, notes


def run_config(llm, prompts, args) -> tuple[dict, list[list[int]]]:
    warm_rng = np.random.default_rng(args.seed + 1)
    warm = common.random_prompts(warm_rng, common.token_pool(llm), [len(p) for p in prompts])
    llm.generate(warm, common.bench_params(min(args.new_tokens, 8)))   # lazy set-up out of the timing
    common.reset_stats(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, common.bench_params(args.new_tokens))
    elapsed = time.perf_counter() - t0
    s = llm.engine.stats
    return {"tok_s": s.generated_tokens / elapsed, "steps": s.steps,
            "host_ms_per_step": 1000 * s.host_s / max(s.steps, 1),
            "sync_wait_ms_per_step": 1000 * s.sync_wait_s / max(s.steps, 1),
            "elapsed_s": elapsed, "generated_tokens": s.generated_tokens, "preemptions": s.preemptions,
            "engine_mode": llm.engine.runner.mode, "async_scheduling": llm.engine.async_scheduling,
            "engine_config": common.engine_config(llm)}, \
        [o.token_ids for o in outs]


def run_table(args, console) -> dict:
    on_cuda = torch.cuda.is_available() and not args.device.startswith("cpu")
    configs, notes = pick_configs(args, on_cuda)
    model = common.resolve_model(args.model, args.seed)
    common.refuse_too_long(args, model, args.prompt_len, args.new_tokens, "--prompt-len / --new-tokens")
    base_kw = common.engine_kwargs(args)
    base_kw["max_num_seqs"] = args.slots
    results, reference, fused_reference = [], None, None
    prompts = None
    for name, kw in configs:
        with console.status(f"{name}: building the engine and running {args.requests} requests"):
            llm = common.build_llm(model, **{**base_kw, **kw})
            if prompts is None:
                rng = np.random.default_rng(args.seed)
                prompts = common.random_prompts(rng, common.token_pool(llm), [args.prompt_len] * args.requests)
            row, tokens = run_config(llm, prompts, args)
            llm.close()
            del llm
        if reference is None:
            reference = tokens
        if name == "fused":
            fused_reference = tokens
        # token_match: the share of positions equal to eager's (see the module docstring on bf16).
        pairs = [(a, b) for x, y in zip(tokens, reference) for a, b in zip(x, y)]
        row = {"config": name, "tok_s": row.pop("tok_s"), "steps": row.pop("steps"),
               "host_ms_per_step": row.pop("host_ms_per_step"), "same_tokens": tokens == reference,
               "token_match": sum(a == b for a, b in pairs) / max(len(pairs), 1),
               # Against eager with the same fused kernels: graphs, piecewise and async scheduling
               # must change no token whatever the dtype (None where that reference did not run).
               "same_tokens_as_fused": None if fused_reference is None or name == "eager" else tokens == fused_reference,
               **row}
        results.append(row)
        # The chapter's format: exactly its keys, one JSON object per line.
        print(json.dumps({"config": name, "tok_s": round(row["tok_s"], 1), "steps": row["steps"],
                          "host_ms_per_step": round(row["host_ms_per_step"], 3), "same_tokens": row["same_tokens"]}),
              flush=True)
    for note in notes:
        console.print(f"[dim]{note}[/dim]")
    common.print_table(f"overhead: {args.requests} requests, {args.slots} slots, {args.new_tokens} new tokens, "
                       f"{results[0]['engine_config']['resolved_dtype']}",
                       ["config", "tok/s", "steps", "host ms/step", "sync wait ms/step", "same tokens", "token match", "same as fused"],
                       [[r["config"], r["tok_s"], r["steps"], r["host_ms_per_step"], r["sync_wait_ms_per_step"],
                         r["same_tokens"], f"{r['token_match']:.1%}", r["same_tokens_as_fused"]] for r in results])
    return {"benchmark": "overhead", **common.env_record(model, args.device), "config": common.config_record(args),
            "configs": results, "skipped": notes}


# The table run's flags and their defaults (None at parse time: given or not); --host-only reads
# none of them.
TABLE_DEFAULTS = {"requests": 16, "slots": 16, "new_tokens": 64, "configs": None, "cpu_compile": False}
# The host-only group's flags and their defaults (None at parse time: given or not).
HOST_ONLY_DEFAULTS = {"batch_sizes": [16, 64, 256], "host_steps": 50, "warm_steps": 5, "host_async": False,
                      "host_profile": None, "fake_vocab": None}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pcg bench overhead", description=__doc__.split("\n\n")[0],
                                formatter_class=common.HelpFormatter)
    common.add_common_args(p)
    # The table run's flags: default None here, filled in by main() (common.not_with).
    p.add_argument("--requests", type=common.int_at_least(1), default=None, help="(default: 16)")
    p.add_argument("--slots", type=common.max_num_seqs_flag, default=None, help="max_num_seqs (default: 16)")
    p.add_argument("--new-tokens", type=common.int_at_least(1), default=None, help="(default: 64)")
    p.add_argument("--prompt-len", type=common.int_at_least(1), default=None,
                   help="default: 16, or 128 with --host-only")
    p.add_argument("--configs", default=None,
                   help="comma-separated subset of the configs (eager always runs; default: every one this device runs)")
    p.add_argument("--cpu-compile", action="store_true", default=None,
                   help="on CPU, also run the piecewise configs ungraphed")
    # The host-only group's defaults are None here and filled in by main() (common.only_with).
    h = p.add_argument_group("host only (P4)")
    h.add_argument("--host-only", action="store_true", help="time host work per step without the model")
    h.add_argument("--batch-sizes", type=common.int_list_at_least(1, MAX_NUM_SEQS), default=None,
                   help="running decode requests to time, comma-separated (default: 16,64,256)")
    h.add_argument("--host-steps", type=common.int_at_least(1), default=None,
                   help="timed decode steps per size (default: 50)")
    h.add_argument("--warm-steps", type=common.int_at_least(0), default=None, help="(default: 5)")
    h.add_argument("--host-async", action="store_true", default=None, help="async scheduling in the host-only run")
    # Checked at parse time (it failed with a traceback after the whole run): PATH and PATH.txt are written.
    h.add_argument("--host-profile", type=common.json_path, default=None, metavar="PATH",
                   help="cProfile the timed steps of the persistent batch at the largest size; stats to PATH "
                        "(pstats format) and the top functions to PATH.txt")
    h.add_argument("--fake-vocab", type=common.int_at_least(1), default=None,
                   help="width of the fake logits (default: the model's vocabulary). On a CPU the greedy "
                        "argmax over them is real work (~1.3 ms at 256 x 1024 on the dev machine) that a GPU "
                        "runs asynchronously; a small width leaves the host work alone")
    return p


def main(argv=None) -> int:
    from rich.console import Console
    args = make_parser().parse_args(argv)
    common.refuse_max_num_seqs(args, "--batch-sizes" if args.host_only else "--slots")
    common.only_with(args, "--host-only", HOST_ONLY_DEFAULTS)
    common.not_with(args, "--host-only", TABLE_DEFAULTS)
    console = Console(stderr=True)
    # By run, where not given. (Looking for "--prompt-len" in argv missed "--prompt-len=8" and the
    # abbreviation "--prompt 8": the host-only run replaced them with 128; found by a review.)
    if args.prompt_len is None:
        args.prompt_len = 128 if args.host_only else 16
    if args.host_only:
        from pcg_engine.bench.host_overhead import run_host_only
        payload = run_host_only(args, console)
    else:
        payload = run_table(args, console)
    common.write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
