"""Decode attention with the q/k norm, RoPE and KV write fused in, against the two launches it replaces.

The reference path is what the full decode graphs ran before: rope_and_write_kv (rope_kv.py) then
unified_attention with the graphed decode launch's split count and tuning. The fused kernel must
give the same rotated q and the same cache contents (real blocks, the scratch block of slot -1,
padding rows) bit for bit (in the interpreter, and on the GPU at the real shapes: compare's
docstring), and the same attention output up to the order of float sums; padding
requests (seq_len 0) and rows past the last request are exactly zero. Fresh random data every run,
outputs poisoned (NaN) before each call. On the CPU the kernels run in Triton's interpreter at tiny
shapes; the gpu-marked tests run Qwen3-0.6B / 8B attention shapes in bf16, and inside a CUDA graph
replayed on new inputs as the full decode graphs do.
"""

import random

import pytest
import torch

from pcg_engine.attention import launch_config
from pcg_engine.attention.launch_config import GRAPH_SPLIT_DECODE_TUNING
from pcg_engine.attention.rope import apply_rope, rope_cache
from pcg_engine.attention.rope_decode_attention import rope_decode_attention
from pcg_engine.attention.rope_kv import rope_and_write_kv
from pcg_engine.attention.torch_backend import paged_attention_reference, write_kv
from pcg_engine.attention.triton_attention import unified_attention
from pcg_engine.attention.triton_backend import TritonAttentionBackend
from pcg_engine.kernels.norm import rms_norm_ref
from test_graph_split_attention import bucket_meta
from test_triton_attention import check

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_POS = 9000
EPS = 1e-6


def make_step(lens, pad_rows, Hq, Hk, D, bs, dtype, width=None, device=DEVICE):
    """A decode batch: request r has seq_len lens[r], its new token at position lens[r] - 1 of its
    own random blocks; seq_len 0 is a padding request (slot -1, a stray position), and pad_rows rows
    after the requests are padding too. q, k, v are strided views of one qkv output, as the model
    gives them; the cache is random (so stale keys would show)."""
    R, T = len(lens), len(lens) + pad_rows
    need = [-(-s // bs) for s in lens]
    width = width or max(need + [1])
    num_blocks = 1 + R * width
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()
    table = torch.zeros(R, width, dtype=torch.int32)
    for r in range(R):
        table[r] = torch.tensor(perm[r * width:(r + 1) * width], dtype=torch.int32)
    positions = torch.randint(0, MAX_POS, (T,))
    slots = torch.full((T,), -1, dtype=torch.int64)
    for r, s in enumerate(lens):
        if s > 0:
            positions[r] = s - 1
            slots[r] = int(table[r, (s - 1) // bs]) * bs + (s - 1) % bs
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, device=device).to(dtype)
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    return dict(
        q=q.view(T, Hq, D), k=k.view(T, Hk, D), v=v.view(T, Hk, D), positions=positions.to(device),
        slots=slots.to(device), cache=torch.randn(2, num_blocks, bs, Hk, D, device=device).to(dtype),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), block_table=table.to(device),
        qsl=torch.arange(R + 1, dtype=torch.int32, device=device), num_reqs=R,
        q_norm=(torch.rand(D) + 0.5).to(dtype).to(device), k_norm=(torch.rand(D) + 0.5).to(dtype).to(device),
        cos_sin=rope_cache(D, MAX_POS, 1e6, device=device), scale=D ** -0.5)


def two_kernels(s, splits, tuning=GRAPH_SPLIT_DECODE_TUNING):
    """(rotated q, cache, out) of the reference path."""
    cache = s["cache"].clone()
    q_rot = rope_and_write_kv(s["q"], s["k"], s["v"], s["positions"], s["cos_sin"], cache, s["slots"],
                              q_norm=s["q_norm"], k_norm=s["k_norm"], eps=EPS)
    out = torch.full(s["q"].shape, float("nan"), dtype=s["q"].dtype, device=s["q"].device)
    unified_attention(q_rot, cache, out, s["qsl"], s["seq_lens"], s["block_table"], s["num_reqs"], 1,
                      s["scale"], splits, tuning=tuning if splits > 1 else None)
    return q_rot, cache, out


def fused(s, splits, tuning=GRAPH_SPLIT_DECODE_TUNING):
    cache = s["cache"].clone()
    out = torch.full(s["q"].shape, float("nan"), dtype=s["q"].dtype, device=s["q"].device)
    q_out = torch.full_like(out, float("nan"))
    rope_decode_attention(s["q"], s["k"], s["v"], s["positions"], s["cos_sin"], cache, s["slots"], out,
                          s["seq_lens"], s["block_table"], s["num_reqs"], s["scale"], splits, s["q_norm"],
                          s["k_norm"], EPS, tuning=tuning if splits > 1 else None, q_out=q_out)
    return q_out, cache, out


def scratch_candidates(s):
    """What each padding row alone writes into slot 0 of the scratch block: [2, Hk, D] each."""
    found = []
    for t in (s["slots"] < 0).nonzero().flatten().tolist():
        cache = s["cache"].clone()
        rope_and_write_kv(s["q"][t:t + 1], s["k"][t:t + 1], s["v"][t:t + 1], s["positions"][t:t + 1],
                          s["cos_sin"], cache, s["slots"][t:t + 1], q_norm=s["q_norm"], k_norm=s["k_norm"], eps=EPS)
        found.append(cache[:, 0, 0])
    return found


def same(got, want, exact, what):
    if exact:
        assert torch.equal(got, want), f"{what} differs in {(got != want).sum()} of {got.numel()} elements"
    else:  # a rounding step or two of the storage dtype (values are O(1) after the norm)
        eps = torch.finfo(got.dtype).eps
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * eps, atol=8 * eps, msg=what)


def compare(s, splits, tol, exact=None):
    """Fused against the two launches: q and the cache exact (see below), out within tol, padding zero.

    exact (default: in the interpreter): q and k bit for bit. On a GPU the norm's fp32 sum of
    squares is summed in an order set by the register layout, which follows the shape and the
    warp count; the fused kernel sums rope_kv's shapes with rope_kv's 4 warps at the real shapes
    (test_gpu_rope_bit_identical), while at tiny shapes rope_kv runs 1 warp and may differ by a bit."""
    ref_q, ref_cache, ref_out = two_kernels(s, splits)
    q_out, cache, out = fused(s, splits)
    exact = DEVICE == "cpu" if exact is None else exact
    real = s["slots"] >= 0
    same(q_out[real], ref_q[real], exact, "rotated q")
    assert torch.isfinite(q_out).all(), "a row's rotated q was not computed"
    same(cache[:, 1:], ref_cache[:, 1:], exact, "the cache")
    assert torch.equal(cache[:, 0, 1:], s["cache"][:, 0, 1:]), "a write landed in the scratch block past slot 0"
    candidates = scratch_candidates(s)
    if candidates and exact:  # several padding rows race for slot 0; each head holds one row's k and v
        for h in range(cache.shape[3]):
            assert any(torch.equal(cache[:, 0, 0, h], c[:, h]) for c in candidates), f"scratch head {h}"
    elif candidates:
        assert torch.isfinite(cache[:, 0, 0]).all()
    else:
        assert torch.equal(cache[:, 0], s["cache"][:, 0])
    check(out, ref_out.float(), tol)
    zero = torch.tensor([n == 0 for n in s["seq_lens"].tolist()] + [True] * (len(out) - s["num_reqs"]))
    assert (out[zero.to(out.device)] == 0).all(), "padding requests and rows must be exactly zero"


# (Hq, Hk, D, block_size, dtype, seq_lens, padding rows, splits). Tiles are 64 keys (head_dim <= 128).
CASES = {
    "gqa1_d64_bf16_nosplit": (2, 2, 64, 16, torch.bfloat16, [1, 16, 17, 0, 65], 0, 1),
    "gqa2_d32_f32_split3": (4, 2, 32, 4, torch.float32, [1, 4, 5, 0, 70, 128], 1, 3),
    "gqa4_d64_bf16_split16": (8, 2, 64, 16, torch.bfloat16, [1, 17, 65, 130], 0, 16),  # splits > tiles
    "gqa3_d16_f32_split16": (6, 2, 16, 4, torch.float32, [1, 4, 5, 0, 300], 1, 16),
    "gqa2_d128_f16_split4": (4, 2, 128, 16, torch.float16, [1, 16, 17, 129, 257], 0, 4),
    "gqa2_bs16_tile_boundaries": (4, 2, 32, 16, torch.float32, [63, 64, 65, 192, 193], 0, 2),
    "padding_only": (4, 2, 32, 4, torch.float32, [0, 0], 1, 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fused_matches_rope_kv_then_attention(name):
    Hq, Hk, D, bs, dtype, lens, pad_rows, splits = CASES[name]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    compare(make_step(lens, pad_rows, Hq, Hk, D, bs, dtype), splits, tol)


def test_fused_random_lengths():
    lens = [random.choice([0, 1, random.randint(2, 300)]) for _ in range(3)] + [random.randint(1, 300)]
    compare(make_step(lens, 1, 4, 2, 32, 8, torch.float32), random.choice([1, 2, 5, 16]), 1e-5)


@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_fused_matches_the_pytorch_chain(eps):
    """Against PyTorch alone: rms_norm_ref -> apply_rope -> write_kv -> paged_attention_reference.
    The tests above compare with rope_kv + unified_attention, which share the head norm's Triton
    helper with the fused kernel, so a bug there showed on both sides (found by a test audit: the
    kernels with eps dropped from the norm passed). q and k are scaled so that their mean square is
    about eps, where eps moves the result by ~30%, and one request's new q and k are zero (0/0 there
    without eps). The padding rows carry positions outside the RoPE table, which the kernel clamps."""
    s = make_step([1, 9, 0, 33], 1, 4, 2, 32, 4, torch.float32)
    scale = eps ** 0.5
    s["q"].mul_(scale), s["k"].mul_(scale)        # views of one qkv buffer: v keeps its scale
    s["q"][1].zero_(), s["k"][1].zero_()
    s["positions"][2], s["positions"][4] = -3, 10**9
    cache = s["cache"].clone()
    out = torch.full(s["q"].shape, float("nan"), device=DEVICE)
    q_out = torch.full_like(out, float("nan"))
    rope_decode_attention(s["q"], s["k"], s["v"], s["positions"], s["cos_sin"], cache, s["slots"], out,
                          s["seq_lens"], s["block_table"], s["num_reqs"], s["scale"], 2, s["q_norm"],
                          s["k_norm"], eps, tuning=GRAPH_SPLIT_DECODE_TUNING, q_out=q_out)
    ref_cache = s["cache"].clone()
    clamped = s["positions"].clamp(0, MAX_POS - 1)
    ref_q = apply_rope(rms_norm_ref(s["q"], s["q_norm"], eps), clamped, s["cos_sin"])
    write_kv(apply_rope(rms_norm_ref(s["k"], s["k_norm"], eps), clamped, s["cos_sin"]), s["v"],
             ref_cache, s["slots"])
    ref_out = torch.empty_like(out)
    paged_attention_reference(ref_q, ref_cache, s["qsl"], s["seq_lens"], s["block_table"], s["scale"], ref_out)
    real = s["slots"] >= 0
    torch.testing.assert_close(q_out[real], ref_q[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache[:, 1:], ref_cache[:, 1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:s["num_reqs"]], ref_out[:s["num_reqs"]], rtol=1e-5, atol=1e-5)
    assert (out[s["num_reqs"]:] == 0).all()
    assert (q_out[1] == 0).all(), "a zero q stays zero through the norm and the rotation"


def test_fused_launch_checks():
    s = make_step([3], 0, 4, 2, 32, 4, torch.float32)
    out = torch.empty_like(s["q"])
    args = (s["q"], s["k"], s["v"], s["positions"], s["cos_sin"], s["cache"], s["slots"], out, s["seq_lens"],
            s["block_table"])
    with pytest.raises(ValueError, match="num_reqs"):
        rope_decode_attention(*args, 2, s["scale"])
    with pytest.raises(ValueError, match="both"):
        rope_decode_attention(*args, 1, s["scale"], 1, s["q_norm"])
    with pytest.raises(ValueError, match="fused_merge"):
        rope_decode_attention(*args, 1, s["scale"], 4, tuning=GRAPH_SPLIT_DECODE_TUNING._replace(fused_merge=True))


def test_mismatched_arguments_are_refused_by_name():
    """Like rope_and_write_kv and unified_attention: a narrower v, shorter positions or seq_lens, a
    cos_sin of another head_dim or an out of another shape was read or written out of bounds
    without an error; a 1-D block table gave an IndexError."""
    s = make_step([5, 9], 0, 4, 2, 32, 4, torch.float32)
    base = dict(q=s["q"], k=s["k"], v=s["v"], positions=s["positions"], cos_sin=s["cos_sin"], kv_cache=s["cache"],
                slot_mapping=s["slots"], out=torch.zeros_like(s["q"]), seq_lens=s["seq_lens"],
                block_table=s["block_table"], num_reqs=2, scale=s["scale"], num_splits=2)
    bad = {
        "v": dict(v=s["v"][..., :16]),
        "positions": dict(positions=s["positions"][:1]),
        "cos_sin": dict(cos_sin=s["cos_sin"][:, :16]),
        "out": dict(out=torch.zeros(4, 4, 32, device=DEVICE)),   # larger than q: no overrun here
        "seq_lens": dict(seq_lens=s["seq_lens"][:1]),
        "block_table": dict(block_table=s["block_table"][0]),
        # one plane (a view of the two-plane cache, so the unfixed launch overran nothing): v was
        # written at k + stride(0), past the cache's end, without an error
        "kv_cache": dict(kv_cache=s["cache"][:1]),
    }
    for name, change in bad.items():
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            rope_decode_attention(**{**base, **change})


# ---------------------------------------------------------------- GPU: real shapes, CUDA graphs

REAL_LENS = [1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 383, 384, 385, 1023, 1024, 1025, 8191, 8192]


@pytest.mark.gpu
@pytest.mark.parametrize("bucket", [1, 2, 4, 16])
@pytest.mark.parametrize("Hq", [16, 32])
def test_gpu_fused_matches_two_kernels_real_shapes(Hq, bucket):
    """Qwen3-0.6B (Hq 16) / 8B (Hq 32) attention shapes, bf16, the graphed split count of the bucket
    on this GPU (16 at bucket 1 on an H200, 1 at bucket 16)."""
    splits = launch_config.graph_num_splits(bucket, 8, 1, torch.device("cuda"))
    for i in range(0, len(REAL_LENS), bucket):
        lens = (REAL_LENS[i:i + bucket] + [0] * bucket)[:bucket]
        compare(make_step(lens, 0, Hq, 8, 128, 16, torch.bfloat16), splits, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("Hq", [16, 32])
def test_gpu_rope_bit_identical(Hq):
    """The claim that the fused path changes no bit of q or the cache at the real shapes (a failure
    here alone, with the test above passing, is a difference in the order of the norm's fp32 sum)."""
    splits = launch_config.graph_num_splits(4, 8, 1, torch.device("cuda"))
    for lens in ([1, 17, 384, 0], [8192, 1024, 65, 2]):
        compare(make_step(lens, 0, Hq, 8, 128, 16, torch.bfloat16), splits, 1e-2, exact=True)


@pytest.mark.gpu
@pytest.mark.parametrize("bucket", [1, 2, 4])
@pytest.mark.parametrize("Hq", [16, 32])
def test_gpu_fused_in_cuda_graph_replays(Hq, bucket, monkeypatch):
    """One layer's two ops captured as the full decode graphs capture them (capturing(fuse_rope=True),
    PDL on), replayed on new qkv, positions, slots, contexts and block tables; each replay against
    the two launches run eagerly on the same inputs."""
    from pcg_engine.attention import triton_backend
    from pcg_engine.kernels import pdl
    monkeypatch.setattr(triton_backend, "FUSED_ROPE_ATTENTION", True)   # off by default
    Hk, D, bs, dtype, width = 8, 128, 16, torch.bfloat16, 520
    backend = TritonAttentionBackend(num_heads=Hq, num_kv_heads=Hk, head_dim=D, block_size=bs,
                                     cos_sin=rope_cache(D, MAX_POS, 1e6, device=DEVICE))
    static = bucket_meta(bucket, width, 40960)
    first = make_step([1] * bucket, 0, Hq, Hk, D, bs, dtype, width=width)
    bufs = {n: first[n].clone() for n in ("positions", "cache", "q_norm", "k_norm")}
    qkv = torch.cat([first["q"].flatten(1), first["k"].flatten(1), first["v"].flatten(1)], dim=1)
    out = torch.empty_like(first["q"])

    def layer():
        q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
        q_rot = backend.rope_and_write_kv(q.view(bucket, Hq, D), k.view(bucket, Hk, D), v.view(bucket, Hk, D),
                                          bufs["positions"], bufs["cache"], static.slot_mapping, bufs["q_norm"],
                                          bufs["k_norm"], EPS)
        backend.forward(q_rot, out, bufs["cache"], static)

    with backend.capturing(fuse_rope=True), pdl.scope():
        assert backend.kernel_variant(static).rope_fused
        layer()   # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer()
    splits = launch_config.graph_num_splits(bucket, Hk, 1, torch.device("cuda"))
    for i in range(12):
        lens = [random.choice(REAL_LENS + [0]) if i % 2 else random.randint(1, 8192) for _ in range(bucket)]
        s = make_step(lens, 0, Hq, Hk, D, bs, dtype, width=width)
        s["cos_sin"], s["scale"] = backend.cos_sin, backend.scale
        qkv.copy_(torch.cat([s["q"].flatten(1), s["k"].flatten(1), s["v"].flatten(1)], dim=1))
        for n in ("positions", "cache", "q_norm", "k_norm"):
            bufs[n].copy_(s[n])
        static.slot_mapping.copy_(s["slots"])
        static.seq_lens.copy_(s["seq_lens"])
        static.block_table.copy_(s["block_table"])
        static.query_start_loc.copy_(s["qsl"])
        out.fill_(float("nan"))
        graph.replay()
        _, ref_cache, ref_out = two_kernels(s, splits)
        torch.cuda.synchronize()
        check(out, ref_out.float(), 1e-2)
        assert torch.equal(bufs["cache"][:, 1:], ref_cache[:, 1:]), f"{lens}: the cache differs"
