"""Serving metrics from per-request token times, as the common serving benchmarks define them (P3).

  TTFT   submission to first output token (queueing and prefill included)
  TPOT   per request (E2EL - TTFT) / (output tokens - 1), over requests with more than one token
  ITL    gaps between successive output tokens, pooled over all requests
  E2EL   submission to last token
  goodput  completed requests per second that meet every SLO given (ms): ttft, tpot, e2el
  cached   prompt tokens served from the prefix cache, per request (cached_tokens) and per run
           (cached_prompt_tokens); a run starts cold, so they come from prefixes shared within it
"""

from __future__ import annotations

from pcg_engine.bench.common import percentiles

SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """['ttft:200', 'tpot:20'] -> {'ttft': 200.0, 'tpot': 20.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not sep or key not in SLO_KEYS or not 0 < ms < float("inf"):    # (NaN fails too: it met every SLO)
            raise SystemExit(f"--goodput: {item!r} is not KEY:MS with KEY in {', '.join(SLO_KEYS)} and MS a finite "
                             "number > 0")
        if key in slos:
            raise SystemExit(f"--goodput: {key} is given twice")
        slos[key] = ms
    return slos


def request_row(rec) -> dict:
    """One request's latencies in ms (None where it has no tokens)."""
    t = rec.token_times
    # A request that finished without a token has no TTFT: summarize counts it failed, and its row
    # says so (it read "ok": true, "error": null among the failed).
    empty = rec.ok and not t
    row = {"id": rec.request_id, "prompt_len": rec.prompt_len, "output_len_asked": rec.output_len,
           "output_len": rec.num_output_tokens, "ok": rec.ok and not empty,
           "error": "finished without an output token" if empty else rec.error,
           "ttft_ms": None, "tpot_ms": None, "e2el_ms": None, "engine_ttft_ms": None, "cached_tokens": None}
    m = rec.engine_metrics      # the engine's own stamps, same clock: a cross-check of the client's
    if m is not None:
        row["cached_tokens"] = m.num_cached_tokens   # prompt tokens found in the prefix cache, not computed
        if m.first_token_time is not None:
            row["engine_ttft_ms"] = 1000 * (m.first_token_time - m.arrival_time)
    if t:
        row["ttft_ms"] = 1000 * (t[0] - rec.submit_time)
        row["e2el_ms"] = 1000 * (t[-1] - rec.submit_time)
        if len(t) > 1:
            row["tpot_ms"] = (row["e2el_ms"] - row["ttft_ms"]) / (len(t) - 1)
    return row


def meets(row: dict, slos: dict[str, float]) -> bool:
    if not row["ok"]:
        return False
    for key, ms in slos.items():
        value = row[f"{key}_ms"]
        if value is None:
            if key == "tpot":      # a one-token request has no TPOT: it cannot break that objective
                continue
            return False
        if value > ms:
            return False
    return True


def summarize(records, start: float, end: float, slos: dict[str, float]) -> dict:
    """The result of one run: counts, throughputs, latency stats, goodput and per-request rows."""
    rows = [request_row(r) for r in records]
    ok = [r for r, rec in zip(rows, records) if rec.ok and rec.token_times]
    duration = max(end - start, 1e-9)
    itl = []
    for rec in records:
        if rec.ok:
            itl += [1000 * (b - a) for a, b in zip(rec.token_times, rec.token_times[1:])]
    out_tokens = sum(r["output_len"] for r in ok)
    in_tokens = sum(r["prompt_len"] for r in ok)
    good = [r for r in ok if meets(r, slos)] if slos else []
    return {
        "completed": len(ok),
        "failed": len(rows) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "cached_prompt_tokens": sum(r["cached_tokens"] or 0 for r in ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": percentiles([r["ttft_ms"] for r in ok]),
        "tpot_ms": percentiles([r["tpot_ms"] for r in ok if r["tpot_ms"] is not None]),
        "itl_ms": percentiles(itl),
        "e2el_ms": percentiles([r["e2el_ms"] for r in ok]),
        "goodput": len(good) / duration if slos else None,
        "slo_attainment": len(good) / max(len(rows), 1) if slos else None,
        "slos_ms": slos,
        "requests": rows,
    }


def table_rows(results: dict[str, dict]) -> tuple[list[str], list[list]]:
    """Headers and rows of a side-by-side table, one column per mode."""
    names = list(results)
    # n/a where a run has no value (goodput without --goodput SLOs), as the latency rows say it
    # (the goodput row read "None").
    rows = [[key] + ["n/a" if results[n][key] is None else results[n][key] for n in names]
            for key in ("completed", "failed", "duration_s", "request_throughput", "output_throughput", "goodput")]
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        for stat in ("mean", "median", "p90", "p99"):
            rows.append([f"{metric[:-3]} {stat} (ms)"] + ["n/a" if results[n][metric][stat] is None
                                                          else results[n][metric][stat] for n in names])
    return ["metric"] + names, rows
