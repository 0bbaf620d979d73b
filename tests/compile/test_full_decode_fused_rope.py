"""The full decode graphs' fused RoPE path, end to end on the CPU (Triton's interpreter, no capture).

A full_decode runner on the Triton backend runs its decode steps through FullDecodeGraphs' eager
stand-in, inside `capturing(fuse_rope=True)`: the same forward a capture records. Driven in lockstep
with an eager Triton runner (rope_kv + attention, the eager split policy) over prefill, decode
batches padded to buckets 1, 2 and 4 and contexts across paged-block and tile boundaries, its
logits must match step by step, and its decode steps must have launched the fused kernel (one a
layer) instead of rope_kv. The GPU version is tests/compile/test_mode_equivalence.py.
"""

import pytest
import torch

from compile_helpers import Lockstep, make_runner
from pcg_engine.attention import launch_config, triton_backend


@pytest.fixture(scope="module")
def runners(tiny_dense):
    mp = pytest.MonkeyPatch()
    mp.setattr(launch_config, "_num_sms", lambda device: 16)   # decode splits 8 / 4 / 2 ways at buckets 1 / 2 / 4
    mp.setattr(triton_backend, "FUSED_ROPE_ATTENTION", True)   # off by default: on for this test
    try:
        common = dict(attention_backend="triton", block_size=16, max_model_len=256)
        yield make_runner(tiny_dense, "eager", **common), make_runner(tiny_dense, "full_decode", **common)
    finally:
        mp.undo()


def test_full_decode_fused_rope_matches_eager(runners, monkeypatch):
    eager, full = runners
    monkeypatch.setattr(launch_config, "_num_sms", lambda device: 16)
    assert full.full_graphs is not None and full.full_graphs.fuse_rope and not full.full_graphs.graphs
    fused = []
    real = triton_backend.rope_decode_attention
    monkeypatch.setattr(triton_backend, "rope_decode_attention", lambda *a, **k: fused.append(1) or real(*a, **k))
    layers = len(full.kv_caches)
    lock = Lockstep([eager, full], block_size=16, blocks_per_request=6)
    try:
        # 15, 2 and 63 prompt tokens: the decodes cross a paged block (16) and a tile (64) boundary,
        # and start from 3 keys.
        for rid, n in (("a", 15), ("b", 2), ("c", 63)):
            lock.add(rid, [(5 * i + 7 * ord(rid)) % 500 + 2 for i in range(n)])
        schedule = ([[("a", 15), ("b", 2)], [("c", 63)]] + [[("a", 1), ("b", 1), ("c", 1)]] * 2
                    + [[("a", 1), ("c", 1)]] * 2 + [[("b", 1)]])
        for index, step in enumerate(schedule):
            before = len(fused)
            (ref, _), (out, inputs) = lock.step(step)
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4, msg=f"step {index}")
            if index < 2:
                assert full.last_path != "full" and len(fused) == before
            else:
                assert full.last_path == "full" and len(fused) - before == layers, f"step {index}"
                assert inputs.input_ids.shape[0] == {3: 4, 2: 2, 1: 1}[len(step)]
    finally:
        lock.close()
    assert full.backend._deferred is None and not full.backend.fuse_rope
