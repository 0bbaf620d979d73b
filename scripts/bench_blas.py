"""F.linear at Qwen3 projection shapes and few rows, under cuBLAS and under cuBLASLt, in one process.

    python scripts/bench_blas.py --json blas.json

PyTorch sends a bf16 GEMM to cuBLAS (cublasGemmEx) unless the preferred BLAS library is cuBLASLt
(`torch.backends.cuda.preferred_blas_library`, or TORCH_BLAS_PREFER_CUBLASLT=1 at start), which
picks its kernel by its own heuristic. On the H200, cuBLAS runs Qwen3-8B's batch-1 down and o
projections as split-K plus reduce kernels at 62-76% of their weight-read floor (docs/PERF.md,
session 10's 8B kernel table). This times both libraries on the same weight ring, alternated, with
bench_skinny_gemm's method (a CUDA graph over distinct weight copies, more bytes than the L2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_skinny_gemm import SHAPES, ring_time_us  # noqa: E402

COPY_CEILING_GBS = 4250.0   # the H200's measured copy bandwidth (BENCHMARKS.md)
LIBRARIES = ("cublas", "cublaslt")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--ring-bytes", type=float, default=256e6, help="bytes of distinct weights per graph")
    p.add_argument("--rounds", type=int, default=2, help="times each library is timed, alternated")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    rows_list = [int(r) for r in args.rows.split(",")]
    out = []
    print(f"{'shape':14s} {'rows':>4s} " + " ".join(f"{lib + ' us':>12s}" for lib in LIBRARIES)
          + f" {'lt/cublas':>9s} {'best of floor':>13s}")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(2, int(args.ring_bytes // (n * k * 2)))
        weights = [torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5 for _ in range(copies)]
        floor_us = n * k * 2 / (COPY_CEILING_GBS * 1e3)
        for m in rows_list:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            ref = F.linear(x, weights[0])
            times = {lib: [] for lib in LIBRARIES}
            for _ in range(args.rounds):
                for lib in LIBRARIES:
                    torch.backends.cuda.preferred_blas_library(lib)
                    err = (F.linear(x, weights[0]) - ref).abs().max().item()
                    if err > 1e-2 * ref.abs().max().item() + 1e-3:
                        raise AssertionError(f"{name} rows={m}: {lib} differs from cublas by {err}")
                    times[lib].append(ring_time_us(lambda w: F.linear(x, w), weights))
            best = {lib: min(ts) for lib, ts in times.items()}
            ratio = best["cublaslt"] / best["cublas"]
            print(f"{name:14s} {m:4d} " + " ".join(f"{best[lib]:12.2f}" for lib in LIBRARIES)
                  + f" {ratio:9.3f} {floor_us / min(best.values()):13.0%}")
            out.append({"shape": name, "n": n, "k": k, "rows": m, "floor_us": floor_us,
                        **{f"{lib}_us": best[lib] for lib in LIBRARIES},
                        **{f"{lib}_runs_us": times[lib] for lib in LIBRARIES}})
        del weights
    torch.backends.cuda.preferred_blas_library("cublas")
    if args.json:
        from pcg_engine.bench.common import git_commit
        Path(args.json).write_text(json.dumps({"commit": git_commit(), "device": torch.cuda.get_device_name(),
                                               "torch": torch.__version__, "rows": out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
