"""Garbage-collector pauses while serving, with and without freezing start-up's objects.

    OMP_NUM_THREADS=1 python scripts/gc_pauses.py --device cpu --model tiny-qwen3
    OMP_NUM_THREADS=1 python scripts/gc_pauses.py --device cpu --model tiny-qwen3 --no-gc-freeze

The engine serves a stream of requests with the model's forward replaced by constant logits (as in
P4, `pcg bench overhead --host-only`), so a step is host work only and a collector pause stands out.
Requests arrive a few per step with varied lengths, while fewer than --queue wait, until --requests
have been added. Printed: every
collection of the oldest generation (its duration and the step it fell in), the step-time
percentiles and the slowest steps. One configuration per process: the collector's state is the
process's, so compare two runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3")
    p.add_argument("--device", default="cpu")
    p.add_argument("--mode", default="eager", help="the engine's mode: a compiled one brings Dynamo's and "
                   "Inductor's objects into the heap (the forward is replaced either way)")
    p.add_argument("--requests", type=int, default=2048)
    p.add_argument("--per-step", type=int, default=4, help="requests added each step")
    p.add_argument("--queue", type=int, default=64, help="no request is added while this many wait")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--no-gc-freeze", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()

    from pcg_engine.bench import common
    from pcg_engine.bench.host_overhead import FakeForward
    from pcg_engine.sampling_params import SamplingParams

    llm = common.build_llm(common.resolve_model(args.model, args.seed), device=args.device, mode=args.mode,
                           max_num_seqs=args.max_num_seqs, async_scheduling=False,
                           num_kv_blocks=args.max_num_seqs * 40 + 16, gc_freeze=not args.no_gc_freeze)
    engine = llm.engine
    engine.runner.execute = FakeForward(engine.runner, 16)
    frozen = gc.get_freeze_count()

    pauses, started = [], {}
    step_index = [0]

    def on_gc(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        elif info["generation"] == 2:
            pauses.append({"step": step_index[0], "ms": 1e3 * (time.perf_counter() - started["t"])})

    rng = np.random.default_rng(args.seed)
    vocab = engine.vocab_size   # token ids, no tokenizer: loading one would add its own objects
    added, times = 0, []
    gc.callbacks.append(on_gc)
    try:
        while added < args.requests or engine.has_unfinished_requests():
            arriving = args.per_step if engine.scheduler.num_waiting < args.queue else 0
            for _ in range(min(arriving, args.requests - added)):
                prompt = rng.integers(0, vocab, int(rng.integers(16, 256))).tolist()
                params = SamplingParams(temperature=0, max_tokens=int(rng.integers(16, 512)), ignore_eos=True,
                                        detokenize=False)
                engine.add_request(prompt, params, final_only=True)
                added += 1
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            step_index[0] += 1
    finally:
        gc.callbacks.remove(on_gc)
    llm.close()

    ms = np.array(times) * 1e3
    result = {"mode": args.mode, "gc_freeze": not args.no_gc_freeze, "frozen_objects": frozen, "steps": len(ms),
              "step_ms_p50": float(np.median(ms)), "step_ms_p99": float(np.percentile(ms, 99)),
              "step_ms_max": float(ms.max()), "slowest_ms": sorted(ms.tolist())[-5:],
              "full_collections": pauses, "full_collection_ms_total": sum(x["ms"] for x in pauses),
              **common.env_record(args.model, args.device)}
    print(f"gc_freeze={result['gc_freeze']} frozen objects {frozen:,}; {len(ms)} steps: p50 "
          f"{result['step_ms_p50']:.2f} ms, p99 {result['step_ms_p99']:.2f} ms, max {result['step_ms_max']:.1f} ms")
    print(f"full collections: {len(pauses)}, {result['full_collection_ms_total']:.1f} ms in all: "
          + ", ".join(f"{x['ms']:.1f} ms at step {x['step']}" for x in pauses))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
