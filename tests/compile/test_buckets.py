"""Default token buckets per mode (compile/setup.token_buckets_for): piecewise keeps the dense list,
bucket 1 included (the compiled forward serves T = 1 unpadded), full_and_piecewise (decode-only steps
on full graphs, a one-token step among them) the sparse one from 2; an explicit list wins."""

from types import SimpleNamespace

import pytest

from pcg_engine.compile.full_graph import default_decode_buckets
from pcg_engine.compile.setup import token_buckets_for
from pcg_engine.config import MODES, EngineConfig, default_buckets, sparse_buckets
from pcg_engine.errors import ConfigError


def runner(mode, **config):
    cfg = EngineConfig(mode=mode, **config)
    return SimpleNamespace(config=cfg, mode=mode, max_num_tokens=max(cfg.max_num_batched_tokens, cfg.max_num_seqs))


def test_sparse_buckets_shape():
    assert sparse_buckets(2048) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048]
    assert sparse_buckets(4096)[-3:] == [2048, 3072, 4096]
    assert sparse_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]      # the limit itself is a bucket
    assert sparse_buckets(1000)[-2:] == [768, 1000]
    for limit in range(1, 5000, 37):
        b = sparse_buckets(limit)
        assert b == sorted(set(b)) and b[-1] == limit
        assert all(y <= 2 * x for x, y in zip(b, b[1:]))             # padding at most doubles a step
        assert all(y <= 1.5 * x for x, y in zip(b, b[1:]) if x >= 256)


def test_full_and_piecewise_defaults_to_sparse_buckets():
    """Qwen3-0.6B's start-up at the defaults (max_num_seqs 256, 2048-token steps): a third of the
    piece graphs, the same full decode graphs."""
    fp, pw = runner("full_and_piecewise"), runner("piecewise")
    assert token_buckets_for(fp) == [2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048]
    assert token_buckets_for(pw) == default_buckets(2048) and token_buckets_for(pw)[:3] == [1, 2, 4]
    pieces = 28 + 1                                  # split at each layer's attention
    decode = len(default_decode_buckets(256))
    assert (len(token_buckets_for(fp)) * pieces + decode, len(token_buckets_for(pw)) * pieces + decode) == \
        (406 + 35, 1537 + 35)


@pytest.mark.parametrize("mode,lowest", [("piecewise", 1), ("full_and_piecewise", 2)])
def test_explicit_buckets_and_limits(mode, lowest):
    assert token_buckets_for(runner(mode, cudagraph_buckets=[1, 3, 100, 2048])) == sorted({lowest, 3, 100, 2048})
    small = runner(mode, max_capture_tokens=48)
    assert token_buckets_for(small)[-1] == 48


@pytest.mark.parametrize("field, value, limit", [
    ("cudagraph_buckets", [8, 5000], "1..2048 (max_num_batched_tokens); [5000]"),
    ("decode_buckets", [1, 300], "1..256 (min(max_num_seqs, max_num_batched_tokens)); [300]"),
])
def test_buckets_no_step_can_reach_are_refused(field, value, limit):
    """Before: dropped without a word (token_buckets_for, FullDecodeGraphs), so [5000] captured nothing."""
    with pytest.raises(ConfigError, match=f"{field}: got ") as e:
        EngineConfig(**{field: value})
    assert e.value.field == field and limit in str(e.value)


@pytest.mark.parametrize("field", ["cudagraph_buckets", "decode_buckets"])
@pytest.mark.parametrize("mode", MODES)
def test_buckets_for_a_mode_that_never_uses_them_are_named(field, mode):
    """Before: eager and compile capture no graphs, piecewise no full ones, full_decode no piece
    graphs, and the list given for them was ignored without a word. A warning, as for the other
    settings a mode leaves unread (one config runs every mode of the benchmarks' --modes)."""
    import warnings
    modes = {"cudagraph_buckets": ("piecewise", "full_and_piecewise"),
             "decode_buckets": ("full_decode", "full_and_piecewise")}[field]
    config = EngineConfig(mode=mode, **{field: [1, 2]})
    assert getattr(config, field) == [1, 2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config.check_settings_used("cuda", mode)
    messages = [str(w.message) for w in caught]
    if mode in modes:
        assert messages == []
    else:
        assert messages == [f"EngineConfig: {field}=[1, 2] has no effect in mode {mode!r} (it shapes the graphs "
                            f"of {modes[0]} and {modes[1]})"]


@pytest.mark.parametrize("field, value, limit", [
    ("cudagraph_buckets", [8, 100], "1..64 (max_num_batched_tokens); [100]"),
    ("decode_buckets", [4, 65], "1..64 (min(max_num_seqs, max_num_batched_tokens)); [65]"),
])
def test_buckets_above_the_step_budget_are_refused(field, value, limit):
    """The scheduler gives a step at most max_num_batched_tokens tokens, a decode one of them.
    Before, the limit was max(max_num_batched_tokens, max_num_seqs): with 64-token steps and the
    default 256 sequences a bucket of 100 passed and was captured, but no step ever reached it."""
    mode = "piecewise" if field == "cudagraph_buckets" else "full_decode"
    with pytest.raises(ConfigError) as e:
        EngineConfig(mode=mode, max_num_batched_tokens=64, **{field: value})
    assert e.value.field == field and limit in str(e.value)


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_default_buckets_stop_at_the_step_budget(mode):
    """Before: max_num_batched_tokens=64 with max_num_seqs=256 gave buckets up to 256 (every one
    above 64 captured on CUDA and never replayed); now the largest is the budget."""
    buckets = token_buckets_for(runner(mode, max_num_batched_tokens=64, max_num_seqs=256))
    assert buckets[-1] == 64
    assert token_buckets_for(runner(mode, max_num_batched_tokens=100, max_num_seqs=4))[-1] == 100
