"""F.linear at Qwen3 projection shapes and few rows, under cuBLAS and under cuBLASLt, in one process.

    python scripts/bench_blas.py --json blas.json
    python scripts/bench_blas.py --rows 1 --shapes "8B o,8B down" --variants cublas,cublas_nn,mv

PyTorch sends a bf16 GEMM to cuBLAS (cublasGemmEx) unless the preferred BLAS library is cuBLASLt
(`torch.backends.cuda.preferred_blas_library`, or TORCH_BLAS_PREFER_CUBLASLT=1 at start), which
picks its kernel by its own heuristic. On the H200, cuBLAS runs Qwen3-8B's batch-1 down and o
projections as split-K plus reduce kernels at 62-76% of their weight-read floor (docs/PERF.md,
session 10's 8B kernel table). This times both libraries on the same weight ring, alternated, with
bench_skinny_gemm's method (a CUDA graph over distinct weight copies, more bytes than the L2).

Variants (--variants): `cublas` / `cublaslt` are F.linear on the [N, K] weight as the model stores
it (cuBLAS sees the "TN" case); `cublas_nn` / `cublaslt_nn` multiply by the same weight stored
transposed, [K, N] contiguous (the "NN" case: the library's heuristic picks other kernels for it);
`mv` is torch.mv on the [N, K] weight, one row only (PyTorch's matrix-vector path).
`nn_bmmS` / `tn_bmmS` (S = 2, 3, 4): the split-K done by hand, as one strided-batched GEMM over S
slices of K with fp32 outputs (`torch.bmm(..., out_dtype=torch.float32)`), on the transposed / the
checkpoint layout; the S partials are left unsummed (a consumer kernel would add them, as cuBLAS's
own split-K reduce kernel does now); `nn_bmm2_bf16` the same with bf16 partials.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_skinny_gemm import SHAPES as PROJECTIONS, ring_time_us  # noqa: E402

SHAPES = {**PROJECTIONS, "8B lm_head": (151936, 4096)}   # 0.6B ties its head to the embedding

COPY_CEILING_GBS = 4250.0   # the H200's measured copy bandwidth (BENCHMARKS.md)
VARIANTS = ("cublas", "cublaslt", "cublas_nn", "cublaslt_nn", "mv", "nn_bmm2", "nn_bmm3", "nn_bmm4", "tn_bmm2",
            "tn_bmm4", "nn_bmm2_bf16")


def split_k(x, w, splits: int, transposed: bool, fp32: bool = True):
    """x [M, K] @ (w [N, K] or wt [K, N]) as `splits` partial products [S, M, N] over slices of K."""
    m, k = x.shape
    xs = x.view(m, splits, k // splits).transpose(0, 1)                 # [S, M, K/S]
    if transposed:
        ws = w.view(splits, k // splits, w.shape[1])                     # [S, K/S, N], contiguous slices
    else:
        ws = w.view(w.shape[0], splits, k // splits).permute(1, 2, 0)   # [S, K/S, N], strides (K/S, 1, K)
    return torch.bmm(xs, ws, out_dtype=torch.float32) if fp32 else torch.bmm(xs, ws)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--variants", default="cublas,cublaslt", help=f"comma-separated, of {','.join(VARIANTS)}")
    p.add_argument("--ring-bytes", type=float, default=256e6, help="bytes of distinct weights per graph")
    p.add_argument("--rounds", type=int, default=2, help="times each variant is timed, alternated")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    rows_list = [int(r) for r in args.rows.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}; allowed: {', '.join(VARIANTS)}")
    out = []
    print(f"{'shape':14s} {'rows':>4s} " + " ".join(f"{v + ' us':>14s}" for v in variants)
          + f" {'best':>12s} {'best of floor':>13s}")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(2, int(args.ring_bytes // (n * k * 2)))
        weights = [torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5 for _ in range(copies)]
        transposed = ([w.t().contiguous() for w in weights]
                      if any(v.endswith("_nn") or v.startswith("nn_") for v in variants) else [])
        floor_us = n * k * 2 / (COPY_CEILING_GBS * 1e3)
        for m in rows_list:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            torch.backends.cuda.preferred_blas_library("cublas")
            ref = F.linear(x, weights[0])
            calls = {"cublas": (lambda w: F.linear(x, w), weights),
                     "cublaslt": (lambda w: F.linear(x, w), weights),
                     "cublas_nn": (lambda wt: torch.mm(x, wt), transposed),
                     "cublaslt_nn": (lambda wt: torch.mm(x, wt), transposed),
                     "mv": (lambda w: torch.mv(w, x[0]).unsqueeze(0), weights),
                     "nn_bmm2_bf16": (lambda wt: split_k(x, wt, 2, True, fp32=False), transposed)}
            for sp in (2, 3, 4):
                calls[f"nn_bmm{sp}"] = (lambda wt, sp=sp: split_k(x, wt, sp, True), transposed)
                calls[f"tn_bmm{sp}"] = (lambda w, sp=sp: split_k(x, w, sp, False), weights)
            run = [v for v in variants if (v != "mv" or m == 1) and not ("bmm" in v and k % int(v[6]) != 0)]
            times = {v: [] for v in run}
            for _ in range(args.rounds):
                for v in run:
                    torch.backends.cuda.preferred_blas_library("cublaslt" if "cublaslt" in v else "cublas")
                    fn, ring = calls[v]
                    got = fn(ring[0])
                    got = got.float().sum(0).to(ref.dtype) if "bmm" in v else got
                    err = (got - ref).abs().max().item()
                    if err > 1e-2 * ref.abs().max().item() + 1e-3:
                        raise AssertionError(f"{name} rows={m}: {v} differs from cublas by {err}")
                    times[v].append(ring_time_us(fn, ring))
            best = {v: min(ts) for v, ts in times.items()}
            winner = min(best, key=best.get)
            print(f"{name:14s} {m:4d} " + " ".join(f"{best[v]:14.2f}" if v in best else f"{'-':>14s}" for v in variants)
                  + f" {winner:>12s} {floor_us / best[winner]:13.0%}")
            out.append({"shape": name, "n": n, "k": k, "rows": m, "floor_us": floor_us,
                        **{f"{v}_us": best[v] for v in run},
                        **{f"{v}_runs_us": times[v] for v in run}})
        del weights, transposed
    torch.backends.cuda.preferred_blas_library("cublas")
    if args.json:
        from pcg_engine.bench.common import git_commit
        Path(args.json).write_text(json.dumps({"commit": git_commit(), "device": torch.cuda.get_device_name(),
                                               "torch": torch.__version__, "rows": out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
