"""Split-K by hand for few-row projections: partial products that the next add + RMSNorm sums.

At one to four rows a projection is a weight-streaming problem that leaves cuBLAS most SMs idle
unless it splits K. For Qwen3-8B's o and down projections it does: a split-K GEMM writes fp32
partials and a second kernel sums them into the bf16 output (10.5 + 1.8 µs and 25.8-27.3 + 1.7 µs
a layer, docs/PERF.md, session 18's 8B kernel table). Here the same split is one strided-batched
GEMM with fp32 outputs, `torch.bmm(..., out_dtype=torch.float32)` over S slices of K, and the sum
moves into the add + RMSNorm kernel that reads the projection's output anyway
(kernels/norm.py, `add_rms_norm_partials`). On the H200's ring benchmark (`scripts/bench_blas.py
--rows 1,2,4 --variants cublas_nn,nn_bmm4`, session 18) o went 13.14 -> 10.45 µs and down 29.03 ->
26.14 µs at one row, the first figure being cuBLAS's GEMM and its reduce; the bmm's kernel also
reached 91% of down's weight-read floor.

Where: the shapes measured (SPLIT_K: Qwen3-8B's o and down, Qwen3-30B-A3B's o), for at most
MAX_ROWS rows, on CUDA with the kernels on, for the projections whose one consumer is an add +
RMSNorm (SPLIT_K_PROJECTIONS: o_proj feeds the post-attention norm, down_proj the next layer's input
norm or the final norm; models/qwen3.py).
Never inside torch.compile's trace: a trace cannot branch on the token count (it is symbolic), and
for a prefill step the S fp32 partials would be written and read again for nothing. So the compiled
pieces keep F.linear, and the eager forward (eager mode, and the full decode graphs, which capture
it) takes the split.

The sum of the partials is rounded to the activation dtype before the residual add, as F.linear's
output is: only the order of the fp32 additions differs from cuBLAS's own split-K.
PCG_SPLIT_K=0 turns it off (an A/B switch, read at fuse time).
"""

from __future__ import annotations

import os

import torch

# (N, K) -> S, measured on the H200 (see above): Qwen3-8B's o_proj and down_proj. S = 4 beat 2
# and 3 at 1, 2 and 4 rows for both. Qwen3-30B-A3B's o_proj (2048 x 4096; its MoE layers have no
# down_proj): 9.29 -> 6.81 µs at one row, 4 splits ahead of 2 (7.19) at 1, 2 and 4 rows (session 35).
SPLIT_K: dict[tuple[int, int], int] = {(4096, 4096): 4, (4096, 12288): 4, (2048, 4096): 4}
MAX_ROWS = 4
SPLIT_K_PROJECTIONS = ("o_proj", "down_proj")


def splits_for(n: int, k: int) -> int:
    """S for a weight of shape [n, k], or 0: no split measured to win."""
    # PCG_SPLIT_K read here, at fuse time (as the compile cache key reads it), not at import.
    return SPLIT_K.get((n, k), 0) if os.environ.get("PCG_SPLIT_K", "1") != "0" else 0


def partials(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """x [M, K] @ weight.T as `splits` fp32 partial products [S, M, N] over equal slices of K.

    weight is [N, K], either K-contiguous (the checkpoint's layout) or the [N, K] view of a [K, N]
    contiguous tensor (models/fuse.py's store_transposed): each slice is then a contiguous block."""
    m, k = x.shape
    n = weight.shape[0]
    if k % splits:
        raise ValueError(f"split-K: K = {k} is not a multiple of {splits} splits")
    if x.stride(1) != 1 or x.stride(0) != k:
        x = x.contiguous()
    xs = x.view(m, splits, k // splits).transpose(0, 1)                       # [S, M, K/S]
    wt = weight.t()
    if wt.is_contiguous():
        ws = wt.view(splits, k // splits, n)                                   # [S, K/S, N]
    else:
        ws = weight.view(n, splits, k // splits).permute(1, 2, 0)              # strides (K/S, 1, K)
    if x.is_cuda and x.dtype != torch.float32:
        return torch.bmm(xs, ws, out_dtype=torch.float32)
    return torch.bmm(xs.float(), ws.float())   # the CPU has no bmm with out_dtype (tests only)
