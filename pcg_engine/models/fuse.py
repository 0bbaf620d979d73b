"""The fuse transform: fewer, larger matmuls and fused kernels, applied to a loaded model.

Q/K/V become one projection and gate/up another (three and two launches become one, the input is
read once, and the wider matmul fills the GPU). The originals are deleted, so fusing costs no
memory. With kernels=True the norms, the SiLU-and-mul and the MoE experts switch to the project's
Triton kernels. The model's forward handles both layouts, so fusing is optional (fuse=False keeps
the unfused model for comparison).

On CUDA the o, down and LM-head projections that cuBLAS serves are stored transposed (see
store_transposed).
"""

import os

import torch
from torch import nn

from pcg_engine.kernels import split_k
from pcg_engine.models.layers import Linear, RMSNorm, concat_linear

# PCG_WEIGHT_NN=0 keeps every projection's weight [N, K] contiguous as the checkpoint stores it (an
# A/B switch for benchmarks; part of the compile cache key like every PCG_* switch). Read at fuse time,
# as the cache key reads it at set-up: a value set after import must be the one both see.
def _weight_nn() -> bool:
    return os.environ.get("PCG_WEIGHT_NN", "1") != "0"


@torch.no_grad()
def fuse(model, kernels: bool = False):
    for layer in model.model.layers:
        attn = layer.self_attn
        if hasattr(attn, "q_proj"):
            attn.qkv_proj = concat_linear([attn.q_proj, attn.k_proj, attn.v_proj])
            del attn.q_proj, attn.k_proj, attn.v_proj
        mlp = layer.mlp
        if hasattr(mlp, "gate_proj"):
            mlp.gate_up_proj = concat_linear([mlp.gate_proj, mlp.up_proj])
            del mlp.gate_proj, mlp.up_proj
    if _weight_nn() and next(model.parameters()).device.type == "cuda":
        store_transposed(model)
    set_kernels(model, kernels)
    model.fused = True
    return model


# Which projections store_transposed moves, by name. On the H200 (`scripts/bench_blas.py --variants
# cublas,cublas_nn --rows 1,16,256,2048`, session 17 call 2), µs with the checkpoint's layout / transposed:
#   8B o_proj    14.22 / 13.73 at 1 row,  17.14 / 16.48 at 256,  87.45 / 87.54 at 2048
#   8B down_proj 30.03 / 29.76,           43.15 / 43.05,        252.75 / 252.64
#   8B lm_head  301.32 / 290.97,         424.34 / 420.30  (it reads only the sampled rows)
# qkv and gate_up gain at one row too (-0.1 and -1.4 µs) but lose in prefill: 131.6 / 135.4 and
# 517.7 / 558.2 µs at 2048 rows, so they keep the checkpoint's layout.
TRANSPOSED_PROJECTIONS = ("o_proj", "down_proj", "lm_head")


@torch.no_grad()
def store_transposed(model):
    """Keep the weights of TRANSPOSED_PROJECTIONS as [N, K] views of [K, N] contiguous tensors, so
    that F.linear hands cuBLAS the "NN" case, for which it picks other kernels than for the
    checkpoint's layout (faster at decode's few rows, see above). A projection the skinny GEMM
    serves keeps [N, K] (its kernel reads rows of K), and so does a head tied to the embedding (the
    lookup reads its rows). Values and shapes are unchanged; only the strides move."""
    embeddings = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name.rsplit(".", 1)[-1] not in TRANSPOSED_PROJECTIONS:
            continue
        if isinstance(module, Linear) and module.kernel_applies():
            continue
        w = module.weight.data
        if w.stride(1) == 1 and w.data_ptr() not in embeddings:
            module.weight.data = w.t().contiguous().t()
    return model


def set_kernels(model, kernels: bool):
    """Route norms, activation and MoE through the Triton custom ops (CUDA) or plain PyTorch; with
    kernels on CUDA, the few-row o and down projections of a measured shape split K by hand
    (kernels/split_k.py) unless the skinny GEMM serves them."""
    for module in model.modules():
        if hasattr(module, "use_kernels"):
            # A module may decline (layers.Linear: no measured kernel win for its shape).
            module.use_kernels = kernels and getattr(module, "kernel_applies", lambda: True)()
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            wanted = (kernels and not module.use_kernels and module.weight.is_cuda
                      and name.rsplit(".", 1)[-1] in split_k.SPLIT_K_PROJECTIONS)
            module.split_k = split_k.splits_for(*module.weight.shape) if wanted else 0
    model.kernels = kernels
    return model


def parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


__all__ = ["fuse", "store_transposed", "set_kernels", "parameter_bytes", "RMSNorm"]
