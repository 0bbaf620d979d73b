"""The fuse transform: fewer, larger matmuls and fused kernels, applied to a loaded model.

Q/K/V become one projection and gate/up another (three and two launches become one, the input is
read once, and the wider matmul fills the GPU). The originals are deleted, so fusing costs no
memory. With kernels=True the norms, the SiLU-and-mul and the MoE experts switch to the project's
Triton kernels. The model's forward handles both layouts, so fusing is optional (fuse=False keeps
the unfused model for comparison).
"""

import torch

from pcg_engine.models.layers import RMSNorm, concat_linear


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
    set_kernels(model, kernels)
    model.fused = True
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


__all__ = ["fuse", "set_kernels", "parameter_bytes", "RMSNorm"]
