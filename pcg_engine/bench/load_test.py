"""P3: time to first token under load, with Poisson or gamma arrivals, for one or several engine modes.

    pcg bench load-test --model qwen3-0.6b --request-rate 20 --num-prompts 500 \
        --input-len 1024 --output-len 128 --goodput ttft:200 tpot:20 \
        --modes eager,piecewise,full_and_piecewise --json load.json [--sweep-rates]

Gaps between submissions are gamma-distributed with shape = burstiness and mean 1 / rate: shape 1 is a
Poisson process, smaller is burstier (coefficient of variation of the gaps = 1 / sqrt(shape)). The
engine runs in its own thread (engine_thread.py); the client submits on schedule regardless of how far
behind the engine is, so queueing shows up in TTFT, as it would for a server. The requests, and
their checks before any engine is built, are load_test_requests.py's.
"""

from __future__ import annotations

import argparse
import functools
import sys
import threading
import time
from collections import Counter

import numpy as np

from pcg_engine.bench import common, cpu_probe
from pcg_engine.bench.engine_thread import EngineLoop, RequestRecord, run_client
from pcg_engine.bench.load_metrics import parse_slos, summarize, table_rows
from pcg_engine.bench.load_test_requests import build_dataset, prepare, read_dataset, resolve_num_prompts


def gap_scale(rate: float, burstiness: float) -> float | None:
    """The gamma gaps' scale, 1 / (rate * burstiness), or None where it is not a finite number > 0:
    a product that underflows to 0 (ZeroDivisionError), or an inverse that overflows (gaps of NaN,
    which the client took for 'now': a Poisson run at rate 1 with --burstiness 1e-320 sent
    everything at once; or inf, a client that never sends again)."""
    product = rate * burstiness
    if not product > 0:
        return None
    scale = 1.0 / product
    return scale if 0 < scale < float("inf") else None


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Submission times (s from the start) of n requests; the first at 0, all at 0 for rate inf."""
    if rate == float("inf"):
        return np.zeros(n)
    if not (rate > 0 and burstiness > 0) or gap_scale(rate, burstiness) is None:
        raise SystemExit(f"--request-rate ({rate}) and --burstiness ({burstiness}) must be > 0, with a finite "
                         "gap scale 1 / (rate * burstiness)")
    gaps = rng.gamma(shape=burstiness, scale=gap_scale(rate, burstiness), size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n else np.zeros(0)


def run_once(llm, dataset, args, rate: float, slos: dict, label: str, progress=None) -> dict:
    """One load test at `rate` on an idle engine, from a cold prefix cache; returns summarize()'s result."""
    # A --dataset run sends the warm-up's prompts again, and sweep trials its first lines again:
    # without this their prompts hit blocks an earlier run cached, and the TTFT measured is not
    # the prefill's. (Prefixes shared within this run still hit, as they would on a server.)
    if not llm.reset_prefix_cache():
        raise RuntimeError(f"{label}: the engine still has unfinished requests before a measured run")
    params = [common.bench_params(out, args.temperature, args.detokenize) for _, out in dataset]
    requests = [(ids, p) for (ids, _), p in zip(dataset, params)]
    offsets = arrival_offsets(len(requests), rate, args.burstiness, np.random.default_rng(args.seed + 1))
    loop = EngineLoop(llm.engine)
    started: dict = {}

    def client_main():
        try:
            started["t"] = run_client(loop, requests, offsets, args.max_concurrency, id_prefix=label)
        except BaseException as e:   # surfaced below, not as a KeyError on the missing start time
            started["error"] = e
            loop.stop()
    client = threading.Thread(target=client_main, name="pcg-load-client", daemon=True)
    loop.start()
    client.start()
    task = progress.add_task(f"{label} @ {rate:g} req/s", total=len(requests), info="") if progress else None
    deadline = time.monotonic() + args.timeout if args.timeout else float("inf")
    while loop.is_alive() or client.is_alive():
        if time.monotonic() > deadline and not loop.stopped:
            loop.stop()
        if progress is not None:
            progress.update(task, completed=loop.completed + loop.failed,
                            info=f"in flight {loop.in_flight}, failed {loop.failed}")
        time.sleep(0.1)
    client.join()
    loop.join()
    loop.fail_remaining("never admitted: the run stopped first")   # a no-op after a normal run
    if progress is not None:
        progress.update(task, completed=loop.completed + loop.failed, info=f"failed {loop.failed}")
    if loop.error is not None:
        raise RuntimeError(f"the engine loop failed in mode {label}") from loop.error
    if "error" in started:
        raise RuntimeError(f"the load test's client failed in mode {label}") from started["error"]
    records = [loop.records[f"{label}-{i}"] for i in range(loop.submitted)]
    # Requests the client never sent (the time limit passed first) fail too: left out, a run cut
    # short by --timeout reported only the requests it sent, all completed, and exited 0.
    records += [RequestRecord(f"{label}-{i}", len(ids), p.max_tokens, finished=True, finish_reason="error",
                              error="never sent: the run stopped first")
                for i, (ids, p) in enumerate(requests[loop.submitted:], loop.submitted)]
    end = max([loop.last_token_time] + [r.token_times[-1] for r in records if r.token_times])
    # A run stopped by --timeout lasted until the stop, not until its last token: requests still
    # waiting for a first token then made the run look shorter and its throughput higher.
    if loop.stop_time is not None:
        end = max(end, loop.stop_time)
    return summarize(records, started["t"], end, slos)


def failures(result: dict) -> str:
    """How many of a run's requests failed, and why (the commonest reasons first)."""
    why = Counter(row["error"] for row in result["requests"] if not row["ok"])
    return (f"{result['failed']} of {len(result['requests'])} requests failed: "
            + "; ".join(f"{n} x {reason}" for reason, n in why.most_common()))


def passes(result: dict, attainment: float) -> bool:
    return result["failed"] == 0 and (result["slo_attainment"] or 0.0) >= attainment


SWEEP_MAX_DOUBLINGS = 6
DEFAULT_INPUT_LEN = 1024


def sweep_rates(run_at, start: float, ok, max_doublings: int = SWEEP_MAX_DOUBLINGS, bisect_steps: int = 3):
    """Highest rate for which ok(run_at(rate)) holds: doubling (or halving) to bracket it, then
    bisection. Returns (best rate or 0.0, [(rate, result)]) with every trial."""
    trials, good, bad = [], None, None

    def trial(rate):
        res = run_at(rate)
        trials.append((rate, res))
        return ok(res)

    rate = start
    for _ in range(max_doublings + 1):
        if trial(rate):
            good, rate = rate, rate * 2
        else:
            bad = rate
            break
    if good is None:
        rate = start / 2
        for _ in range(max_doublings):
            if trial(rate):
                good = rate
                break
            bad, rate = rate, rate / 2
    if good is not None and bad is not None:
        for _ in range(bisect_steps):
            mid = (good + bad) / 2
            if trial(mid):
                good = mid
            else:
                bad = mid
    return good or 0.0, trials


def _trial_row(rate, res) -> dict:
    return {"rate": rate, "slo_attainment": res["slo_attainment"], "goodput": res["goodput"],
            "failed": res["failed"], "ttft_p90_ms": res["ttft_ms"]["p90"], "tpot_p90_ms": res["tpot_ms"]["p90"],
            "duration_s": res["duration_s"], "cached_prompt_tokens": res["cached_prompt_tokens"]}


def sweep_start(args) -> float:
    """--sweep-rates' first rate: --sweep-start, else a finite --request-rate, else 4 req/s."""
    return args.sweep_start or (args.request_rate if args.request_rate != float("inf") else 4.0)


def sweep_mode(llm, args, prepared, slos: dict, name: str, progress) -> dict:
    """--sweep-rates for one mode: each trial a fresh set of --sweep-num-prompts requests (the
    dataset's first lines, or random prompts of a new seed) from a cold prefix cache (run_once).
    A function of its own, not a closure in main(): main deletes `llm` after each mode, which left
    the closure's name undefined to pyflakes."""
    start = sweep_start(args)
    seeds = iter(range(args.seed + 2000, args.seed + 3000))

    def run_at(rate):
        short = build_dataset(args, llm, args.sweep_num_prompts, next(seeds), prepared)
        return run_once(llm, short, args, rate, slos, f"{name}-sweep", progress)
    def ok(res):
        return passes(res, args.sweep_attainment)
    best, trials = sweep_rates(run_at, start, ok, bisect_steps=args.sweep_bisect)
    # No trial failed: the doublings ran out before a rate missed the SLOs, so the engine holds
    # more than max_rate (a sweep that never failed reported its last rate as the highest).
    return {"max_rate": best, "max_rate_is_lower_bound": all(ok(res) for _, res in trials),
            "trials": [_trial_row(r, res) for r, res in trials]}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pcg bench load-test", description=__doc__.split("\n\n")[0],
                                formatter_class=common.HelpFormatter)
    common.add_common_args(p)
    common.add_process_per_mode_arg(p)
    p.add_argument("--modes", default="auto", help="comma-separated modes, e.g. eager,piecewise+async (see common)")
    p.add_argument("--num-prompts", type=common.int_at_least(1), default=None,
                   help="requests to send (default: every line of --dataset, else 500)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf = all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    p.add_argument("--max-concurrency", type=common.int_at_least(1), default=None,
                   help="most requests in flight at once (default: no limit)")
    p.add_argument("--input-len", type=common.int_at_least(1), default=None,
                   help=f"prompt tokens of the random prompts (default {DEFAULT_INPUT_LEN}; not with --dataset)")
    p.add_argument("--output-len", type=common.int_at_least(1), default=128)
    p.add_argument("--range-ratio", type=common.fraction, default=0.0, help="lengths uniform in len*(1-r)..len*(1+r)")
    p.add_argument("--shared-prefix-len", type=common.int_at_least(0), default=0, help="random prefix shared by every prompt")
    p.add_argument("--dataset", default=None, help='JSONL: {"prompt": text or ids, "output_len": n} per line')
    p.add_argument("--temperature", type=common.temperature, default=0.0)
    p.add_argument("--detokenize", action="store_true", help="detokenize outputs (off: time the engine only)")
    # extend: a repeated --goodput adds its SLOs (it replaced the earlier ones without a word)
    p.add_argument("--goodput", nargs="+", action="extend", default=None, metavar="KEY:MS",
                   help="SLOs, e.g. ttft:200 tpot:20 (repeatable)")
    p.add_argument("--warmup", type=common.int_at_least(0), default=None,
                   help="warm-up requests per mode before measuring (default 2, at most the --dataset's lines)")
    p.add_argument("--sweep-rates", action="store_true", help="find each mode's highest rate within the SLOs")
    # The sweep's own flags: default None here, filled in from SWEEP_DEFAULTS (common.only_with).
    # At least 2: a trial of one request sends it at once whatever the rate, so every trial was
    # the same run and the sweep's answer meant nothing.
    p.add_argument("--sweep-num-prompts", type=common.int_at_least(2), default=None,
                   help="requests per sweep trial (default 100)")
    p.add_argument("--sweep-start", type=float, default=None, help="first rate tried (default --request-rate or 4)")
    p.add_argument("--sweep-attainment", type=float, default=None,
                   help="fraction of requests that must meet the SLOs (default 0.9)")
    p.add_argument("--sweep-bisect", type=common.int_at_least(0), default=None,
                   help="bisection steps after bracketing (default 3)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per run before the rest are aborted (default: no limit)")
    p.add_argument("--no-progress", action="store_true")
    return p


SWEEP_DEFAULTS = {"sweep_num_prompts": 100, "sweep_start": None, "sweep_attainment": 0.9, "sweep_bisect": 3}


def check_args(args) -> None:
    """Refuse the float flags' values that cannot make a load test, naming the flag and its range,
    before an engine is built (a minute on a GPU) rather than after; the integer flags (--seed
    among them), --range-ratio and --temperature are checked by their argparse types
    (common.int_at_least, common.fraction, common.temperature).
    A run of 0 requests printed a table of zeros."""
    common.only_with(args, "--sweep-rates", SWEEP_DEFAULTS)
    checks = [("--request-rate", args.request_rate, args.request_rate > 0, "a number > 0 (inf: all at once)"),
              ("--burstiness", args.burstiness, 0 < args.burstiness < float("inf"), "a finite number > 0"),
              ("--sweep-attainment", args.sweep_attainment, 0 < args.sweep_attainment <= 1, "a number in (0, 1]")]
    if args.timeout is not None:
        checks.append(("--timeout", args.timeout, args.timeout > 0, "seconds > 0"))
    if args.sweep_start is not None:   # (0 was taken as "unset", a NaN swept at rate nan)
        checks.append(("--sweep-start", args.sweep_start, 0 < args.sweep_start < float("inf"), "a finite number > 0"))
    for flag, value, ok, allowed in checks:
        if not ok:   # (a NaN fails every comparison, so it lands here too)
            raise SystemExit(f"pcg bench load-test: {flag} must be {allowed}, got {value}")
    if args.request_rate != float("inf") and gap_scale(args.request_rate, args.burstiness) is None:
        raise SystemExit(f"pcg bench load-test: --request-rate {args.request_rate:g} with --burstiness "
                         f"{args.burstiness:g} gives no finite gap between requests (the gaps' scale is "
                         "1 / (rate * burstiness)); raise them")
    if args.sweep_rates:    # (the default --request-rate inf skips the check above; a sweep halves its rate)
        lowest = sweep_start(args) / 2 ** SWEEP_MAX_DOUBLINGS
        if gap_scale(lowest, args.burstiness) is None:
            raise SystemExit(f"pcg bench load-test: --sweep-rates tries rates down to {lowest:g} req/s, which with "
                             f"--burstiness {args.burstiness:g} give no finite gap between requests; raise them")
    # Flags of the random prompts, dropped without a word with --dataset (its lines give each
    # request's prompt and output length; --output-len is the default for a line without one).
    if args.dataset is not None:
        for flag, value in (("--shared-prefix-len", args.shared_prefix_len), ("--range-ratio", args.range_ratio),
                            ("--input-len", args.input_len or 0)):
            if value:
                raise SystemExit(f"pcg bench load-test: {flag} shapes the random prompts; with --dataset the "
                                 f"file gives the prompts and output lengths: leave out {flag} (got {value:g})")
    # (a default of 1024 could not tell a given --input-len from none; with --dataset it stays None,
    # so the JSON's config does not record a prompt length no request had)
    if args.input_len is None and args.dataset is None:
        args.input_len = DEFAULT_INPUT_LEN


MAX_SCHEDULE_S = 24 * 3600


def check_schedule(args) -> None:
    """Refuse, before an engine is built, a run whose submissions would span more than a day on
    average ((requests - 1) gaps of mean 1 / rate) unless --timeout bounds it: --request-rate 1e-300
    (allowed, > 0) sent its first request and then waited ~1e300 s for the second."""
    if args.timeout is not None:
        return
    runs = []
    if args.request_rate != float("inf"):
        runs.append(("--request-rate", args.request_rate, args.num_prompts, "--num-prompts"))
    if args.sweep_rates:
        runs.append(("--sweep-rates' lowest rate", sweep_start(args) / 2 ** SWEEP_MAX_DOUBLINGS,
                     args.sweep_num_prompts, "--sweep-num-prompts"))
    for what, rate, n, count_flag in runs:
        span = (n - 1) / rate
        if span > MAX_SCHEDULE_S:
            raise SystemExit(f"pcg bench load-test: at {what} {rate:g} req/s the {n} requests' submissions span "
                             f"{span:.3g} s on average ({n - 1} gaps of 1 / rate), more than a day; raise the rate, "
                             f"lower {count_flag}, or give --timeout to stop the run")


def slo_text(slos: dict) -> str:
    """{'ttft': 200.0, 'tpot': 20.0} -> 'ttft <= 200 ms, tpot <= 20 ms' (the sweep's title printed the dict)."""
    return ", ".join(f"{key} <= {ms:g} ms" for key, ms in slos.items())


def run_mode(llm, args, name: str, prepared=None, slos=None) -> dict:
    """One mode's measured run (and --sweep-rates, under "sweep"), after its warm-up requests."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.console import Console
    dataset = build_dataset(args, llm, args.num_prompts, args.seed, prepared)
    if args.warmup:
        warm = build_dataset(args, llm, args.warmup, args.seed + 1000, prepared)
        # (with the run's --detokenize: the first detokenizing requests paid the tokenizer's warm-up)
        # Each prompt with its own output length, capped: with the first one's for all, a dataset
        # line of a long prompt and a short output went past max_model_len and ended the run.
        llm.generate([ids for ids, _ in warm],
                     [common.bench_params(min(out, 16), args.temperature, args.detokenize) for _, out in warm])
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[info]}"), console=Console(stderr=True), disable=args.no_progress) as progress:
        probe_before = cpu_probe.probe()
        result = run_once(llm, dataset, args, args.request_rate, slos, name, progress)
        # the core's speed on fixed host work just before and after the run: bench/cpu_probe.py
        result["cpu_probe"] = {"before": probe_before, "after": cpu_probe.probe()}
        result["engine_mode"] = llm.engine.runner.mode
        result["async_scheduling"] = llm.engine.async_scheduling
        result["engine_config"] = common.engine_config(llm)
        if args.sweep_rates:
            result["sweep"] = sweep_mode(llm, args, prepared, slos, name, progress)
    return result


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    check_args(args)
    entries = read_dataset(args.dataset) if args.dataset else None
    slos = parse_slos(args.goodput)
    if args.sweep_rates and not slos:
        raise SystemExit("--sweep-rates needs --goodput SLOs (e.g. --goodput ttft:200 tpot:20)")
    resolve_num_prompts(args, entries)
    check_schedule(args)
    # (not with --sweep-rates, whose first rate --request-rate may be; once, not again in each
    # --process-per-mode child)
    if args.num_prompts == 1 and args.request_rate != float("inf") and not args.sweep_rates and not args.mode_result:
        print(f"note: one request is sent at once: --request-rate {args.request_rate:g} has no effect "
              "(the rate sets the gaps between requests)", file=sys.stderr)
    model = common.resolve_model(args.model, args.seed)
    prepared = prepare(args, model, entries)    # every request checked before an engine is built
    results = common.run_each_mode(args, model, functools.partial(run_mode, prepared=prepared, slos=slos), None,
                                   bench="load-test", argv=sys.argv[1:] if argv is None else argv)
    if results is None:   # a child of --process-per-mode: its result is written
        return 0
    sweeps = {name: r.pop("sweep") for name, r in results.items() if "sweep" in r}
    headers, rows = table_rows(results)
    common.print_table(f"load test: {args.num_prompts} requests at {args.request_rate:g} req/s, "
                       f"burstiness {args.burstiness:g}", headers, rows)
    for name, r in results.items():
        print(f"{name}: fixed host work (bench/cpu_probe.py): {cpu_probe.summary(**r['cpu_probe'])}")
        if r["failed"]:     # (the reasons were in the JSON alone: a run exited 1 without saying why)
            print(f"{name}: {failures(r)}", file=sys.stderr)
    if sweeps:
        common.print_table(f"rate sweep: highest rate with >= {args.sweep_attainment:.0%} of requests within "
                           f"{slo_text(slos)}", ["mode", "max rate (req/s)", "trials"],
                           [[n, f"≥ {s['max_rate']:g} (no trial failed)" if s["max_rate_is_lower_bound"]
                             else s["max_rate"], len(s["trials"])] for n, s in sweeps.items()])
    first = next(iter(results.values()))
    payload = {"benchmark": "load_test", **common.env_record(model, args.device), "config": common.config_record(args),
               **first}
    if len(results) > 1:
        payload["modes"] = results
    if sweeps:
        payload["sweep"] = sweeps
    common.write_json(args.json, payload)
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
