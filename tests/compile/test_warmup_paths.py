"""The kernel warm-up's dummy steps through the compiled paths (tests/engine/test_warmup.py has the
rest): piecewise buckets and the unpadded compiled path, without a retrace or an eager fallback,
and without touching a KV block but the scratch block."""

import torch

from pcg_engine.engine import warmup


def test_warmup_runs_through_the_compiled_paths(dense_piecewise):
    runner = dense_piecewise
    forward = runner.forward_fn
    traces, eager_calls = forward.stats.dynamo_traces, forward.eager_calls
    kv = [c[:, 1:].clone() for c in runner.kv_caches]
    steps = warmup.warm_up(runner)
    # The torch backend compiles nothing and the CPU model has no fused kernels: one step a path.
    assert {s.path for s in steps} == {"piecewise", "compiled"}
    assert forward.stats.dynamo_traces == traces and forward.eager_calls == eager_calls
    assert all(torch.equal(old, new[:, 1:]) for old, new in zip(kv, runner.kv_caches))
