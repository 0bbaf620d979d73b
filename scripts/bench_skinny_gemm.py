"""Sweep the skinny GEMM's tiles against F.linear (cuBLAS) at Qwen3 projection shapes, batch 1..16.

    python scripts/bench_skinny_gemm.py --json skinny.json

Timing mirrors a decode step inside a CUDA graph: one graph calls the GEMM on a ring of distinct
weight copies (more bytes than the L2 holds, as consecutive layers' weights are), and the replay time
is divided by the ring length, so each call reads its weight from HBM and pays the in-graph
launch gap it pays in the model. Prints, per shape and row count, cuBLAS's time, the best tile's
time and bandwidth, and the TUNED entries to paste into pcg_engine/kernels/skinny_gemm.py (only
where the kernel wins by at least --min-gain).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from pcg_engine.bench.common import replay_us
from pcg_engine.kernels.skinny_gemm import SkinnyConfig, skinny_gemm

SHAPES = {  # name -> (N, K)
    "0.6B qkv": (4096, 1024), "0.6B o": (1024, 2048), "0.6B gate_up": (6144, 1024), "0.6B down": (1024, 3072),
    "8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (24576, 4096), "8B down": (4096, 12288),
    # Qwen3-30B-A3B's dense projections (32 q and 4 kv heads of 128, hidden 2048; the experts are fused_moe's)
    "30B qkv": (5120, 2048), "30B o": (2048, 4096), "30B router": (128, 2048),
}
M1_CONFIGS = ([SkinnyConfig(bn, bk, True, 4, st) for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 4)]
              + [SkinnyConfig(bn, bk, False, w, 3) for bn in (2, 4, 8, 16, 32) for bk in (256, 512, 1024)
                 for w in (4,)]
              + [SkinnyConfig(bn, 1024, False, 8, 3) for bn in (8, 16)])
DOT_CONFIGS = [SkinnyConfig(bn, bk, True, 4, st) for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 4)]


def ring_time_us(fn_for, weights, reps: int = 20) -> float:
    """GPU µs of one call, from a graph that calls fn on every weight of the ring once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            fn_for(w)   # compile / autotune / cuBLAS workspace outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn_for(w)
    return replay_us(graph, reps, warm=1) / len(weights)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--ring-bytes", type=float, default=256e6, help="bytes of distinct weights per graph")
    p.add_argument("--min-gain", type=float, default=1.05, help="TUNED only where cuBLAS / kernel >= this")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    results, tuned = [], {}
    t_start = time.time()
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        nbytes = n * k * 2
        copies = max(4, min(64, int(args.ring_bytes // nbytes)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        best_m1: list[SkinnyConfig] = []
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ weights[0].float().T
            cublas = ring_time_us(lambda w: F.linear(x, w), weights)
            configs = M1_CONFIGS if m == 1 else list(dict.fromkeys(best_m1[:4] + DOT_CONFIGS))
            timed = []
            for cfg in configs:
                if not cfg.use_dot and m * cfg.block_n * cfg.block_k > 16384:
                    continue  # the broadcast product would not fit in registers
                try:
                    y = skinny_gemm(x, weights[0], cfg)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    if err > 1e-2:
                        print(f"  {name} M={m} {cfg}: wrong (rel err {err:.3g}), skipped")
                        continue
                    timed.append((ring_time_us(lambda w: skinny_gemm(x, w, cfg), weights), cfg))
                except Exception as e:  # a tile that does not compile (shared memory) is skipped
                    print(f"  {name} M={m} {cfg}: {type(e).__name__}: {str(e)[:80]}")
            timed.sort(key=lambda t: t[0])
            if m == 1:
                best_m1 = [c for _, c in timed]
            best_us, best_cfg = timed[0]
            gain = cublas / best_us
            row = {"shape": name, "n": n, "k": k, "m": m, "cublas_us": cublas, "best_us": best_us,
                   "best_config": best_cfg.__dict__, "gain": gain,
                   "best_tb_s": nbytes / best_us / 1e6, "cublas_tb_s": nbytes / cublas / 1e6,
                   "top5": [(us, c.__dict__) for us, c in timed[:5]]}
            results.append(row)
            if gain >= args.min_gain:
                tuned[(m, n, k)] = best_cfg
            print(f"{name:13s} M={m:2d}  cuBLAS {cublas:7.2f} µs ({row['cublas_tb_s']:.2f} TB/s)  "
                  f"skinny {best_us:7.2f} µs ({row['best_tb_s']:.2f} TB/s)  {gain:.2f}x  {best_cfg}", flush=True)
        del weights
        torch.cuda.empty_cache()
    print(f"sweep took {time.time() - t_start:.0f} s")
    print("TUNED = {")
    for (m, n, k), c in sorted(tuned.items()):
        print(f"    ({m}, {n}, {k}): SkinnyConfig({c.block_n}, {c.block_k}, {c.use_dot}, {c.num_warps}, "
              f"{c.num_stages}),")
    print("}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
