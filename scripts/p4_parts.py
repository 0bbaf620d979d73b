"""Where a P4 step's host time goes: P4 at 256 running decodes (`pcg bench overhead --host-only`'s
measure, sync scheduling) with the step's parts timed inclusively by perf_counter wrappers.

    python scripts/p4_parts.py MODEL_DIR_OR_PRESET [--steps 600] [--reps 3]

Each part's µs a timed step (warm-up and prefill steps excluded): the parts nest (schedule holds
plan_decodes, which holds grow_one_each; fake_forward holds prepare; update_after_step holds
publish_decoded; resolve_rows is inside the read-back's half of the step, wait_array is the wait,
which P4's host time leaves out). A wrapper adds ~0.3 µs a call. cProfile, the other view
(`--host-profile`), inflates functions that make many small calls; this does not, but it sees
only the functions wrapped. On the CPU the fake logits are 16 wide and the KV cache is sized as
the benchmark sizes it.
"""

import argparse

import torch
from step_timers import CALLS, TIMES, timed

from pcg_engine.bench import common, cpu_probe, host_overhead
from pcg_engine.engine import block_manager, input_batch, llm_engine, readback, scheduler
from pcg_engine.llm import LLM

PARTS = [(scheduler.Scheduler, "schedule"), (scheduler, "plan_decodes"), (block_manager.BlockManager, "grow_one_each"),
         (llm_engine.LLMEngine, "_release_preempted"), (input_batch.InputBatch, "sync_rows"),
         (host_overhead.FakeForward, "__call__"), (input_batch.InputBatch, "prepare"),
         (scheduler.Scheduler, "update_after_step"), (scheduler, "publish_decoded"), (llm_engine, "greedy_tokens"),
         (llm_engine, "argmax_rows"), (readback.TokenReadback, "start"), (readback.TokenReadback, "written"),
         (llm_engine, "launch_rows"), (readback.TokenReadback, "wait_array"), (llm_engine, "resolve_rows"),
         (llm_engine.LLMEngine, "step")]


def wrap(owner, name: str) -> None:
    """owner.name timed into step_timers' accumulators (the script beside this one)."""
    fn = getattr(owner, name, None)
    if fn is None:
        return
    w = timed(fn, "fake_forward" if name == "__call__" else name)
    setattr(owner, name, staticmethod(w) if isinstance(owner.__dict__.get(name), staticmethod) else w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    n, steps = 256, args.steps
    cuda = torch.cuda.is_available()
    kw = {} if cuda else dict(num_kv_blocks=n * (-(-(128 + steps + 5 + 64) // 16) + 1) + 16)
    llm = LLM(common.resolve_model(args.model, 0), mode="eager", max_num_seqs=n, async_scheduling=False,
              max_num_batched_tokens=2048, **kw)
    for owner, name in PARTS:
        wrap(owner, name)
    # measure() probes the CPU right before and right after its timed steps: the parts are
    # zeroed at the first probe and read at the second.
    probe, snap, calls = cpu_probe.probe, {}, [0]

    def probing():
        calls[0] += 1
        if calls[0] % 2:
            TIMES.clear()
            CALLS.clear()
        else:
            snap.update({k: (TIMES[k], CALLS[k]) for k in CALLS})
        return probe()
    host_overhead.cpu_probe.probe = probing
    for rep in range(args.reps):
        r = host_overhead.measure(llm, "persistent", n, steps, 128, 5, 1 + rep, None if cuda else 16)
        n_timed = max(snap["step"][1], 1)
        p = r["cpu_probe"]
        print(f"rep {rep}: host {r['host_ms_per_step'] * 1000:.1f} us/step; probe python "
              f"{p['before']['python_min_us']:.0f} -> {p['after']['python_min_us']:.0f} us")
        print("  " + ", ".join(f"{k} {v[0] / n_timed * 1e6:.1f}" for k, v in snap.items() if v[1]))
    llm.close()


if __name__ == "__main__":
    main()
