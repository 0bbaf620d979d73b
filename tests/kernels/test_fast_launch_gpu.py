"""Cached direct launches on a GPU: unified_attention through its plans (attention/launch_plan.py)
gives bit for bit what the JIT path gives (PCG_FAST_LAUNCH=0), at real shapes, on new contents of
the same buffers, on new buffers, inside a CUDA-graph capture, and on a side stream."""

import pytest
import torch
import triton
import triton.language as tl

from pcg_engine.attention import launch_plan, triton_attention
from pcg_engine.attention.launch_config import GRAPH_SPLIT_DECODE_TUNING, choose_num_splits, graph_num_splits
from pcg_engine.kernels import fast_launch

from test_triton_attention import make_batch  # noqa: E402  (tests/kernels is on sys.path)

pytestmark = pytest.mark.gpu
D, BS = 128, 16


@pytest.fixture
def fresh(monkeypatch):
    if not fast_launch.ENABLED:
        pytest.skip(f"fast launches off here (PCG_FAST_LAUNCH, triton {triton.__version__})")
    monkeypatch.setattr(launch_plan, "PLANS", fast_launch.LaunchCache(64))
    return monkeypatch


def attend(q, cache, out, meta, splits, tuning=None, fast=True, monkeypatch=None):
    monkeypatch.setattr(fast_launch, "ENABLED", fast)
    triton_attention.unified_attention(q, cache, out, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                       meta.num_reqs, meta.max_query_len, D ** -0.5, splits, tuning=tuning)


def jit_out(q, cache, meta, splits, tuning, mp):
    out = torch.full_like(q, float("nan"))
    attend(q, cache, out, meta, splits, tuning, False, mp)
    return out


CASES = {  # name -> (specs, Hq, Hk, splits: int | "auto" | "graph", tuning)
    "decode_b1_1000_auto": ([(1, 1000)], 16, 8, "auto", None),
    "decode_b1_384_graph": ([(1, 384)], 16, 8, "graph", GRAPH_SPLIT_DECODE_TUNING),
    "decode_64x2048": ([(1, 2048)] * 64, 16, 8, 1, None),
    "decode_b4_fused": ([(1, 3000), (1, 16), (1, 0), (1, 700)], 32, 8, 16,
                        triton_attention.DecodeTuning(fused_merge=True)),
    "prefill_mixed": ([(512, 512), (256, 768)] + [(1, 1000)] * 6 + [(1, 0)], 16, 8, 1, None),
    "prefill_mixed_auto": ([(37, 600), (1, 1000), (5, 5)], 16, 8, "auto", None),
}


def case_batch(name, dtype=torch.bfloat16):
    specs, Hq, Hk, splits, tuning = CASES[name]
    T = sum(n for n, _ in specs) + 3
    q, cache, meta = make_batch(specs, T, BS, Hq, Hk, D, dtype)
    if splits == "auto":
        splits = choose_num_splits(T, meta.num_reqs, Hq, Hk, D, meta.max_query_len, meta.max_seq_len, q.device)
    elif splits == "graph":
        splits = graph_num_splits(meta.num_reqs, Hk, meta.max_query_len, q.device)
    return q, cache, meta, splits, tuning


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_plans_equal_the_jit(name, fresh):
    mp = fresh
    q, cache, meta, splits, tuning = case_batch(name)
    ref = jit_out(q, cache, meta, splits, tuning, mp)
    out = torch.full_like(q, float("nan"))
    attend(q, cache, out, meta, splits, tuning, True, mp)   # records
    assert launch_plan.PLANS.misses == 1 and torch.equal(out, ref)
    for i in range(3):   # the same buffers, new contents: the plan must read them
        q.copy_(torch.randn_like(q, dtype=torch.float32))
        cache.copy_(torch.randn_like(cache, dtype=torch.float32))
        ref = jit_out(q, cache, meta, splits, tuning, mp)
        out.fill_(float("nan"))
        attend(q, cache, out, meta, splits, tuning, True, mp)
        assert torch.equal(out, ref), f"content change {i}"
    assert launch_plan.PLANS.misses == 1
    q2, out2 = q.clone() * 0.5, torch.full_like(q, float("nan"))   # new addresses: the same plan
    attend(q2, cache, out2, meta, splits, tuning, True, mp)
    assert launch_plan.PLANS.misses == 1 and torch.equal(out2, jit_out(q2, cache, meta, splits, tuning, mp))
    out.fill_(float("nan"))   # another split count (grid, ints): a miss, and still the JIT's result
    attend(q, cache, out, meta, splits + 1, tuning, True, mp)
    assert launch_plan.PLANS.misses == 2 and torch.equal(out, jit_out(q, cache, meta, splits + 1, tuning, mp))


@pytest.mark.parametrize("name", ["decode_b1_384_graph", "decode_b4_fused", "decode_64x2048"])
def test_gpu_plan_inside_a_graph_capture(name, fresh):
    mp = fresh
    q, cache, meta, splits, tuning = case_batch(name)
    out = torch.empty_like(q)
    attend(q, cache, out, meta, splits, tuning, True, mp)   # record outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):   # on a side stream: the plan must launch there
        attend(q, cache, out, meta, splits, tuning, True, mp)
    assert launch_plan.PLANS.misses == 1
    for _ in range(3):
        q.copy_(torch.randn_like(q, dtype=torch.float32))
        cache.copy_(torch.randn_like(cache, dtype=torch.float32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, jit_out(q, cache, meta, splits, tuning, mp))


def test_gpu_plan_launches_on_the_current_stream(fresh):
    """On a side stream behind a long sleep, the plan's launch must wait for the new q copied in
    on that stream; launched on another stream it would read the old q."""
    mp = fresh
    q, cache, meta, splits, tuning = case_batch("decode_b1_1000_auto")
    out = torch.empty_like(q)
    attend(q, cache, out, meta, splits, tuning, True, mp)
    new_q = torch.randn_like(q, dtype=torch.float32).to(q.dtype)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)   # ~25 ms of GPU time on this stream
        q.copy_(new_q)
        attend(q, cache, out, meta, splits, tuning, True, mp)
    side.synchronize()
    assert launch_plan.PLANS.misses == 1
    assert torch.equal(out, jit_out(new_q, cache, meta, splits, tuning, mp))


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, alpha * tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


def test_gpu_exact_launch(fresh):
    fresh.setattr(fast_launch, "_EXACT", fast_launch.LaunchCache(8))
    x, y = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
    out = torch.empty_like(x)
    for i in range(3):
        x.copy_(torch.randn_like(x))
        fast_launch.launch(_axpy_kernel, (triton.cdiv(1000, 256),), x, y, out, 1000, 0.5, BLOCK=256)
        torch.testing.assert_close(out, 0.5 * x + y, rtol=0, atol=1e-6)
    assert fast_launch._EXACT.misses == 1
    # On Triton 3.6 (fast_launch._RAW_LAYOUT) the record calls the launcher's C function itself, so
    # the launches above and the plans of the other tests here went that way.
    (rec,) = fast_launch._EXACT._entries.values()
    assert (rec.launch is not rec.run) == (fast_launch.RAW and fast_launch._RAW_LAYOUT)
    fast_launch.launch(_axpy_kernel, (triton.cdiv(1000, 256),), x, y, out, 1000, 2.0, BLOCK=256)
    torch.testing.assert_close(out, 2.0 * x + y, rtol=0, atol=1e-6)
    assert fast_launch._EXACT.misses == 2
