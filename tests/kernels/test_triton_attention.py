"""The unified paged-attention kernel and the Triton backend against the torch reference.

On the CPU the kernels run under TRITON_INTERPRET=1 (slow), so shapes are tiny; the gpu-marked
tests use real shapes and CUDA-graph capture. Fresh random data on every run, outputs poisoned
with NaN before each call so an unwritten element fails.
"""

import os

import torch

if not torch.cuda.is_available():  # before triton is imported (also done by tests/kernels/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from pcg_engine.attention.metadata import AttentionMetadata  # noqa: E402
from pcg_engine.attention.rope import rope_cache  # noqa: E402
from pcg_engine.attention.torch_backend import TorchAttentionBackend, paged_attention_reference  # noqa: E402
from pcg_engine.attention import triton_attention  # noqa: E402
from pcg_engine.attention.triton_attention import unified_attention  # noqa: E402
from pcg_engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_batch(specs, num_tokens, block_size, Hq, Hk, D, dtype, width=None, num_blocks=None, device=DEVICE):
    """specs: [(query_len, seq_len)] per request; num_tokens >= sum of query lens (the rest is padding).
    Block tables are random distinct blocks (never the scratch block 0); the cache is random."""
    qlens = [n for n, _ in specs]
    need = [(s + block_size - 1) // block_size for _, s in specs]
    width = width or max(need + [1])
    num_blocks = num_blocks or 1 + sum(need) + 2
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()
    table = torch.zeros(len(specs), width, dtype=torch.int32)
    for r, nb in enumerate(need):
        table[r, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
    qsl = torch.zeros(len(specs) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(qlens).cumsum(0)
    seq_lens = torch.tensor([s for _, s in specs], dtype=torch.int32)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64)
    for r, (n, s) in enumerate(specs):
        for i, p in enumerate(range(s - n, s)):
            if p >= 0:
                slots[qsl[r] + i] = int(table[r, p // block_size]) * block_size + p % block_size
    meta = AttentionMetadata(
        query_start_loc=qsl.to(device), seq_lens=seq_lens.to(device), block_table=table.to(device),
        slot_mapping=slots.to(device), num_reqs=len(specs), num_tokens=num_tokens,
        max_query_len=max(qlens + [1]), max_seq_len=max([s for _, s in specs] + [0]),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
    cache = torch.randn(2, num_blocks, block_size, Hk, D, device=device).to(dtype)
    q = torch.randn(num_tokens, Hq, D, device=device).to(dtype)
    return q, cache, meta


def reference(q, cache, meta, scale):
    ref = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    paged_attention_reference(q, cache, meta.query_start_loc_cpu, meta.seq_lens_cpu,
                              meta.block_table, scale, ref)
    return ref


def check(out, ref, tol):
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite output"
    err = (out.float() - ref).norm() / ref.norm().clamp_min(1e-6)
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


# (specs, padding tokens, block_size, Hq, Hk, D, dtype, num_splits)
CASES = {
    # prefill from scratch, a chunk continuing a cached prefix, decodes, a single-token request
    "mixed_gqa2": ([(5, 21), (1, 17), (7, 7), (1, 1), (3, 70)], 0, 4, 4, 2, 32, torch.float32, 1),
    # lengths exactly on block (16) and tile (64) boundaries, GQA 1, head_dim 64
    "boundaries": ([(16, 32), (1, 16), (1, 17), (16, 16), (1, 64), (2, 65)], 0, 16, 2, 2, 64, torch.float32, 1),
    # padding requests (seq_len 0) and padding rows past the last request
    "padding": ([(2, 10), (1, 0), (1, 0)], 3, 4, 4, 1, 32, torch.float32, 1),
    # several q-blocks per request (GQA 4 -> BLOCK_Q 32), causal across q-blocks
    "long_chunk": ([(40, 100), (1, 9)], 1, 16, 4, 1, 32, torch.float32, 1),
    "bf16_decode": ([(1, 33), (1, 130), (1, 5), (1, 0)], 1, 16, 4, 2, 32, torch.bfloat16, 1),
    # split-KV: empty splits, seq_len 0 and a split count above the tile count
    "split_decode": ([(1, 200), (1, 3), (1, 0), (1, 129)], 1, 4, 4, 2, 32, torch.float32, 3),
    # more requests than one chunk of the request search (shrunk to 4 below), head_dim 16, random lengths
    "many_requests": ([(int(n) % 3, int(n)) for n in torch.randint(0, 40, (11,))], 2, 4, 2, 1, 16, torch.float32, 1),
    "split_mixed": ([(3, 140), (1, 66)], 2, 16, 2, 1, 64, torch.float16, 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_unified_attention_matches_reference(name, monkeypatch):
    if name == "many_requests":
        monkeypatch.setattr(triton_attention, "SEARCH_BLOCK", 4)
    specs, pad, bs, Hq, Hk, D, dtype, splits = CASES[name]
    T = sum(n for n, _ in specs) + pad
    q, cache, meta = make_batch(specs, T, bs, Hq, Hk, D, dtype)
    scale = D ** -0.5
    out = torch.full_like(q, float("nan"))
    unified_attention(q, cache, out, meta.query_start_loc, meta.seq_lens, meta.block_table,
                      meta.num_reqs, meta.max_query_len, scale, num_splits=splits)
    check(out, reference(q, cache, meta, scale), 1e-4 if dtype == torch.float32 else 1e-2)
    assert (out[T - pad:] == 0).all(), "rows past the last request must be zero"
    for r, (n, s) in enumerate(specs):
        if s == 0:
            assert (out[meta.query_start_loc_cpu[r]:meta.query_start_loc_cpu[r] + n] == 0).all()


# Decode with split-KV under each launch variant the kernel benchmark sweeps (tile sizes, pipeline
# depth, the merge fused into the main kernel). (specs, padding tokens, block_size, Hq, Hk, D, dtype)
SPLIT_DECODE_CASES = {
    # lengths on paged-block (16) and tile boundaries, a padding request, padding rows
    "bs16": ([(1, 200), (1, 0), (1, 129), (1, 16), (1, 65)], 2, 16, 4, 2, 32, torch.bfloat16),
    # a GQA group that is not a power of two (3 of 4 padded rows), tiles spanning many paged blocks
    "bs4_gqa3": ([(1, 100), (1, 0), (1, 33), (1, 1)], 1, 4, 6, 2, 16, torch.float32),
}
TUNINGS = [
    triton_attention.DecodeTuning(64, 4, 2, False),
    triton_attention.DecodeTuning(64, 4, 2, True),
    triton_attention.DecodeTuning(16, 4, 4, True),
    triton_attention.DecodeTuning(32, 8, 3, True, 1),  # merge loads of 4 splits here: several, one partial
    triton_attention.DecodeTuning(128, 4, 1, True),
]


# Under the interpreter only tile_n and fused_merge change what runs (warps and stages are GPU
# codegen); 24 splits (above every tile count here) is slow there: one variant covers it.
SPLIT_DECODE_RUNS = [(t, s) for t in TUNINGS for s in (3, 8)] + [(TUNINGS[1], 2), (TUNINGS[1], 24)]


@pytest.mark.parametrize("tuning,splits", SPLIT_DECODE_RUNS,
                         ids=[f"n{t.tile_n}w{t.num_warps}s{t.num_stages}{'fused' if t.fused_merge else ''}-{s}"
                              for t, s in SPLIT_DECODE_RUNS])
@pytest.mark.parametrize("name", list(SPLIT_DECODE_CASES))
def test_split_decode_variants(name, tuning, splits):
    specs, pad, bs, Hq, Hk, D, dtype = SPLIT_DECODE_CASES[name]
    T = len(specs) + pad
    q, cache, meta = make_batch(specs, T, bs, Hq, Hk, D, dtype)
    out = torch.full_like(q, float("nan"))
    unified_attention(q, cache, out, meta.query_start_loc, meta.seq_lens, meta.block_table,
                      meta.num_reqs, 1, D ** -0.5, num_splits=splits, tuning=tuning)
    check(out, reference(q, cache, meta, D ** -0.5), 1e-4 if dtype == torch.float32 else 1e-2)
    assert (out[len(specs):] == 0).all() and (out[[s == 0 for _, s in specs] + [False] * pad] == 0).all()
    if tuning.fused_merge:  # reset by the merging programs: the next launch (or graph replay) starts at 0
        assert not triton_attention._COUNTERS[q.device].any(), "a fused merge left a counter set"


@pytest.mark.parametrize("name", ["split_decode", "split_mixed"])
def test_fused_merge_with_prefill_chunks(name):
    """fused_merge applies to every split launch, q-blocks of several tokens included."""
    specs, pad, bs, Hq, Hk, D, dtype, splits = CASES[name]
    T = sum(n for n, _ in specs) + pad
    q, cache, meta = make_batch(specs, T, bs, Hq, Hk, D, dtype)
    out = torch.full_like(q, float("nan"))
    unified_attention(q, cache, out, meta.query_start_loc, meta.seq_lens, meta.block_table, meta.num_reqs,
                      meta.max_query_len, D ** -0.5, num_splits=splits + 2,
                      tuning=triton_attention.DecodeTuning(fused_merge=True))
    check(out, reference(q, cache, meta, D ** -0.5), 1e-4 if dtype == torch.float32 else 1e-2)
    assert (out[T - pad:] == 0).all()
    assert not triton_attention._COUNTERS[q.device].any()


def test_kernel_variant_follows_the_tuning():
    kv = triton_attention.kernel_variant
    tuned = triton_attention.DecodeTuning(128, 8, 3, True)
    assert kv(16, 8, 128, 1, 32, tuned)[2:5] == (128, 8, 3) and kv(16, 8, 128, 1, 32, tuned).fused_merge
    assert not kv(16, 8, 128, 1, 1, tuned).fused_merge                        # no split, nothing to merge
    assert kv(16, 8, 256, 1, 32, tuned).tile_n == 64                          # head_dim 256 halves the tile
    assert kv(16, 8, 128, 7, 32, tuned)[2:5] == kv(16, 8, 128, 7, 32)[2:5]    # prefill tiles: not tuned
    assert kv(16, 8, 128, 1, 32) == kv(16, 8, 128, 1, 32, triton_attention.SPLIT_DECODE_TUNING)


def test_mismatched_arguments_are_refused_by_name():
    """The kernel trusts out's shape and the cache's head_dim: an out of another shape was written
    out of bounds (or partly left unwritten) and a cache of another head_dim attended garbage,
    both without an error; a 1-D block table gave an IndexError."""
    specs = [(3, 10), (1, 5)]
    q, cache, meta = make_batch(specs, 4, 4, 4, 2, 32, torch.float32)
    args = (meta.query_start_loc, meta.seq_lens, meta.block_table, meta.num_reqs, meta.max_query_len, 0.1)
    bad = {
        "out": (q, cache, torch.zeros(6, 4, 32, device=DEVICE), *args),   # larger than q: no overrun here
        "kv_cache": (q, torch.randn(2, cache.shape[1], 4, 2, 64, device=DEVICE), torch.zeros_like(q), *args),
        "block_table": (q, cache, torch.zeros_like(q), meta.query_start_loc, meta.seq_lens, meta.block_table[0],
                        *args[3:]),
        "query_start_loc": (q, cache, torch.zeros_like(q), meta.query_start_loc[:2], *args[1:]),
    }
    for name, call in bad.items():
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            unified_attention(*call)


def test_strided_last_dims_and_head_counts_are_refused_by_name():
    """The kernel walks head_dim and a block-table row at unit stride. These were bare asserts: an
    AssertionError with no message (and, under python -O, no check: the wrong elements were read)."""
    specs = [(3, 10), (1, 5)]
    q, cache, meta = make_batch(specs, 4, 4, 4, 2, 32, torch.float32)
    args = (meta.query_start_loc, meta.seq_lens, meta.block_table, meta.num_reqs, meta.max_query_len, 0.1)
    last_strided = lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2)   # same shape, last dim strided
    bad = {
        "q": (last_strided(q), cache, torch.zeros_like(q), *args),
        "out": (q, cache, last_strided(torch.zeros_like(q)), *args),
        "kv_cache": (q, last_strided(cache), torch.zeros_like(q), *args),
        "block_table": (q, cache, torch.zeros_like(q), meta.query_start_loc, meta.seq_lens,
                        meta.block_table.t().contiguous().t(), *args[3:]),
    }
    for name, call in bad.items():
        assert call[0].shape == q.shape
        with pytest.raises(ValueError, match=f"^{name}: expected a contiguous last dim"):
            unified_attention(*call)
    three = torch.randn(4, 3, 32, device=DEVICE)   # 3 query heads over 2 kv heads
    with pytest.raises(ValueError, match="^kv_cache: expected a kv head count"):
        unified_attention(three, cache, torch.zeros_like(three), *args)


def backend_step(backend, q, k, v, positions, out, cache, meta):
    """What one layer's two ops do (attention/op.py): RoPE + KV write, then attention into out."""
    T, D = q.shape[0], backend.head_dim
    q_rot = backend.rope_and_write_kv(q.view(T, -1, D), k.view(T, -1, D), v.view(T, -1, D), positions, cache,
                                      meta.slot_mapping)
    backend.forward(q_rot, out.view(T, -1, D), cache, meta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_matches_torch_backend(dtype):
    Hq, Hk, D, bs = 4, 2, 32, 4
    specs = [(3, 11), (1, 6), (1, 0)]
    T = sum(n for n, _ in specs) + 1
    _, cache, meta = make_batch(specs, T, bs, Hq, Hk, D, dtype)
    cos_sin = rope_cache(D, 64, 10000.0, device=DEVICE)
    q = torch.randn(T, Hq * D, device=DEVICE).to(dtype)
    k = torch.randn(T, Hk * D, device=DEVICE).to(dtype)
    v = torch.randn(T, Hk * D, device=DEVICE).to(dtype)
    positions = torch.randint(0, 64, (T,), device=DEVICE)
    for r, (n, s) in enumerate(specs):  # real positions for real tokens
        qs = int(meta.query_start_loc_cpu[r])
        positions[qs:qs + n] = torch.arange(s - n, s, device=DEVICE).clamp_min(0)
    kw = dict(num_heads=Hq, num_kv_heads=Hk, head_dim=D, block_size=bs, cos_sin=cos_sin)
    ref_cache, ref_out = cache.clone(), torch.zeros(T, Hq * D, device=DEVICE, dtype=dtype)
    backend_step(TorchAttentionBackend(**kw), q, k, v, positions, ref_out, ref_cache, meta)
    out = torch.full((T, Hq * D), float("nan"), device=DEVICE, dtype=dtype)
    backend = TritonAttentionBackend(**kw)
    assert backend.name == "triton" and backend.cuda_graph_safe
    backend_step(backend, q, k, v, positions, out, cache, meta)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    check(out.view(T, Hq, D), ref_out.float().view(T, Hq, D), tol)
    torch.testing.assert_close(cache[:, 1:], ref_cache[:, 1:], atol=tol, rtol=tol)


# ---------------------------------------------------------------- GPU: real shapes, CUDA graphs

REAL = [
    ("decode_64x2048", [(1, 2048)] * 64, 16, 8),
    ("decode_1x8192_gqa4", [(1, 8192)], 32, 8),
    ("prefill_4x512_mixed", [(512, 512)] * 2 + [(256, 768)] * 2 + [(1, 1000)] * 12 + [(1, 0)] * 2, 16, 8),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,specs,Hq,Hk", REAL, ids=[r[0] for r in REAL])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [1, "auto"])
def test_gpu_real_shapes(name, specs, Hq, Hk, dtype, splits):
    from pcg_engine.attention.triton_attention import choose_num_splits
    D, bs = 128, 16
    T = sum(n for n, _ in specs) + 3
    q, cache, meta = make_batch(specs, T, bs, Hq, Hk, D, dtype)
    if splits == "auto":
        splits = choose_num_splits(T, meta.num_reqs, Hq, Hk, D, meta.max_query_len, meta.max_seq_len, q.device)
    out = torch.full_like(q, float("nan"))
    unified_attention(q, cache, out, meta.query_start_loc, meta.seq_lens, meta.block_table,
                      meta.num_reqs, meta.max_query_len, D ** -0.5, num_splits=splits)
    check(out, reference(q, cache, meta, D ** -0.5), 1e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("Hq", [16, 32])
@pytest.mark.parametrize("tuning", [t for t in TUNINGS if t.fused_merge] + [TUNINGS[1]._replace(num_warps=8)],
                         ids=lambda t: f"n{t.tile_n}w{t.num_warps}s{t.num_stages}")
def test_gpu_fused_merge_repeated_and_replayed(Hq, tuning):
    """The fused merge's cross-program ordering (release by each split, acquire by the last) can
    only fail on a GPU, and only now and then: many eager calls, then a CUDA graph replayed on new
    data (the counters must be back at zero after every launch)."""
    Hk, D, bs, dtype = 8, 128, 16, torch.bfloat16
    specs = [(1, 8192), (1, 3000), (1, 0), (1, 16)]
    q, cache, meta = make_batch(specs, len(specs) + 2, bs, Hq, Hk, D, dtype)
    ref = reference(q, cache, meta, D ** -0.5)
    out = torch.empty_like(q)

    def call(splits):
        unified_attention(q, cache, out, meta.query_start_loc, meta.seq_lens, meta.block_table,
                          meta.num_reqs, 1, D ** -0.5, num_splits=splits, tuning=tuning)
    for i in range(60):
        out.fill_(float("nan"))
        call((16, 33, 64)[i % 3])
        check(out, ref, 1e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(64)
    for _ in range(20):
        cache.copy_(torch.randn_like(cache, dtype=torch.float32).to(dtype))
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(dtype))
        out.fill_(float("nan"))
        graph.replay()
        check(out, reference(q, cache, meta, D ** -0.5), 1e-2)
    assert not triton_attention._COUNTERS[q.device].any()


@pytest.mark.gpu
def test_gpu_backend_cuda_graph_replay():
    """Capture backend.forward once, then replay with new q/k/v, seq_lens and block tables copied
    into the static buffers (same bucket); every replay must match an eager forward."""
    Hq, Hk, D, bs, R, T, width, dtype = 16, 8, 128, 16, 8, 16, 40, torch.bfloat16
    cos_sin = rope_cache(D, 1024, 1e6, device=DEVICE)
    backend = TritonAttentionBackend(num_heads=Hq, num_kv_heads=Hk, head_dim=D, block_size=bs, cos_sin=cos_sin)

    def step():  # a new batch of the same bucket: R requests (some padding), T tokens
        specs = [(int(torch.randint(1, 3, ())), int(torch.randint(3, 600, ()))) for _ in range(R - 2)]
        specs += [(1, 0), (1, 0)]
        q_, cache, meta = make_batch(specs, T, bs, Hq, Hk, D, dtype, width=width, num_blocks=1 + R * width)
        meta.max_query_len = 2  # the bucket's, not the step's
        qkv = [torch.randn(T, h * D, device=DEVICE).to(dtype) for h in (Hq, Hk, Hk)]
        positions = torch.randint(0, 1024, (T,), device=DEVICE)
        return qkv, positions, cache, meta

    (q, k, v), positions, cache, meta = step()
    static = dict(q=q.clone(), k=k.clone(), v=v.clone(), pos=positions.clone(), cache=cache.clone(),
                  out=torch.empty(T, Hq * D, device=DEVICE, dtype=dtype))
    smeta = AttentionMetadata(meta.query_start_loc.clone(), meta.seq_lens.clone(), meta.block_table.clone(),
                              meta.slot_mapping.clone(), R, T, 2, 4096)

    def fwd():
        backend_step(backend, static["q"], static["k"], static["v"], static["pos"], static["out"], static["cache"],
                     smeta)

    fwd()  # warm up (compiles) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with backend.capturing(), torch.cuda.graph(graph):
        fwd()
    for _ in range(3):
        (q, k, v), positions, cache, meta = step()
        for name, t in (("q", q), ("k", k), ("v", v), ("pos", positions), ("cache", cache)):
            static[name].copy_(t)
        for src, dst in ((meta.query_start_loc, smeta.query_start_loc), (meta.seq_lens, smeta.seq_lens),
                         (meta.block_table, smeta.block_table), (meta.slot_mapping, smeta.slot_mapping)):
            dst.copy_(src)
        static["out"].fill_(float("nan"))
        graph.replay()
        ref_out = torch.full_like(static["out"], float("nan"))
        ref_cache = cache.clone()
        backend_step(backend, q, k, v, positions, ref_out, ref_cache, meta)  # eager (may split)
        torch.cuda.synchronize()
        check(static["out"].view(T, Hq, D), ref_out.float().view(T, Hq, D), 1e-2)
        assert torch.equal(static["cache"][:, 1:], ref_cache[:, 1:])
