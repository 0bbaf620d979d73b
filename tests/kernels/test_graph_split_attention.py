"""Split-KV inside CUDA graphs: the split count of a graphed decode launch comes from the bucket.

The full decode graphs launch attention with `graph_num_splits` (batch bucket, head counts, SM
count) and GRAPH_SPLIT_DECODE_TUNING's merge, whatever the requests' contexts. A replay reruns the
captured launch on new buffer contents, so here one bucket's metadata (static buffers, the
bucket's host values) is launched again and again with new seq_lens and block tables, as replays
would: every launch must record the same grid and host arguments, match the torch reference
(contexts of 1 key, on paged-block and tile boundaries, shorter than the split count, padding
requests of seq_len 0, padding rows) and, with a fused merge, leave its arrival counters at zero.
On the CPU the kernel runs in Triton's interpreter, at tiny shapes; the gpu-marked test captures
real graphs at Qwen3-0.6B's attention shapes. Fresh random inputs each run; outputs and the split
partials are poisoned (NaN) before each launch, so an unwritten or wrongly read element fails.
"""

import random

import pytest
import torch

from pcg_engine.attention import launch_config, triton_attention
from pcg_engine.attention.metadata import AttentionMetadata
from pcg_engine.attention.rope import rope_cache
from pcg_engine.attention.triton_backend import TritonAttentionBackend
from test_triton_attention import check, make_batch, reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H200_SMS = 132


@pytest.fixture
def h200_sms(monkeypatch):
    monkeypatch.setattr(launch_config, "_num_sms", lambda device: H200_SMS)


def make_backend(Hq, Hk, D, bs):
    return TritonAttentionBackend(num_heads=Hq, num_kv_heads=Hk, head_dim=D, block_size=bs,
                                  cos_sin=rope_cache(D, 64, 10000.0, device=DEVICE))


def bucket_meta(bucket, width, max_model_len, num_tokens=None, device=DEVICE):
    """What FullDecodeGraphs.metadata gives a capture: static buffers, the bucket's host values."""
    T = num_tokens or bucket
    return AttentionMetadata(
        query_start_loc=torch.zeros(bucket + 1, dtype=torch.int32, device=device),
        seq_lens=torch.zeros(bucket, dtype=torch.int32, device=device),
        block_table=torch.zeros(bucket, width, dtype=torch.int32, device=device),
        slot_mapping=torch.full((T,), -1, dtype=torch.int64, device=device),
        num_reqs=bucket, num_tokens=T, max_query_len=1, max_seq_len=max_model_len)


def load_step(static, specs, T, bs, Hq, Hk, D, dtype):
    """A new decode batch of the bucket written into the static buffers (a replay's inputs);
    returns (q, cache, the step's own metadata for the reference)."""
    width = static.block_table.shape[1]
    q, cache, meta = make_batch(specs, T, bs, Hq, Hk, D, dtype, width=width, num_blocks=1 + len(specs) * width)
    static.query_start_loc.copy_(meta.query_start_loc)
    static.seq_lens.copy_(meta.seq_lens)
    static.block_table.copy_(meta.block_table)
    return q, cache, meta


@pytest.fixture
def record_launches(monkeypatch):
    """Every attention launch's grid and non-tensor arguments (what a graph bakes in), recorded
    through Triton's CPU interpreter; None on a GPU (the launches then just run)."""
    kernel = triton_attention._unified_attention_kernel
    if type(kernel).__name__ != "InterpretedFunction":
        return None
    calls = []
    real = type(kernel).run

    def run(self, *args, grid, **kwargs):
        if self is triton_attention._unified_attention_kernel:
            host = tuple(a for a in args if not isinstance(a, torch.Tensor))
            calls.append((tuple(grid), host, tuple(sorted((k, v) for k, v in kwargs.items()
                                                           if not isinstance(v, torch.Tensor)))))
        return real(self, *args, grid=grid, **kwargs)
    monkeypatch.setattr(type(kernel), "run", run)
    return calls


def test_graph_split_count_depends_only_on_the_bucket(h200_sms):
    dev = torch.device(DEVICE)
    # 0.6B / 8B (8 kv heads) and 30B-A3B (4): about one wave of (request, kv head, split) programs
    assert [launch_config.graph_num_splits(b, 8, 1, dev) for b in (1, 2, 4, 8, 16, 256)] == [16, 8, 4, 2, 1, 1]
    assert [launch_config.graph_num_splits(b, 4, 1, dev) for b in (1, 2, 4, 8, 16, 32)] == [16, 16, 8, 4, 2, 1]
    assert launch_config.graph_num_splits(1, 8, 2, dev) == 1  # prefill q-blocks: no split
    backend = make_backend(16, 8, 128, 16)
    for bucket in (1, 2, 4, 8, 16):
        variants = set()
        for max_seq_len in (1, 7, 64, 65, 384, 4096, 40960):
            meta = bucket_meta(bucket, 4, max_seq_len)
            variants.add((backend.num_splits(meta, graphed=True), backend.kernel_variant(meta, graphed=True)))
            with backend.capturing():
                assert backend.split_launch(meta) == backend.split_launch(meta, graphed=True)
        assert len(variants) == 1, f"bucket {bucket}: the graph's launch depends on max_seq_len: {variants}"
        (splits, variant), = variants
        assert splits == launch_config.graph_num_splits(bucket, 8, 1, dev)
        fused = splits > 1 and launch_config.GRAPH_SPLIT_DECODE_TUNING.fused_merge
        assert variant.split == (splits > 1) and variant.fused_merge == fused
        assert variant.splits_pad == (launch_config.host_next_pow2(splits) if splits > 1 and not fused else 0)
    # Outside a capture the eager policy stays: batch 1 below EAGER_SPLIT_MIN_TILES key tiles does
    # not split (its merge is a second launch), 4 splits of 1-2 tiles at 384 keys, by the context at 8192.
    short = 64 * (launch_config.EAGER_SPLIT_MIN_TILES - 1)
    assert backend.num_splits(bucket_meta(1, 4, short)) == 1 and backend.num_splits(bucket_meta(1, 4, 8192)) > 16
    assert backend.num_splits(bucket_meta(1, 4, 384)) == (4 if launch_config.EAGER_SPLIT_MIN_TILES <= 6 else 1)
    backend.allow_split_kv = False
    with backend.capturing():
        assert backend.num_splits(bucket_meta(1, 4, 384)) == 1


# (Hq, Hk, D, block_size, dtype, bucket, padding rows past the last request, [seq_lens of each step])
# 132 SMs: bucket 4 x Hk 2 -> 16 splits, bucket 1 x Hk 2 -> 16 (the cap); tile 64 (head_dim <= 128),
# so 16 splits cover up to 1024 keys one tile each, and beyond that several tiles a split.
GRAPH_CASES = {
    "b4_gqa2_bf16": (4, 2, 32, 16, torch.bfloat16, 4, 0, [
        [1, 0, 0, 0],            # one key; padding requests (seq_len 0) after it
        [2, 15, 16, 17],         # shorter than the split count, on a paged-block boundary
        [63, 64, 65, 128],       # on tile boundaries
        [1000, 1, 0, 129],       # 16 tiles: every split used; a padding request in between
        [1100, 300, 33, 0],      # more tiles than splits (two tiles a split)
        [0, 0, 0, 0],            # a batch of padding only
    ]),
    "b1_gqa3_f32_pad_rows": (6, 2, 16, 4, torch.float32, 1, 2, [
        [1], [3], [4], [5], [64], [65], [200], [1025],
    ]),
}


@pytest.mark.parametrize("name", list(GRAPH_CASES))
def test_graph_split_launch_matches_reference(name, h200_sms, record_launches, poison_empty):
    Hq, Hk, D, bs, dtype, bucket, pad_rows, steps = GRAPH_CASES[name]
    T = bucket + pad_rows
    steps = steps + [[random.randint(0, 1100) for _ in range(bucket)]]   # and fresh lengths each run
    width = max(-(-s // bs) for lens in steps for s in lens) or 1
    backend = make_backend(Hq, Hk, D, bs)
    static = bucket_meta(bucket, width, 40960, num_tokens=T)
    splits = launch_config.graph_num_splits(bucket, Hk, 1, torch.device(DEVICE))
    assert splits == 16
    for lens in steps:
        q, cache, meta = load_step(static, [(1, s) for s in lens], T, bs, Hq, Hk, D, dtype)
        out = torch.full_like(q, float("nan"))
        with backend.capturing():
            backend.forward(q, out, cache, static)
        check(out, reference(q, cache, meta, backend.scale), 1e-4 if dtype == torch.float32 else 1e-2)
        zero = torch.tensor([s == 0 for s in lens] + [True] * pad_rows, device=out.device)
        assert (out[zero] == 0).all(), f"{lens}: padding requests and rows must be exactly zero"
        if launch_config.GRAPH_SPLIT_DECODE_TUNING.fused_merge:
            assert not triton_attention._COUNTERS[q.device].any(), f"{lens}: a fused merge left a counter set"
    if record_launches is None:
        return
    assert len(record_launches) == len(steps)
    assert len(set(record_launches)) == 1, "a seq_len changed the launch's grid or host arguments"
    grid, _, options = record_launches[0]
    assert grid[2] == splits and dict(options)["SPLIT"]
    assert dict(options)["FUSED_MERGE"] == launch_config.GRAPH_SPLIT_DECODE_TUNING.fused_merge


# ---------------------------------------------------------------- GPU: real graphs, real shapes

@pytest.mark.gpu
@pytest.mark.parametrize("bucket", [1, 2, 4])
@pytest.mark.parametrize("Hq", [16, 32])
def test_gpu_graph_split_replays(bucket, Hq):
    """One capture per bucket at Qwen3-0.6B / 8B attention shapes (Hk 8, head_dim 128, bf16),
    replayed on new contexts from 1 to 3000 keys and padding requests; a fused merge's counters end at zero."""
    Hk, D, bs, dtype, width = 8, 128, 16, torch.bfloat16, 200
    backend = make_backend(Hq, Hk, D, bs)
    static = bucket_meta(bucket, width, 40960)
    q = torch.zeros(bucket, Hq, D, device=DEVICE, dtype=dtype)
    cache = torch.zeros(2, 1 + bucket * width, bs, Hk, D, device=DEVICE, dtype=dtype)
    out = torch.empty_like(q)
    with backend.capturing():
        backend.forward(q, out, cache, static)   # compile, allocate the counters: outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            backend.forward(q, out, cache, static)
    lengths = [1, 2, 15, 16, 17, 63, 64, 65, 128, 129, 383, 384, 1023, 1024, 1025, 3000, 0]
    for i in range(40):
        lens = [lengths[(i + r) % len(lengths)] if i < 20 else random.randint(0, 3000) for r in range(bucket)]
        q_new, cache_new, meta = load_step(static, [(1, s) for s in lens], bucket, bs, Hq, Hk, D, dtype)
        q.copy_(q_new)
        cache.copy_(cache_new)
        out.fill_(float("nan"))
        graph.replay()
        check(out, reference(q, cache, meta, backend.scale), 1e-2)
        if launch_config.GRAPH_SPLIT_DECODE_TUNING.fused_merge:
            assert not triton_attention._COUNTERS[q.device].any()


@pytest.mark.parametrize("min_tiles", [4, 8])
def test_eager_split_count_rules(monkeypatch, min_tiles):
    """choose_num_splits (eager steps): no split below EAGER_SPLIT_MIN_TILES key tiles or on a full
    GPU; never fewer splits for a longer context (the warm-up's search relies on it); each split
    gets >= 2 tiles except the 4 splits of 4-8 tiles; the old rule (8 tiles, tiles // 2) is the
    default's."""
    from pcg_engine.attention import launch_config as lc
    monkeypatch.setattr(lc, "_num_sms", lambda device: 132)
    monkeypatch.setattr(lc, "EAGER_SPLIT_MIN_TILES", min_tiles)
    dev = torch.device("cpu")
    for reqs in (1, 2, 4, 16, 17):
        counts = [lc.choose_num_splits(reqs, reqs, 16, 8, 128, 1, keys, dev) for keys in range(1, 9000, 7)]
        assert counts == sorted(counts)
        for keys, n in zip(range(1, 9000, 7), counts):
            tiles = -(-keys // 64)
            if tiles < min_tiles or reqs * 8 >= 132:
                assert n == 1, (reqs, keys, n)
            else:
                assert n > 1 and (n <= 4 or tiles // n >= 2), (reqs, keys, n)
                if min_tiles == 8:
                    assert n == min(-(-4 * 132 // (reqs * 8)), tiles // 2, lc.MAX_SPLITS)
