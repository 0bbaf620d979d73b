"""P2: offline throughput: every request added at once, output tokens / wall time (prefill included).

    pcg bench throughput --model qwen3-0.6b --modes eager,full_and_piecewise --json p2.json

Defaults are P2's: 256 requests of random ids, input and output lengths uniform in [100, 1024], EOS
ignored, seed 0, max_model_len 4096 (or the checkpoint's positions where fewer). --input-len/--output-len with --range-ratio replace the ranges.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from pcg_engine.bench import common


def lengths(rng, n: int, fixed: int | None, ratio: float, lo: int, hi: int) -> np.ndarray:
    if fixed is not None:
        lo, hi = common.length_bounds(fixed, ratio)
    if not 1 <= lo <= hi:
        raise SystemExit(f"length range [{lo}, {hi}] is empty or below 1")
    return rng.integers(lo, hi + 1, size=n)


def make_dataset(args, llm, n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    in_lens = lengths(rng, n, args.input_len, args.range_ratio, args.input_min, args.input_max)
    out_lens = lengths(rng, n, args.output_len, args.range_ratio, args.output_min, args.output_max)
    prompts = common.random_prompts(rng, common.token_pool(llm), in_lens)
    limit = llm.engine.max_model_len
    if int((in_lens + out_lens).max()) > limit:
        raise SystemExit(f"input + output lengths reach {int((in_lens + out_lens).max())} > max_model_len {limit}")
    return prompts, out_lens.tolist()


class StepLog:
    """Wall time of every engine step with the batch it started from, split into phases.

    Tells where a run's time goes: the prefill phase (some request still waiting or prefilling) and
    decode steps by how many requests were running (the batch shrinks as requests finish)."""

    EDGES = (0, 16, 64, 128, 192, 256, 1 << 30)

    def __init__(self, engine):
        self.engine, self.rows, self.prefilling = engine, [], True
        self._step = engine.step
        engine.step = self._timed

    def _timed(self):
        sched = self.engine.scheduler
        running = len(sched.running)
        # Prefill phase: a request waits or a running one has prompt left. Checked only until the
        # first step without either (all requests arrive at once), so the log costs nothing later.
        if self.prefilling:
            self.prefilling = bool(sched.waiting) or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)
        t0 = time.perf_counter()
        out = self._step()
        self.rows.append((time.perf_counter() - t0, self.prefilling, running))
        return out

    def close(self):
        self.engine.step = self._step

    def phases(self) -> dict:
        out = {"prefill (until every prompt is in)": [0, 0.0]}
        for dt, prefilling, running in self.rows:
            if prefilling:
                key = "prefill (until every prompt is in)"
            else:
                i = next(i for i, e in enumerate(self.EDGES) if running <= e)
                key = f"decode, {self.EDGES[i - 1] + 1}-{self.EDGES[i]} running"
            row = out.setdefault(key, [0, 0.0])
            row[0] += 1
            row[1] += dt
        return {k: {"steps": n, "s": t, "ms_per_step": 1000 * t / max(n, 1)} for k, (n, t) in out.items()}


def run_mode(llm, args, name: str) -> dict:
    if args.warmup_prompts:
        warm, warm_out = make_dataset(args, llm, args.warmup_prompts, args.seed + 1000)
        llm.generate(warm, [common.bench_params(min(o, 16), args.temperature) for o in warm_out])
    prompts, out_lens = make_dataset(args, llm, args.num_prompts, args.seed)
    params = [common.bench_params(o, args.temperature) for o in out_lens]
    common.reset_stats(llm)
    log = StepLog(llm.engine)
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, params)
    finally:
        log.close()
    elapsed = time.perf_counter() - t0
    stats = llm.engine.stats
    out_tokens = sum(len(o.token_ids) for o in outs)
    in_tokens = sum(len(p) for p in prompts)
    return {
        "num_requests": len(outs),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "expected_output_tokens": int(sum(out_lens)),
        "elapsed_s": elapsed,
        "output_throughput": out_tokens / elapsed,
        "total_token_throughput": (in_tokens + out_tokens) / elapsed,
        "request_throughput": len(outs) / elapsed,
        "steps": stats.steps,
        "host_ms_per_step": 1000 * stats.host_s / max(stats.steps, 1),
        "preemptions": stats.preemptions,
        "phases": log.phases(),
        "engine_mode": llm.engine.runner.mode,
        "async_scheduling": llm.engine.async_scheduling,
        "engine_config": common.engine_config(llm),
    }


P2_MAX_MODEL_LEN = 4096


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pcg bench throughput", description=__doc__.split("\n\n")[0],
                                formatter_class=common.HelpFormatter)
    common.add_common_args(p)
    common.add_process_per_mode_arg(p)
    p.add_argument("--modes", default="auto", help="comma-separated modes, e.g. eager,full_and_piecewise")
    p.add_argument("--num-prompts", type=common.int_at_least(1), default=256)
    # Defaults filled in main(): None tells a flag the user gave from one left alone.
    p.add_argument("--input-min", type=common.int_at_least(1), default=None, help="default 100")
    p.add_argument("--input-max", type=common.int_at_least(1), default=None, help="default 1024")
    p.add_argument("--output-min", type=common.int_at_least(1), default=None, help="default 100")
    p.add_argument("--output-max", type=common.int_at_least(1), default=None, help="default 1024")
    p.add_argument("--input-len", type=common.int_at_least(1), default=None, help="instead of --input-min/max: len*(1±r)")
    p.add_argument("--output-len", type=common.int_at_least(1), default=None, help="instead of --output-min/max: len*(1±r)")
    p.add_argument("--range-ratio", type=common.fraction, default=0.0, help="in [0, 1): spreads --input-len / --output-len")
    p.add_argument("--temperature", type=common.temperature, default=0.0)
    p.add_argument("--warmup-prompts", type=common.int_at_least(0), default=4, help="short requests run before measuring")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, with the length ranges checked and their defaults (P2's [100, 1024]) filled in."""
    args = make_parser().parse_args(argv)
    for kind in ("input", "output"):
        given = [f"--{kind}-{end}" for end in ("min", "max") if getattr(args, f"{kind}_{end}") is not None]
        if getattr(args, f"{kind}_len") is not None and given:
            # --input-len / --output-len replace the range: the range flag was dropped without a word, before.
            raise SystemExit(f"pcg bench throughput: --{kind}-len replaces --{kind}-min/--{kind}-max; "
                             f"give one or the other, not --{kind}-len with {' and '.join(given)}")
        if getattr(args, f"{kind}_len") is not None:
            # the range stays None: the JSON recorded [100, 1024] as if it had been drawn from (found by a review)
            continue
        for end, default in (("min", 100), ("max", 1024)):
            if getattr(args, f"{kind}_{end}") is None:
                setattr(args, f"{kind}_{end}", default)
        low, high = getattr(args, f"{kind}_min"), getattr(args, f"{kind}_max")
        if low > high:
            raise SystemExit(f"pcg bench throughput: --{kind}-min ({low}) must be <= --{kind}-max ({high})")
    if args.range_ratio and args.input_len is None and args.output_len is None:
        # (the ranges' uniform draws do not read it: it was dropped without a word)
        raise SystemExit("pcg bench throughput: --range-ratio spreads --input-len and --output-len, and neither is "
                         "given (the lengths come from --input-min..--input-max and --output-min..--output-max); "
                         "give one of them, or leave out --range-ratio")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    model = common.resolve_model(args.model, args.seed)
    if args.max_model_len is None:
        # P2's 4096, where the checkpoint holds that many positions: a fixed default was refused by a
        # smaller checkpoint ("max_model_len: got 4096; allowed: 2..2048"), a value never given.
        from pcg_engine.models.model_config import read_config
        args.max_model_len = min(P2_MAX_MODEL_LEN, read_config(model).max_position_embeddings)
    longest = [common.length_bounds(fixed, args.range_ratio)[1] if fixed is not None else hi
               for fixed, hi in ((args.input_len, args.input_max), (args.output_len, args.output_max))]
    flags = ("--input-len" if args.input_len is not None else "--input-max") + " / " + \
            ("--output-len" if args.output_len is not None else "--output-max")
    common.refuse_too_long(args, model, *longest, flags + (" / --range-ratio" if args.range_ratio else ""))
    results = common.run_each_mode(args, model, run_mode, f"{args.num_prompts} requests",
                                    bench="throughput", argv=sys.argv[1:] if argv is None else argv)
    if results is None:   # a child of --process-per-mode: its result is written
        return 0
    base = next(iter(results.values()))["output_throughput"]
    common.print_table(f"offline throughput: {args.num_prompts} requests", [
        "mode", "output tok/s", "total tok/s", "req/s", "elapsed s", "steps", "host ms/step", "vs first"],
        [[n, r["output_throughput"], r["total_token_throughput"], r["request_throughput"], r["elapsed_s"],
          r["steps"], r["host_ms_per_step"], f"{r['output_throughput'] / base:.2f}x"] for n, r in results.items()])
    for n, r in results.items():
        common.print_table(f"{n}: where the time went", ["phase", "steps", "s", "ms/step"],
                           [[k, v["steps"], v["s"], v["ms_per_step"]] for k, v in r["phases"].items()])
    common.write_mode_results(args, model, "throughput", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
