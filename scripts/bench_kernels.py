"""Micro-benchmark of the fused kernels on a CUDA GPU: one table, optionally a JSON file.

    python scripts/bench_kernels.py [--json PATH] [--only attention,graph_split,argmax,rope_attention] [--attention-sweep none|quick|full]
                                    [--moe-sweep]

Memory-bound kernels (add+RMSNorm, SiLU-and-mul) are measured against the copy ceiling, the fused
MoE against the time to read its active experts' weights once at that ceiling (its floor for
small batches) and against the per-expert PyTorch loop it replaces; its few-token GEMV path against the
grouped GEMM at 1-16 tokens, and the router's one-launch top-k + softmax against torch's. Times are GPU times from
CUDA-graph replays with the L2 flushed before every call (see time_us): what a graphed step sees.
Attention rotates input sets instead (AttentionShape: no call finds its KV in L2) and ends with
a sweep of decode launch variants (sweep_rows), each row checked against the torch reference.
`graph_split` times batch-1 decode attention as the full decode graphs launch it, 1 split against
the bucket's split count (graph_split_rows); `rope_attention` the RoPE + KV write fused into that
decode attention against the two launches (pcg_engine/bench/rope_attention.py).
"""

import argparse
import sys
import time
from pathlib import Path

import torch

# Runs from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pcg_engine.bench.common import config_record, env_record, graph_of_calls, json_path, write_json  # noqa: E402

COPY_GBPS = 4250.0      # H200 device-to-device copy, measured
MATMUL_TFLOPS = 790.0   # dense bf16 matmul, measured
DTYPE = torch.bfloat16


def median_replay_ms(graph, replays: int) -> float:
    """Median GPU milliseconds of one replay of a captured graph, each replay timed by CUDA events."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def time_us(fn, reps: int = 10) -> float:
    """GPU time of one fn() with a cold L2, from CUDA-graph replays.

    The engine replays these kernels inside CUDA graphs, so launch overhead is not theirs to pay:
    a graph of reps x (flush L2, fn) is timed against one of reps x (flush L2), and the
    difference is the kernels' own time, every run starting from HBM like a real step.
    """
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # several times the L2
    fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()

    def median_ms(with_fn):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                flush.zero_()
                if with_fn:
                    fn()
        graph.replay()
        return median_replay_ms(graph, 7)

    return max(median_ms(True) - median_ms(False), 0.0) / reps * 1e3


def eager_time_us(fn) -> float:
    """For code a graph cannot hold (the per-expert loop reads counts back to the host)."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3


def row(kernel, shape, us, amount, unit, note=""):
    """amount: bytes for GB/s rows, flops for TFLOP/s rows, None where no rate means anything."""
    if amount is None:
        return dict(kernel=kernel, shape=shape, us=us, rate=None, unit="", of_ceiling=None, note=note)
    rate = amount / us / (1e3 if unit == "GB/s" else 1e6)
    ceiling = COPY_GBPS if unit == "GB/s" else MATMUL_TFLOPS
    return dict(kernel=kernel, shape=shape, us=us, rate=rate, unit=unit, of_ceiling=rate / ceiling, note=note)


def norm_rows():
    from pcg_engine.kernels.norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
    rows = []
    for tokens in (256, 8192):
        for hidden, model in ((1024, "0.6B"), (2048, "30B-A3B"), (4096, "8B")):
            x, r = (torch.randn(tokens, hidden, device="cuda", dtype=DTYPE) for _ in range(2))
            w = torch.randn(hidden, device="cuda", dtype=DTYPE)
            us = time_us(lambda: add_rms_norm(x, r, w, 1e-6))
            ref = time_us(lambda: add_rms_norm_ref(x, r, w, 1e-6))
            rows.append(row("add_rms_norm", f"{tokens}x{hidden} ({model})", us, 4 * x.numel() * 2, "GB/s",
                            f"{ref / us:.1f}x vs torch"))
    q = torch.randn(8192 * 16, 128, device="cuda", dtype=DTYPE)
    w = torch.randn(128, device="cuda", dtype=DTYPE)
    us, ref = time_us(lambda: rms_norm(q, w, 1e-6)), time_us(lambda: rms_norm_ref(q, w, 1e-6))
    rows.append(row("rms_norm (q-norm)", "8192 tok x 16 heads x 128", us, 2 * q.numel() * 2, "GB/s",
                    f"{ref / us:.1f}x vs torch"))
    return rows


def activation_rows():
    from pcg_engine.kernels.activation import silu_and_mul, silu_and_mul_ref
    rows = []
    for tokens in (256, 8192):
        for inter, model in ((3072, "0.6B"), (12288, "8B"), (768, "A3B expert")):
            x = torch.randn(tokens, 2 * inter, device="cuda", dtype=DTYPE)
            us, ref = time_us(lambda: silu_and_mul(x)), time_us(lambda: silu_and_mul_ref(x))
            rows.append(row("silu_and_mul", f"{tokens}x2*{inter} ({model})", us, 3 * tokens * inter * 2, "GB/s",
                            f"{ref / us:.1f}x vs torch"))
    return rows


def argmax_rows_section():
    """Greedy sampling's argmax over Qwen3's vocabulary: kernels/argmax.py vs torch.argmax."""
    from pcg_engine.kernels.argmax import argmax_rows
    rows = []
    for batch in (1, 16, 256):
        x = torch.randn(batch, 151936, device="cuda", dtype=DTYPE)
        us, ref = time_us(lambda: argmax_rows(x)), time_us(lambda: x.argmax(dim=-1))
        rows.append(row("argmax", f"{batch}x151936", us, x.numel() * 2, "GB/s",
                        f"torch.argmax {ref:.1f} us ({ref / us:.2f}x)"))
    return rows


def moe_rows(sweep: bool = False):
    from pcg_engine.kernels.fused_moe import fused_moe, fused_moe_ref, moe_align, moe_align_torch, moe_config
    experts, hidden, inter, top_k = 128, 2048, 768, 8  # Qwen3-30B-A3B
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=DTYPE) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=DTYPE) * 0.02
    rows = []
    for tokens in (1, 16, 64, 256):
        x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE)
        topk_weights, topk_ids = torch.topk(torch.randn(tokens, experts, device="cuda").softmax(-1), top_k)
        us = time_us(lambda: fused_moe(x, w13, w2, topk_weights, topk_ids))
        loop = eager_time_us(lambda: fused_moe_ref(x, w13, w2, topk_weights, topk_ids))
        active = topk_ids.unique().numel()
        weight_bytes = active * 3 * inter * hidden * 2
        floor = weight_bytes / COPY_GBPS / 1e3
        rows.append(row("fused_moe", f"{tokens} tok, E128 k8 2048/768 ({active} active)", us, weight_bytes,
                        "GB/s", f"{loop / us:.1f}x vs eager loop ({loop:.0f} us); {us / floor:.2f}x floor ({floor:.1f} us)"))
        block_m = moe_config(tokens, top_k, experts, inter, hidden, gated=True).block_m
        kernel_us = time_us(lambda: moe_align(topk_ids, experts, block_m))
        torch_us = time_us(lambda: moe_align_torch(topk_ids, experts, block_m))
        rows.append(row("moe_align", f"{tokens} tok x k8, E128, block_m {block_m}", kernel_us, None, "",
                        f"torch-ops version {torch_us:.1f} us"))
    rows += moe_paths(w13, w2, experts, hidden, top_k)
    rows += moe_route_rows(experts, top_k)
    if sweep:
        rows += moe_gemv_sweep(w13, w2, experts, hidden, top_k)
    return rows


def moe_route_rows(experts, top_k):
    """The router's top-k + softmax in one launch (kernels/moe_route.py) against torch's three kernels."""
    from pcg_engine.kernels.moe_route import topk_softmax, topk_softmax_ref
    rows = []
    for tokens in (1, 16, 256):
        logits = torch.randn(tokens, experts, device="cuda", dtype=DTYPE)
        us, ref = time_us(lambda: topk_softmax(logits, top_k)), time_us(lambda: topk_softmax_ref(logits, top_k))
        rows.append(row("moe_topk_softmax", f"{tokens} tok, E{experts} k{top_k}", us, None, "",
                        f"torch top-k + softmax + cast {ref:.1f} us ({ref / us:.2f}x)"))
    return rows


def moe_inputs(tokens, experts, hidden, top_k):
    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE)
    topk_weights, topk_ids = torch.topk(torch.randn(tokens, experts, device="cuda").softmax(-1), top_k)
    return x, topk_weights, topk_ids


def moe_paths(w13, w2, experts, hidden, top_k):
    """The few-token GEMV path (kernels/moe_gemv.py) against the grouped GEMM at 1-16 tokens (where
    fused_moe switches: GEMV_MAX_ASSIGNMENTS), each checked against the loop."""
    from pcg_engine.kernels.fused_moe import fused_moe, fused_moe_ref
    inter = w2.shape[2]
    rows = []
    for tokens in (1, 2, 3, 4, 6, 8, 16):
        x, topk_weights, topk_ids = moe_inputs(tokens, experts, hidden, top_k)
        ref = fused_moe_ref(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
        floor = topk_ids.unique().numel() * 3 * inter * hidden * 2 / COPY_GBPS / 1e3
        times = {}
        for path in ("grouped", "gemv"):
            out = fused_moe(x, w13, w2, topk_weights, topk_ids, path=path)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            times[path] = time_us(lambda: fused_moe(x, w13, w2, topk_weights, topk_ids, path=path))
            rows.append(row(f"fused_moe {path}", f"{tokens} tok, E128 k8", times[path], None, "",
                            f"{times[path] / floor:.2f}x floor ({floor:.1f} us); rel err {err:.1e}"))
        rows[-1]["note"] += f"; grouped / gemv {times['grouped'] / times['gemv']:.2f}x"
    return rows


def moe_gemv_sweep(w13, w2, experts, hidden, top_k):
    """The GEMV path's two launches alone, each over a sweep of tiles at 1 and 4 tokens (--moe-sweep)."""
    from pcg_engine.kernels.moe_gemv import DOWN, UP, GemvConfig, gemv_configs, launch_down, launch_up
    inter = w2.shape[2]
    rows = []
    up_tiles = [UP, GemvConfig(4, 1024, 4, 3), GemvConfig(1, 1024, 4, 3), GemvConfig(2, 1024, 2, 3),
                GemvConfig(1, 1024, 2, 3), GemvConfig(1, 2048, 4, 2), GemvConfig(2, 2048, 8, 2), GemvConfig(2, 512, 4, 3)]
    down_tiles = [DOWN, GemvConfig(4, 256, 4, 3), GemvConfig(1, 256, 4, 3), GemvConfig(2, 256, 2, 3),
                  GemvConfig(1, 256, 2, 3), GemvConfig(1, 512, 4, 3), GemvConfig(2, 128, 2, 3), GemvConfig(1, 128, 1, 3),
                  GemvConfig(16, 64, 4, 3)]
    for tokens in (1, 4):
        x, topk_weights, topk_ids = moe_inputs(tokens, experts, hidden, top_k)
        ids, scales = topk_ids.reshape(-1).contiguous(), topk_weights.reshape(-1).contiguous()
        base_up, base_down = gemv_configs(inter, hidden)
        act = launch_up(x, w13, ids, top_k, base_up)
        want = {"up": act.float(), "down": launch_down(act, w2, ids, scales, top_k, base_down).float()}
        launches = {"up": lambda tile: launch_up(x, w13, ids, top_k, tile),
                    "down": lambda tile: launch_down(act, w2, ids, scales, top_k, tile)}
        for which, tiles in (("up", up_tiles), ("down", down_tiles)):
            # Each launch alone, against its floor: the up launch reads 2/3 of the experts' bytes.
            share = 2 / 3 if which == "up" else 1 / 3
            floor = topk_ids.unique().numel() * 3 * inter * hidden * 2 * share / COPY_GBPS / 1e3
            for tile in tiles:
                try:
                    out = launches[which](tile)
                    us = time_us(lambda: launches[which](tile))
                except Exception as e:   # a tile that does not compile is a finding, not a crash
                    print(f"gemv {which} tile {tile}: {e!r}")
                    continue
                err = ((out.float() - want[which]).norm() / want[which].norm()).item()
                rows.append(row(f"moe gemv {which}", f"{tokens} tok, bn{tile.block_n} bk{tile.block_k} "
                                f"w{tile.num_warps} st{tile.num_stages}", us, None, "",
                                f"{us / floor:.2f}x its floor ({floor:.1f} us); vs table's tiles {err:.1e}"))
    return rows


# ---- attention: unified_attention at the shapes, and the decode launch-variant sweep ----

ATTN_D, ATTN_BS = 128, 16
# Decode launch variants (tile_n, num_warps, num_stages) the sweep times, each with the split
# partials merged by a second kernel and by the main kernel's last program ("fused/16": fused_merge,
# 16 floats a thread a merge load; the first four also with 32). What Triton 3.9 makes of them for
# sm_90 (TTGIR, ptxas; split kernel, GQA 2): the K/V tiles are single-buffered whatever num_stages
# says (each iteration waits for its own tile: one memory round trip a tile), and with 2 stages
# the tile's paged-block ids are a synchronous gather before that (two round trips a tile); from 3
# stages on the ids are prefetched a tile ahead. So the levers are bytes a round trip (tile_n) and
# programs an SM. Registers / shared memory -> programs an SM (64K regs, 228 KB):
#   n64 w4 s2  134 regs 38 KB -> 3 (fused/16: 104 -> 4)    n64 w4 s3  114-122 regs 38 KB -> 4
#   n32 w4 s4  72-96 regs 21 KB -> 5-7                     n16 w4 s4  72-96 regs 13 KB -> 5-7
#   n64 w8 s3  74-99 regs 38 KB -> 2-3                     n128 w4 s3 196 regs (fused 128) 72 KB -> 2 (3)
#   n128 w8 s3 107-114 regs 73 KB -> 2
SWEEP_TILES = ((64, 4, 2), (64, 4, 3), (32, 4, 4), (16, 4, 4), (64, 8, 3), (128, 4, 3), (128, 8, 3))
SWEEP_SPLITS = (16, 32, 48, 64)  # 48 x 8 kv heads: one wave at 3 programs an SM


class AttentionShape:
    """Rotated input sets of one decode/prefill shape: consecutive calls in a graph use different
    sets, so none finds its KV in L2 (48+ MB between reuses); block tables are random permutations."""

    def __init__(self, batch, ctx, qlen, Hq, Hk, device="cuda"):
        self.batch, self.ctx, self.qlen, self.Hq, self.Hk, self.device = batch, ctx, qlen, Hq, Hk, device
        self.kv_bytes = 2 * batch * ctx * Hk * ATTN_D * 2
        self.sets = [self._inputs() for _ in range(max(1, min(8, 2 + (256 << 20) // self.kv_bytes)))]
        self.calls = 8 * len(self.sets) if len(self.sets) > 1 else 4

    def _inputs(self):
        b, dev = self.batch, self.device
        nblk = b * -(-self.ctx // ATTN_BS)
        cache = torch.randn(2, nblk + 1, ATTN_BS, self.Hk, ATTN_D, device=dev, dtype=DTYPE)
        table = (torch.randperm(nblk, device=dev) + 1).view(b, -1).to(torch.int32)
        qsl = torch.arange(0, b + 1, device=dev, dtype=torch.int32) * self.qlen
        lens = torch.full((b,), self.ctx, device=dev, dtype=torch.int32)
        q = torch.randn(b * self.qlen, self.Hq, ATTN_D, device=dev, dtype=DTYPE)
        return q, cache, qsl, lens, table, torch.empty_like(q)

    def call(self, i, splits, tuning=None):
        from pcg_engine.attention.triton_attention import unified_attention
        q, cache, qsl, lens, table, out = self.sets[i % len(self.sets)]
        unified_attention(q, cache, out, qsl, lens, table, self.batch, self.qlen, ATTN_D ** -0.5, splits,
                          tuning=tuning)

    def time_us(self, splits, tuning=None):
        """GPU time a call: `calls` calls captured in one CUDA graph, median of replays."""
        graph = graph_of_calls(lambda i: self.call(i, splits, tuning), self.calls)
        ms = median_replay_ms(graph, 10)
        del graph
        return ms * 1e3 / self.calls

    def error(self, splits, tuning=None):
        """Relative error of set 0 against the torch reference, fresh eager call on a poisoned out
        (on the GPU: the fused merge's cross-program ordering is checked only here)."""
        from pcg_engine.attention.torch_backend import paged_attention_reference
        q, cache, qsl, lens, table, out = self.sets[0]
        if not hasattr(self, "_ref"):
            self._ref = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            paged_attention_reference(q, cache, qsl.cpu(), lens.cpu(), table, ATTN_D ** -0.5, self._ref)
        out.fill_(float("nan"))
        self.call(0, splits, tuning)
        err = (out.float() - self._ref).norm() / self._ref.norm()
        return float(err) if torch.isfinite(out).all() else float("inf")

    def decode_row(self, kernel, splits, tuning=None, note=""):
        us = self.time_us(splits, tuning)
        err = self.error(splits, tuning)
        if err > 2e-2:
            note = f"WRONG (rel. error {err:.1e}) {note}"
        nbytes = self.kv_bytes + 2 * self.batch * self.Hq * ATTN_D * 2
        return row(kernel, f"B{self.batch} ctx{self.ctx} Hq{self.Hq} Hk{self.Hk} D{ATTN_D}", us, nbytes, "GB/s", note)


def attention_rows(sweep="quick"):
    """The engine's own choices (split count from choose_num_splits, module tunings) at the targets'
    shapes, prefill, then the split-decode sweep (`sweep_rows`)."""
    from pcg_engine.attention.triton_attention import choose_num_splits
    rows, shapes = [], {}
    for batch, ctx, Hq, Hk in ((64, 2048, 16, 8), (64, 2048, 32, 8), (1, 8192, 16, 8), (1, 8192, 32, 8)):
        shape = shapes[batch, Hq] = AttentionShape(batch, ctx, 1, Hq, Hk)
        splits = choose_num_splits(batch, batch, Hq, Hk, ATTN_D, 1, ctx, torch.device("cuda"))
        rows.append(shape.decode_row(f"decode_attention splits={splits}", splits, note="engine default"))
    for batch, ctx, Hq, Hk in ((4, 2048, 16, 8), (4, 2048, 32, 8)):
        shape = AttentionShape(batch, ctx, ctx, Hq, Hk)
        us = shape.time_us(1)
        rows.append(row("prefill_attention", f"B{batch} len{ctx} Hq{Hq} Hk{Hk} D{ATTN_D}", us,
                        4 * batch * Hq * ATTN_D * ctx * (ctx + 1) / 2, "TFLOP/s"))
        del shape
    if sweep != "none":
        rows += sweep_rows(shapes, full=sweep == "full")
    return rows


def sweep_rows(shapes, full=False):
    """Decode launch variants, for the lead to pick the module defaults from (issue 4: B1 x 8192
    must reach 70% of the copy ceiling). B1 Hq16 gets every (tiles, merge, splits); B1 Hq32 and
    B64 x 2048 (no split there: only the tiles matter) the three best of it and the default, so
    that the run stays near a minute (each variant is a compile), unless full."""
    from pcg_engine.attention.triton_attention import DecodeTuning
    rows, t0 = [], time.perf_counter()

    def label(t):
        merge = f" fused/{t.merge_per_thread}" if t.fused_merge else ""
        return f"n{t.tile_n} w{t.num_warps} s{t.num_stages}{merge}"

    def sweep(shape, tunings, splits_list):
        found = []
        for t in tunings:
            for splits in splits_list:
                try:
                    r = shape.decode_row(f"decode sweep {label(t)}", splits, t, note=f"splits={splits}")
                except Exception as e:  # a variant that does not fit (shared memory) is a finding
                    print(f"attention sweep {label(t)} splits={splits}: {e!r}")
                    continue
                rows.append(r)
                if not r["note"].startswith("WRONG"):
                    found.append((r["us"], t, splits, r))
        found.sort(key=lambda f: f[0])
        if found:
            found[0][3]["note"] += "  <- fastest here"
        return found

    default = DecodeTuning()
    every = [DecodeTuning(*tiles, fused) for tiles in SWEEP_TILES for fused in (False, True)]
    every += [DecodeTuning(*tiles, True, 32) for tiles in SWEEP_TILES[:4]]  # fewer, larger merge loads
    best = sweep(shapes[1, 16], every, SWEEP_SPLITS)
    top = list(dict.fromkeys([f[1] for f in best[:3]] + [default]))
    top_splits = sorted({f[2] for f in best[:3]} | {32, 64})
    sweep(shapes[1, 32], every if full else top, SWEEP_SPLITS if full else top_splits)
    split_free = list(dict.fromkeys(t._replace(fused_merge=False, merge_per_thread=16)
                                    for t in (every if full else top)))
    sweep(shapes[64, 16], split_free, (1,))
    print(f"attention sweep: {len(rows)} variants in {time.perf_counter() - t0:.0f} s")
    return rows


GRAPH_SPLIT_CONTEXTS = (128, 384, 1024, 8192)   # batch 1; batch 4 at the middle two


def graph_split_rows():
    """Decode attention at batch 1 as the full decode graphs launch it: 1 split (before) against
    the graph-bucket choice (launch_config.graph_num_splits, merge fused into the kernel), and that
    split count with the two-kernel merge and with 32-key tiles, at P1's contexts (128-384) and
    beyond; Qwen3-0.6B (Hq 16) and 8B (Hq 32), Hk 8. Times are CUDA-graph replays with the L2
    flushed before each call (time_us: in the model, a layer's KV is long evicted by the weights
    of the 27 layers between two reads of it); the note adds back-to-back calls on rotating input
    sets (L2-warm at short contexts). Every row is checked against the torch reference. Ends with
    a batch-4 check of its own bucket's count, and P1's predicted saving a step."""
    from pcg_engine.attention.launch_config import GRAPH_SPLIT_DECODE_TUNING, graph_num_splits
    rows, cuda, saving = [], torch.device("cuda"), {}

    def measure(shape, label, splits, tuning, base_us=None):
        us = time_us(lambda: shape.call(0, splits, tuning), reps=20)
        warm = shape.time_us(splits, tuning)
        err = shape.error(splits, tuning)
        note = f"splits={splits}; back-to-back {warm:.1f} us"
        if base_us is not None:
            note += f"; {base_us / us:.2f}x vs 1 split"
        if err > 2e-2:
            note = f"WRONG (rel. error {err:.1e}) {note}"
        nbytes = shape.kv_bytes + 2 * shape.batch * shape.Hq * ATTN_D * 2
        rows.append(row(f"graph decode {label}", f"B{shape.batch} ctx{shape.ctx} Hq{shape.Hq} Hk{shape.Hk} "
                        f"D{ATTN_D}", us, nbytes, "GB/s", note))
        return us

    for Hq, Hk in ((16, 8), (32, 8)):
        n = graph_num_splits(1, Hk, 1, cuda)
        variants = (("fused (graph choice)", GRAPH_SPLIT_DECODE_TUNING),
                    ("merge kernel", GRAPH_SPLIT_DECODE_TUNING._replace(fused_merge=False)),
                    ("fused n32", GRAPH_SPLIT_DECODE_TUNING._replace(tile_n=32)))
        for ctx in GRAPH_SPLIT_CONTEXTS:
            shape = AttentionShape(1, ctx, 1, Hq, Hk)
            base = measure(shape, "1 split (before)", 1, None)
            for label, tuning in variants:
                us = measure(shape, f"{n} splits {label}", n, tuning, base)
                if label.startswith("fused (") and ctx <= 384:
                    saving.setdefault(Hq, []).append(base - us)
            del shape
    n4 = graph_num_splits(4, 8, 1, cuda)
    for ctx in GRAPH_SPLIT_CONTEXTS[1:3]:
        shape = AttentionShape(4, ctx, 1, 16, 8)
        base = measure(shape, "1 split (before)", 1, None)
        measure(shape, f"{n4} splits fused (graph choice)", n4, GRAPH_SPLIT_DECODE_TUNING, base)
        del shape
    for Hq, model, layers in ((16, "0.6B", 28), (32, "8B", 36)):
        per_layer = sum(saving[Hq]) / max(len(saving[Hq]), 1)
        print(f"graph split, Qwen3-{model}: {per_layer:.1f} us a layer saved at 128-384 keys, "
              f"~{layers * per_layer:.0f} us a batch-1 decode step ({layers} layers)")
    return rows


def rope_attention_section():
    from pcg_engine.bench.rope_attention import rope_attention_rows
    return rope_attention_rows(time_us, row)


def print_table(rows, title):
    from rich.console import Console
    from rich.table import Table
    table = Table(title=title)
    for col, justify in (("kernel", "left"), ("shape", "left"), ("time (us)", "right"),
                         ("achieved", "right"), ("of ceiling", "right"), ("note", "left")):
        table.add_column(col, justify=justify)
    for r in rows:
        if r["rate"] is None:
            rate = share = "-"
        else:
            rate = f"{r['rate']:.0f} GB/s" if r["unit"] == "GB/s" else f"{r['rate']:.1f} {r['unit']}"
            share = f"{100 * r['of_ceiling']:.0f}%"
        table.add_row(r["kernel"], r["shape"], f"{r['us']:.1f}", rate, share, r["note"])
    Console(width=170).print(table)


# --only's sections: the default set, then those that run only when named.
DEFAULT_SECTIONS = ("norm", "activation", "moe", "attention", "graph_split")
SECTIONS = DEFAULT_SECTIONS + ("argmax", "rope_attention")


def main(argv=None, prog=None):
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", type=json_path,
                        help="also write every row, the versions, commit, date and card here")
    parser.add_argument("--only", metavar="SECTIONS", default=",".join(DEFAULT_SECTIONS),
                        help=f"comma-separated sections to run, from {', '.join(SECTIONS)} "
                             f"(default: {','.join(DEFAULT_SECTIONS)})")
    parser.add_argument("--attention-sweep", choices=("none", "quick", "full"), default=None,
                        help="decode launch variants (attention section): quick ~1 min, full every "
                             "variant at every shape (default: quick)")
    parser.add_argument("--moe-sweep", action="store_true",
                        help="moe section: also time the few-token GEMV path's two launches alone over a tile "
                             "sweep at 1 and 4 tokens (the tuning of kernels/moe_gemv.py's table)")
    args = parser.parse_args(argv)
    # Checked here, not on the GPU only: a misspelt section was a KeyError traceback there.
    only = [name.strip() for name in args.only.split(",")]
    for name in only:
        if name not in SECTIONS:
            parser.error(f"--only: {name!r} is not a section; allowed: {', '.join(SECTIONS)}")
    if len(set(only)) < len(only):
        parser.error(f"--only: {args.only!r} names a section twice; each runs once")
    # A section's own flag without its section was accepted and read by nothing (found by a review).
    for flag, given, section in (("--moe-sweep", args.moe_sweep, "moe"),
                                 ("--attention-sweep", args.attention_sweep is not None, "attention")):
        if given and section not in only:
            parser.error(f"{flag}: only with the {section} section, which reads it; add {section} to --only "
                         f"(got --only {args.only})")
    if args.attention_sweep is None:
        args.attention_sweep = "quick"
    # The record every benchmark's JSON carries (BENCHMARKS.md: command, commit, date, card); it
    # held the versions alone. No model: these kernels run on random tensors.
    record = {"benchmark": "kernels", **env_record(None), "config": config_record(args)}
    if not torch.cuda.is_available():
        reason = "no CUDA device here; these kernels are benchmarked on a GPU. Nothing measured."
        print(f"bench_kernels: {reason}")
        # A file that says so, rather than none: a script that reads it next finds no rows and
        # the reason, not a missing file (it wrote nothing before).
        write_json(args.json, dict(record, gpu=None, rows=[], skipped=reason))
        return 0
    gpu = torch.cuda.get_device_name()
    sections = dict(norm=norm_rows, activation=activation_rows, moe=lambda: moe_rows(args.moe_sweep),
                    attention=lambda: attention_rows(args.attention_sweep), graph_split=graph_split_rows,
                    argmax=argmax_rows_section, rope_attention=rope_attention_section)
    rows = []
    for name in only:
        rows += sections[name]()
        torch.cuda.empty_cache()
    print_table(rows, f"pcg-engine kernels on {gpu} (ceilings: copy {COPY_GBPS / 1e3:.2f} TB/s, "
                      f"bf16 matmul {MATMUL_TFLOPS:.0f} TFLOP/s)")
    write_json(args.json, dict(record, gpu=gpu, copy_gbps=COPY_GBPS, matmul_tflops=MATMUL_TFLOPS, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
