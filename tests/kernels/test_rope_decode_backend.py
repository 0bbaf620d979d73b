"""The Triton backend's fused-RoPE decode path (triton_backend.py, rope_decode_attention.py).

Inside `capturing(fuse_rope=True)` (the full decode graphs over the eager model) a decode step's
rope_and_write_kv launches nothing and its forward() launches the fused kernel; a step that is not
one decode token a request runs the deferred rope_kv launch and attention as before; everywhere
else, and with PCG_FUSED_ROPE_ATTENTION=0, nothing changes. Each layer's result is compared with
the two-launch path on the same inputs: cache and (where both rotate q the same way) outputs
exact, the fused output within float-sum tolerance. Launches are recorded through Triton's CPU
interpreter to check that the fused kernel's grid and host arguments depend on the bucket only.
"""

import pytest
import torch

from pcg_engine.attention import launch_config, rope_decode_attention as rda, triton_backend
from pcg_engine.attention.rope import rope_cache
from pcg_engine.attention.triton_backend import TritonAttentionBackend
from test_graph_split_attention import bucket_meta
from test_rope_decode_attention import EPS, MAX_POS, make_step
from test_triton_attention import check

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
Hq, Hk, D, BS = 4, 2, 32, 4


@pytest.fixture(autouse=True)
def fused_rope_on(monkeypatch):   # off by default (triton_backend.FUSED_ROPE_ATTENTION): this file tests it on
    monkeypatch.setattr(triton_backend, "FUSED_ROPE_ATTENTION", True)


@pytest.fixture
def h200_sms(monkeypatch):   # bucket 1 x Hk 2 on 132 SMs: 16 splits, as on the H200
    monkeypatch.setattr(launch_config, "_num_sms", lambda device: 132)


@pytest.fixture
def calls(monkeypatch):
    """How often the backend called each launcher."""
    counts = {"fused": 0, "rope_kv": 0, "attention": 0}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapped
    monkeypatch.setattr(triton_backend, "rope_decode_attention", spy("fused", triton_backend.rope_decode_attention))
    monkeypatch.setattr(triton_backend, "rope_and_write_kv", spy("rope_kv", triton_backend.rope_and_write_kv))
    monkeypatch.setattr(triton_backend, "unified_attention", spy("attention", triton_backend.unified_attention))
    return counts


def new_backend():
    return TritonAttentionBackend(num_heads=Hq, num_kv_heads=Hk, head_dim=D, block_size=BS,
                                  cos_sin=rope_cache(D, MAX_POS, 1e6, device=DEVICE))


def loaded(s, T, width):
    """The bucket's metadata (static buffers, host values of the bucket) holding step s."""
    meta = bucket_meta(s["num_reqs"], width, 40960, num_tokens=T)
    meta.slot_mapping.copy_(s["slots"])
    meta.seq_lens.copy_(s["seq_lens"])
    meta.block_table.copy_(s["block_table"])
    meta.query_start_loc.copy_(s["qsl"])
    return meta


def layer(backend, s, meta, fuse_rope):
    """One layer's two ops, as attention/op.py calls them; returns (op's q, cache, out)."""
    cache = s["cache"].clone()
    out = torch.full(s["q"].shape, float("nan"), dtype=s["q"].dtype, device=s["q"].device)
    with backend.capturing(fuse_rope=fuse_rope):
        q_rot = backend.rope_and_write_kv(s["q"], s["k"], s["v"], s["positions"], cache, meta.slot_mapping,
                                          s["q_norm"], s["k_norm"], EPS)
        backend.forward(q_rot, out, cache, meta)
    return q_rot, cache, out


@pytest.fixture
def record_launches(monkeypatch):
    """Grid and non-tensor arguments of every fused-kernel launch (interpreter only, else None)."""
    kernel = rda._rope_decode_attention_kernel
    if type(kernel).__name__ != "InterpretedFunction":
        return None
    launches = []
    real = type(kernel).run

    def run(self, *args, grid, **kwargs):
        if self is rda._rope_decode_attention_kernel:
            launches.append((tuple(grid), tuple(a for a in args if not isinstance(a, torch.Tensor)),
                             tuple(sorted((k, v) for k, v in kwargs.items() if not isinstance(v, torch.Tensor)))))
        return real(self, *args, grid=grid, **kwargs)
    monkeypatch.setattr(type(kernel), "run", run)
    return launches


def test_full_graph_decode_fuses_the_rope_launch(h200_sms, calls, record_launches):
    backend, width = new_backend(), 40
    steps = [[1, 0], [4, 5], [65, 0], [130, 17], [0, 3]]   # one key, block edges, tiles, padding
    for lens in steps:
        s = make_step(lens, 0, Hq, Hk, D, BS, torch.float32, width=width)
        meta = loaded(s, 2, width)
        before = dict(calls)
        _, ref_cache, ref_out = layer(backend, s, meta, fuse_rope=False)
        assert (calls["rope_kv"] - before["rope_kv"], calls["attention"] - before["attention"]) == (1, 1)
        before = dict(calls)
        q_rot, cache, out = layer(backend, s, meta, fuse_rope=True)
        assert calls["fused"] - before["fused"] == 1 and calls["rope_kv"] == before["rope_kv"]
        assert calls["attention"] == before["attention"]
        assert q_rot.shape == s["q"].shape and q_rot.data_ptr() != s["q"].data_ptr()
        # (on a GPU the norm's fp32 sums may round differently at these tiny shapes, see
        # test_rope_decode_attention.bit_exact_expected; the real shapes are checked there)
        if DEVICE == "cpu":
            assert torch.equal(cache, ref_cache), f"{lens}: the cache differs from the two launches'"
        else:
            torch.testing.assert_close(cache, ref_cache, rtol=1e-5, atol=1e-5)
        check(out, ref_out.float(), 1e-5)
        assert backend._deferred is None
    if record_launches is not None:   # a replay relaunches the captured grid: nothing may follow seq_lens
        assert len(record_launches) == len(steps) and len(set(record_launches)) == 1
        grid, _, options = record_launches[0]
        assert grid == (2, Hk, launch_config.graph_num_splits(2, Hk, 1, torch.device(DEVICE))) == (2, Hk, 16)
        assert dict(options)["SPLIT"]


def test_other_steps_run_the_deferred_rope_kv(h200_sms, calls):
    """Padding rows past the last request (T > R): not the fused kernel's step. The deferred rope_kv
    writes the op's placeholder and the attention is the two-launch path's, bit for bit."""
    backend, width = new_backend(), 40
    s = make_step([9, 0, 70], 2, Hq, Hk, D, BS, torch.float32, width=width)
    meta = loaded(s, 5, width)
    ref_q, ref_cache, ref_out = layer(backend, s, meta, fuse_rope=False)
    q_rot, cache, out = layer(backend, s, meta, fuse_rope=True)
    assert calls["fused"] == 0 and calls["rope_kv"] == 2 and calls["attention"] == 2
    # the same kernels on the same inputs; only slot 0 of the scratch block is raced for (3 padding rows)
    assert torch.equal(q_rot, ref_q) and torch.equal(out, ref_out)
    assert torch.equal(cache[:, 1:], ref_cache[:, 1:]) and torch.equal(cache[:, 0, 1:], ref_cache[:, 0, 1:])


def test_switch_and_variants(h200_sms, monkeypatch):
    backend = new_backend()
    meta = bucket_meta(1, 4, 40960)
    padded = bucket_meta(1, 4, 40960, num_tokens=3)
    assert backend.kernel_variant(meta, graphed=True).rope_fused
    assert not backend.kernel_variant(meta, graphed=False).rope_fused
    assert not backend.kernel_variant(padded, graphed=True).rope_fused
    # large decode buckets run one split: there the two launches stay (the fused prologue slowed
    # the attention loop, session 5); a bucket of 128 requests gives one split on 132 SMs
    big = bucket_meta(128, 4, 40960)
    assert backend.num_splits(big, graphed=True) == 1 and not backend.kernel_variant(big, graphed=True).rope_fused
    # the fused variant is its own warm-up key, otherwise the same launch choices
    assert backend.kernel_variant(meta, graphed=True) != backend.kernel_variant(meta, graphed=True)._replace(
        rope_fused=False)
    with backend.capturing(fuse_rope=True):
        assert backend.fuse_rope and backend.kernel_variant(meta).rope_fused
    with backend.capturing():
        assert not backend.fuse_rope and not backend.kernel_variant(meta).rope_fused
    assert not backend.graphed and not backend.fuse_rope

    monkeypatch.setattr(triton_backend, "FUSED_ROPE_ATTENTION", False)   # PCG_FUSED_ROPE_ATTENTION=0
    assert not backend.kernel_variant(meta, graphed=True).rope_fused
    s = make_step([5], 0, Hq, Hk, D, BS, torch.float32)
    cache = s["cache"].clone()
    with backend.capturing(fuse_rope=True):
        assert not backend.fuse_rope
        q_rot = backend.rope_and_write_kv(s["q"], s["k"], s["v"], s["positions"], cache, s["slots"],
                                          s["q_norm"], s["k_norm"], EPS)
    assert backend._deferred is None and torch.isfinite(q_rot).all()   # rotated now, not deferred


def test_misuse_fails_loudly():
    backend = new_backend()
    s = make_step([5], 0, Hq, Hk, D, BS, torch.float32)
    meta = loaded(s, 1, s["block_table"].shape[1])
    args = (s["q"], s["k"], s["v"], s["positions"], s["cache"], meta.slot_mapping, s["q_norm"], s["k_norm"], EPS)
    with backend.capturing(fuse_rope=True):
        backend.rope_and_write_kv(*args)
        with pytest.raises(RuntimeError, match="no attention call"):
            backend.rope_and_write_kv(*args)
    assert backend._deferred is None    # leaving capturing() drops what a failed forward left
    with backend.capturing(fuse_rope=True):
        backend.rope_and_write_kv(*args)
        with pytest.raises(RuntimeError, match="another q"):
            backend.forward(s["q"].clone(), torch.empty_like(s["q"]), s["cache"], meta)
