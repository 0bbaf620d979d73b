"""P1: batch-1 decode latency: TTFT and TPOT = decode time / (new tokens - 1), greedy, EOS ignored.

    pcg bench latency --model qwen3-0.6b --modes eager,full_and_piecewise --json p1.json

Each iteration uses fresh random prompts (a repeated prompt would hit the prefix cache and shorten
TTFT). Warm-up iterations run first and are not counted. Times are taken as outputs reach the
caller (generate's on_output), i.e. what a user of the API sees.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from pcg_engine.bench import common, cpu_probe, proc_stats
from pcg_engine.config import EngineConfig


def one_iteration(llm, prompts, params) -> list[dict]:
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}

    def on_output(out):
        now = time.monotonic()
        if out.new_token_ids and out.request_id not in first:
            first[out.request_id] = now
        if out.finished:
            last[out.request_id] = now
            counts[out.request_id] = len(out.token_ids)

    t0 = time.monotonic()
    outs = llm.generate(prompts, params, on_output=on_output)
    rows = []
    for out in outs:
        rid, n = out.request_id, counts[out.request_id]
        ttft = first[rid] - t0
        decode = last[rid] - first[rid]
        rows.append({"ttft_ms": 1000 * ttft, "tpot_ms": 1000 * decode / max(n - 1, 1), "e2el_ms": 1000 * (last[rid] - t0),
                     "output_len": n})
    return rows


def refuse_a_batch_in_turns(llm, args) -> None:
    """A batch the KV cache cannot hold at once runs in turns (preempted or queued): its TTFTs
    measured the queue under the title "batch N" (8 x 1100 tokens in 79 blocks: 0.37 to 3.6 s).
    Checked on the built engine, whose cache the memory may have sized."""
    blocks = llm.engine.block_manager
    per_request = -(-(args.input_len + args.output_len) // blocks.block_size)
    if args.batch_size * per_request > blocks.num_total_blocks:
        fit = blocks.num_total_blocks // per_request
        raise SystemExit(f"--batch-size: {args.batch_size} requests of {args.input_len} + {args.output_len} tokens "
                         f"need {args.batch_size * per_request} KV blocks at once, the cache holds "
                         f"{blocks.num_total_blocks} (at most {fit} such requests); lower --batch-size, "
                         "--input-len or --output-len, or give the cache more blocks (--num-kv-blocks, "
                         "--gpu-memory-utilization)")


def run_mode(llm, args, name: str) -> dict:
    refuse_a_batch_in_turns(llm, args)
    rng = np.random.default_rng(args.seed)
    pool = common.token_pool(llm)
    params = common.bench_params(args.output_len)
    for _ in range(args.warmup_iters):
        one_iteration(llm, common.random_prompts(rng, pool, [args.input_len] * args.batch_size), params)
    common.reset_stats(llm)
    rows = []
    probe_before = cpu_probe.probe()
    before = proc_stats.snapshot()
    for i in range(args.num_iters):
        # Each iteration's rows carry the probe taken just before it: the host's speed can change
        # between iterations of one process (bench/cpu_probe.py).
        probe = probe_before if i == 0 else cpu_probe.probe(repeats=3)
        batch = one_iteration(llm, common.random_prompts(rng, pool, [args.input_len] * args.batch_size), params)
        for row in batch:
            row["cpu_probe_python_us"] = probe["python_median_us"]
        rows += batch
    proc = proc_stats.delta(before, proc_stats.snapshot())
    probe_after = cpu_probe.probe()
    stats = llm.engine.stats
    tpot = common.percentiles([r["tpot_ms"] for r in rows])
    return {"ttft_ms": common.percentiles([r["ttft_ms"] for r in rows]), "tpot_ms": tpot,
            "e2el_ms": common.percentiles([r["e2el_ms"] for r in rows]),
            # from the median TPOT, the figure the table prints beside it (the mean's gave a
            # tok/s that did not match the TPOT next to it)
            "decode_tok_s_per_request": 1000 / tpot["median"] if tpot["median"] else 0.0,
            "output_lens": sorted({r["output_len"] for r in rows}),
            "host_ms_per_step": 1000 * stats.host_s / max(stats.steps, 1), "steps": stats.steps,
            "engine_mode": llm.engine.runner.mode, "async_scheduling": llm.engine.async_scheduling,
            "engine_config": common.engine_config(llm), "iterations": rows,
            # what the OS did meanwhile (faults, switches, core moves, huge pages): bench/proc_stats.py
            "proc": proc, "thp": proc_stats.thp_mode(),
            # the core's speed on fixed host work just before and after them: bench/cpu_probe.py
            "cpu_probe": {"before": probe_before, "after": probe_after}}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pcg bench latency", description=__doc__.split("\n\n")[0],
                                formatter_class=common.HelpFormatter)
    common.add_common_args(p)
    common.add_process_per_mode_arg(p)
    p.add_argument("--modes", default="auto", help="comma-separated modes; ratios are against the first")
    p.add_argument("--input-len", type=common.int_at_least(1), default=128)
    p.add_argument("--output-len", type=common.int_at_least(2), default=256,
                   help="new tokens a request, >= 2: TPOT divides the decode time by (new tokens - 1)")
    p.add_argument("--batch-size", type=common.int_at_least(1), default=1)
    p.add_argument("--num-iters", type=common.int_at_least(1), default=5)
    p.add_argument("--warmup-iters", type=common.int_at_least(0), default=2)
    return p


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    # The engine's max_num_seqs, given or its default (left out, 300 requests ran as "batch 300" in
    # two turns of 256). (0: the engine names it.)
    max_num_seqs = EngineConfig(**common.engine_kwargs(args)).max_num_seqs
    if isinstance(max_num_seqs, int) and 1 <= max_num_seqs < args.batch_size:
        # The batch would run in turns: the TTFT measured queueing, under the title "batch N".
        raise SystemExit(f"--batch-size: {args.batch_size} requests at once, but --max-num-seqs {max_num_seqs} "
                         f"{'' if args.max_num_seqs is not None else '(the default) '}runs at most that many; "
                         "lower --batch-size or raise --max-num-seqs")
    model = common.resolve_model(args.model, args.seed)
    common.refuse_too_long(args, model, args.input_len, args.output_len, "--input-len / --output-len")
    results = common.run_each_mode(args, model, run_mode, f"{args.warmup_iters} warm-up + {args.num_iters} iterations",
                                    bench="latency", argv=sys.argv[1:] if argv is None else argv)
    if results is None:   # a child of --process-per-mode: its result is written
        return 0
    base = next(iter(results.values()))
    common.print_table(f"latency: batch {args.batch_size}, {args.input_len} prompt tokens, {args.output_len} new",
                       ["mode", "TTFT ms (median)", "TPOT ms (median)", "TPOT p90", "tok/s per request",
                        "host ms/step", "TPOT speed-up vs first", "TTFT speed-up vs first"],
                       [[n, r["ttft_ms"]["median"], r["tpot_ms"]["median"], r["tpot_ms"]["p90"],
                         r["decode_tok_s_per_request"], r["host_ms_per_step"],
                         f"{base['tpot_ms']['median'] / max(r['tpot_ms']['median'], 1e-9):.2f}x",
                         f"{base['ttft_ms']['median'] / max(r['ttft_ms']['median'], 1e-9):.2f}x"]
                        for n, r in results.items()])
    for name, r in results.items():
        print(f"{name}: the OS in the timed iterations: {proc_stats.summary(r['proc'], r['thp'])}")
        print(f"{name}: fixed host work (bench/cpu_probe.py): {cpu_probe.summary(**r['cpu_probe'])}")
    common.write_mode_results(args, model, "latency", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
