"""A projection and the add + RMSNorm after it, at Qwen3-8B's o / down shapes and one row: cuBLAS's
F.linear + add_rms_norm against kernels/split_k.py's partials + add_rms_norm_partials, and variants
of the second (the norm's warps: 16 by default since session 19, 8 before; two splits, bf16
partials), on bench_skinny_gemm's weight ring.

    python scripts/bench_split_k_norm.py [--json PATH]

Why: in the model (docs/PERF.md, session 18, call 5) the split GEMMs gained ~4.6 µs a layer but the
norm that sums four fp32 partials took 3.6-3.9 µs against 2.2 µs for one bf16 input.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_skinny_gemm import ring_time_us  # noqa: E402

from pcg_engine.kernels import norm, split_k  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name, (n, k) in {"8B o": (4096, 4096), "8B down": (4096, 12288)}.items():
        weights = [(torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5).t().contiguous().t()
                   for _ in range(max(2, int(256e6 // (n * k * 2))))]
        x = torch.randn(1, k, device=dev, dtype=dt)
        res, nw = torch.randn(1, n, device=dev, dtype=dt), torch.ones(n, device=dev, dtype=dt)
        real_config = norm._launch_config

        def partial_norm(p, warps=None):
            if warps:
                norm._launch_config = lambda r, d, partials=False: (*real_config(r, d, partials)[:2], warps)
            try:
                return norm._launch(res, res, nw, 1e-6, partials=p)
            finally:
                norm._launch_config = real_config

        variants = {
            "cublas + norm": lambda w: norm.add_rms_norm(F.linear(x, w), res, nw, 1e-6),
            "cublas only": lambda w: F.linear(x, w),
            "split4 fp32 + norm": lambda w: partial_norm(split_k.partials(x, w, 4)),
            "split4 only": lambda w: split_k.partials(x, w, 4),
            "split4 fp32 + norm w8": lambda w: partial_norm(split_k.partials(x, w, 4), 8),   # session 18 default
            "split4 fp32 + norm w4": lambda w: partial_norm(split_k.partials(x, w, 4), 4),
            "split2 fp32 + norm": lambda w: partial_norm(split_k.partials(x, w, 2)),
            "split4 bf16 + norm": lambda w: partial_norm(torch.bmm(x.view(1, 4, k // 4).transpose(0, 1),
                                                                   w.t().view(4, k // 4, n))),
        }
        ref = variants["cublas + norm"](weights[0])[0].float()
        for label, fn in variants.items():
            if "+ norm" in label:
                err = ((fn(weights[0])[0].float() - ref).norm() / ref.norm()).item()
            else:
                err = None
            us = min(ring_time_us(fn, weights) for _ in range(3))
            rows.append({"shape": name, "variant": label, "us": round(us, 2), "rel_err_vs_cublas": err})
            print(f"{name:8s} {label:26s} {us:7.2f} us  err {err}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
