"""P4: host milliseconds per decode step without the model: rebuild vs persistent input batch.

    pcg bench overhead --host-only --model qwen3-0.6b --batch-sizes 16,64,256

The real engine runs (scheduler, block manager, sampler, placeholder bookkeeping, outputs), but the
runner's forward is replaced from outside by fake logits, so a step's host time is scheduling + input
preparation + output bookkeeping. The two input paths are swapped into the same engine: the
per-step rebuild (rebuild_baseline.py) and the persistent InputBatch. Steps are timed only once
every request is decoding. Host time is the engine's own: step() wall time minus the token read-back
wait (engine.stats); prepare_ms is the input preparation alone.

On a CPU the "device" work left, the greedy argmax over the fake logits, runs synchronously inside
the host time (~1.3 ms at 256 rows x 1024 on the dev machine; on a GPU it is a kernel launch):
--fake-vocab narrows the logits so that the figure is the host work alone.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from pcg_engine.bench import common, cpu_probe
from pcg_engine.bench.rebuild_baseline import RebuildBatch


class FakeForward:
    """Stands in for ModelRunner.execute: prepares the inputs for real, returns constant logits."""

    def __init__(self, runner, vocab: int | None = None):
        self.runner = runner
        self.logits = torch.zeros(runner.config.max_num_seqs, vocab or runner.vocab_size, device=runner.device)
        self.prepare_s = 0.0

    def __call__(self, scheduled, previous_tokens=None):
        t0 = time.perf_counter()
        with torch.inference_mode():
            inputs = self.runner.batch.prepare(scheduled, previous_tokens=previous_tokens)
        self.prepare_s += time.perf_counter() - t0
        return self.logits[:len(inputs.sample_rows)], inputs


def output_tokens(n: int, prompt_len: int, max_num_batched_tokens: int, warm_steps: int, steps: int) -> int:
    """Each request's max_tokens at n running: enough that nobody finishes while timed (prefill
    chunks + warm-up + timed steps)."""
    return common.steps_before_decoding(n, prompt_len, max_num_batched_tokens) + warm_steps + steps + 4


def measure(llm, impl: str, n: int, steps: int, prompt_len: int, warm_steps: int, seed: int,
            fake_vocab: int | None = None, profile_path: str | None = None) -> dict:
    engine, runner = llm.engine, llm.engine.runner
    persistent = runner.batch
    if impl == "rebuild":
        runner.batch = RebuildBatch(runner.config.max_num_seqs, runner.block_size, runner.device)
    fake = FakeForward(runner, fake_vocab)
    runner.execute = fake
    common.reset_stats(llm)
    try:
        ids, _, _ = common.add_random_requests(
            llm, n, prompt_len, output_tokens(n, prompt_len, engine.config.max_num_batched_tokens, warm_steps, steps),
            seed)
        common.step_until_decoding(engine, ids)
        for _ in range(warm_steps):
            engine.step()
        common.reset_stats(llm)
        fake.prepare_s = 0.0
        probe_before = cpu_probe.probe()
        profiler = cProfile.Profile() if profile_path else None
        if profiler is not None:
            profiler.enable()
        for _ in range(steps):
            engine.step()
        if profiler is not None:
            profiler.disable()
            _write_profile(profiler, profile_path, f"{impl}, {n} running, {steps} timed steps")
        common.refuse_unless_all_running(engine, ids, f"--batch-sizes {n}")
        probe_after = cpu_probe.probe()
        stats = engine.stats
        decoded = stats.generated_tokens
        result = {"impl": impl, "running": n, "steps": stats.steps,
                  "host_ms_per_step": 1000 * stats.host_s / stats.steps,
                  "prepare_ms_per_step": 1000 * fake.prepare_s / stats.steps,
                  "sync_wait_ms_per_step": 1000 * stats.sync_wait_s / stats.steps,
                  "tokens_per_step": decoded / stats.steps,
                  # how fast this machine ran fixed host work around the timed steps (bench/cpu_probe.py)
                  "cpu_probe": {"before": probe_before, "after": probe_after}}
        for rid in ids:
            if rid in engine.requests:
                engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
        return result
    finally:
        del runner.execute                  # back to the class's method
        runner.batch = persistent


def _write_profile(profiler, path: str, title: str) -> None:
    """pstats file at path, the top 40 functions by own time at path.txt (read them on the machine
    that ran it: the profile is of that host)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(path)
    text = io.StringIO()
    text.write(f"=== cProfile: {title}\n")
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    with open(path + ".txt", "w") as f:
        f.write(text.getvalue())


def _refuse_sizes_the_cache_cannot_hold(llm, args, sizes) -> None:
    """A size whose requests the KV cache cannot all hold was refused after the smaller sizes had
    been measured, as "--batch-sizes 16: only 5 of the 16 requests were still running", also where
    16 was never asked for (the default list) and --num-kv-blocks was what to change. Refused only
    where it must fail: by the end of the timed steps each request holds at least its prompt, the
    warm-up's and the timed steps' tokens (a review: counting up to max_tokens refused runs that
    measured, the CPU's own default size among them)."""
    manager = llm.engine.scheduler.block_manager
    tokens = args.prompt_len + args.warm_steps + args.host_steps
    for n in sorted(sizes):
        need = n * -(-tokens // manager.block_size)
        if need > manager.num_total_blocks:
            flag = (f"--num-kv-blocks {args.num_kv_blocks}" if getattr(args, "num_kv_blocks", None) is not None
                    else "the KV cache")
            raise SystemExit(f"--batch-sizes: {n} requests of at least {tokens} tokens need {need} KV blocks of "
                             f"{manager.block_size}; {flag} holds {manager.num_total_blocks}; give more blocks, or "
                             f"smaller sizes, --prompt-len or --host-steps")


def run_host_only(args, console) -> dict:
    sizes = args.batch_sizes
    biggest = max(sizes)
    kw = common.engine_kwargs(args)
    kw.update(mode="eager", max_num_seqs=biggest, async_scheduling=args.host_async)
    kw.setdefault("max_num_batched_tokens", 2048)
    per_request = -(-(args.prompt_len + args.host_steps + args.warm_steps + 64) // 16) + 1
    if kw.get("device", "auto") == "cpu" or not torch.cuda.is_available():
        kw.setdefault("num_kv_blocks", biggest * per_request + 16)   # the CPU default (512) is too small
    model = common.resolve_model(args.model, args.seed)
    # Before the engine: a request too long for it was refused under the engine's field names
    # (prompt_token_ids, max_tokens), naming no flag.
    common.refuse_too_long(args, model, args.prompt_len, max(
        output_tokens(n, args.prompt_len, kw["max_num_batched_tokens"], args.warm_steps, args.host_steps)
        for n in sizes), "--prompt-len / --host-steps / --warm-steps")
    llm = common.build_llm(model, **kw)
    _refuse_sizes_the_cache_cannot_hold(llm, args, sizes)
    rows = []
    for i, n in enumerate(sizes):
        for j, impl in enumerate(("rebuild", "persistent")):
            # Fresh prompts per run: repeating them would let the prefix cache skip the next run's prefill.
            seed = args.seed + 1 + 2 * i + j
            with console.status(f"{impl} at {n} running requests"):
                profile = getattr(args, "host_profile", None) if impl == "persistent" and n == biggest else None
                rows.append(measure(llm, impl, n, args.host_steps, args.prompt_len, args.warm_steps, seed,
                                    getattr(args, "fake_vocab", None), profile))
    llm.close()
    by = {(r["impl"], r["running"]): r for r in rows}
    summary = []
    for n in sizes:
        reb, per = by[("rebuild", n)], by[("persistent", n)]
        summary.append({"running": n, "rebuild_host_ms": reb["host_ms_per_step"],
                        "persistent_host_ms": per["host_ms_per_step"],
                        "speedup": reb["host_ms_per_step"] / max(per["host_ms_per_step"], 1e-9),
                        "rebuild_prepare_ms": reb["prepare_ms_per_step"],
                        "persistent_prepare_ms": per["prepare_ms_per_step"],
                        "prepare_speedup": reb["prepare_ms_per_step"] / max(per["prepare_ms_per_step"], 1e-9)})
    fake = getattr(args, "fake_vocab", None)
    common.print_table(f"host ms per decode step (no model; async={args.host_async}"
                       f"{f'; fake logits {fake} wide' if fake else ''}); "
                       "target: persistent <= 0.25 ms at 256 and >= 4x faster than rebuild",
                       ["running", "rebuild ms", "persistent ms", "speed-up", "rebuild prepare ms",
                        "persistent prepare ms", "prepare speed-up"],
                       [[s["running"], s["rebuild_host_ms"], s["persistent_host_ms"], f"{s['speedup']:.2f}x",
                         s["rebuild_prepare_ms"], s["persistent_prepare_ms"], f"{s['prepare_speedup']:.2f}x"]
                        for s in summary])
    for r in rows:
        print(f"{r['impl']} at {r['running']}: fixed host work (bench/cpu_probe.py): {cpu_probe.summary(**r['cpu_probe'])}")
    return {"benchmark": "host_overhead", **common.env_record(model, args.device),
            "config": common.config_record(args), "host_only": summary, "runs": rows}
