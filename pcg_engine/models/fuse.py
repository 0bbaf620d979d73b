"""The fuse transform: fewer, larger matmuls and fused kernels, applied to a loaded model.

Q/K/V become one projection and gate/up another (three and two launches become one, the input is
read once, and the wider matmul fills the GPU). The originals are deleted, so fusing costs no
memory. With kernels=True the norms, the SiLU-and-mul and the MoE experts switch to the project's
Triton kernels. The model's forward handles both layouts, so fusing is optional (fuse=False keeps
the unfused model for comparison).

On CUDA the projections that cuBLAS serves are stored transposed (see store_transposed).
"""

import os

import torch

from pcg_engine.models.layers import Linear, RMSNorm, concat_linear

# PCG_WEIGHT_NN=0 keeps every projection's weight [N, K] contiguous as the checkpoint stores it (an
# A/B switch for benchmarks, read at fuse time; part of the compile cache key like every PCG_* switch).
_WEIGHT_NN = os.environ.get("PCG_WEIGHT_NN", "1") != "0"


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
    if _WEIGHT_NN and next(model.parameters()).device.type == "cuda":
        store_transposed(model)
    set_kernels(model, kernels)
    model.fused = True
    return model


@torch.no_grad()
def store_transposed(model):
    """Keep each Linear's weight as the [N, K] view of a [K, N] contiguous tensor, so that F.linear
    hands cuBLAS the "NN" case, for which it picks other kernels than for the checkpoint's layout.
    On the H200 at one and two rows (`scripts/bench_blas.py --variants cublas,cublas_nn`, session 17)
    they read Qwen3-8B's gate_up weight at 97% of the copy ceiling against 93%, down at 83% against
    79%; qkv and o stay within 1%. Projections the skinny GEMM serves keep [N, K]: its kernel reads
    rows of K. Values and shapes are unchanged; only the strides move."""
    for module in model.modules():
        if isinstance(module, Linear) and not module.kernel_applies():
            w = module.weight.data
            if w.dim() == 2 and w.stride(1) == 1:
                module.weight.data = w.t().contiguous().t()
    return model


def set_kernels(model, kernels: bool):
    """Route norms, activation and MoE through the Triton custom ops (CUDA) or plain PyTorch."""
    for module in model.modules():
        if hasattr(module, "use_kernels"):
            # A module may decline (layers.Linear: no measured kernel win for its shape).
            module.use_kernels = kernels and getattr(module, "kernel_applies", lambda: True)()
    model.kernels = kernels
    return model


def parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


__all__ = ["fuse", "store_transposed", "set_kernels", "parameter_bytes", "RMSNorm"]
