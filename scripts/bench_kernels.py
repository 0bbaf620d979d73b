"""Micro-benchmark of the fused kernels on a CUDA GPU: one table, optionally a JSON file.

    python scripts/bench_kernels.py [--json PATH]

Memory-bound kernels (add+RMSNorm, SiLU-and-mul) are measured against the copy ceiling, the fused
MoE against the time to read its active experts' weights once at that ceiling (its floor for
small batches) and against the per-expert PyTorch loop it replaces. Times are GPU times from
CUDA-graph replays with the L2 flushed before every call (see time_us): what a graphed step sees.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

# Runs from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COPY_GBPS = 4250.0      # H200 device-to-device copy, measured
MATMUL_TFLOPS = 790.0   # dense bf16 matmul, measured
DTYPE = torch.bfloat16


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
        times = []
        for _ in range(7):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

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


def moe_rows():
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
        if tokens == 1:   # 2.07x the floor against a <= 2x target: sweep the 1-token tiles
            rows += moe_tile_sweep(x, w13, w2, topk_weights, topk_ids, floor, us)
        block_m = moe_config(tokens, top_k, experts, inter, hidden, gated=True).block_m
        kernel_us = time_us(lambda: moe_align(topk_ids, experts, block_m))
        torch_us = time_us(lambda: moe_align_torch(topk_ids, experts, block_m))
        rows.append(row("moe_align", f"{tokens} tok x k8, E128, block_m {block_m}", kernel_us, None, "",
                        f"torch-ops version {torch_us:.1f} us"))
    return rows


def moe_tile_sweep(x, w13, w2, topk_weights, topk_ids, floor, table_us):
    """The 1-token MoE with other tiles for both GEMMs (block_m stays 16: one alignment)."""
    from pcg_engine.kernels.fused_moe import MoEConfig, fused_moe
    rows = []
    for bn_up, bn_down, bk, stages in ((16, 32, 128, 4), (16, 64, 256, 3), (32, 32, 128, 4), (32, 64, 256, 3),
                                       (64, 128, 128, 3), (16, 16, 128, 4)):
        configs = (MoEConfig(16, bn_up, bk, 4, stages), MoEConfig(16, bn_down, bk, 4, stages))
        try:
            us = time_us(lambda: fused_moe(x, w13, w2, topk_weights, topk_ids, configs=configs))
        except Exception as e:   # a tile that does not fit (shared memory) is a finding, not a crash
            print(f"moe tiles {configs}: {e!r}")
            continue
        rows.append(row("fused_moe tiles", f"1 tok, up bn{bn_up} down bn{bn_down} bk{bk} st{stages}", us, None, "",
                        f"{us / floor:.2f}x floor; table's tiles {table_us:.1f} us"))
    return rows


def attention_rows():
    # ---- HOOK: attention rows ------------------------------------------------------------------
    # pcg_engine/attention/triton_attention.py owns its benchmark shapes (decode 64 x ctx 2048,
    # 1 x ctx 8192, prefill 4 x 2048) through attention_bench_rows(); its rows come back as
    # (name, shape, us, "<rate> GB/s" | "<rate> TFLOP/s"), timed eagerly by that module.
    try:
        from pcg_engine.attention.triton_attention import attention_bench_rows
    except ImportError as e:
        print(f"attention rows skipped: {e}")  # TODO: add them once the module provides the hook
        return []
    rows = []
    for name, shape, us, rate in attention_bench_rows("cuda", DTYPE):
        value, unit = rate.split(" ", 1)
        per_us = float(value) * us * (1e3 if unit == "GB/s" else 1e6)  # back to bytes / flops
        rows.append(row(name, shape, us, per_us, unit))
    return rows


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write every row and the versions here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device here; these kernels are benchmarked on a GPU. Nothing measured.")
        return 0
    import triton
    gpu = torch.cuda.get_device_name()
    rows = []
    for section in (norm_rows, activation_rows, moe_rows, attention_rows):
        rows += section()
        torch.cuda.empty_cache()
    print_table(rows, f"pcg-engine kernels on {gpu} (ceilings: copy {COPY_GBPS / 1e3:.2f} TB/s, "
                      f"bf16 matmul {MATMUL_TFLOPS:.0f} TFLOP/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                           copy_gbps=COPY_GBPS, matmul_tflops=MATMUL_TFLOPS, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
