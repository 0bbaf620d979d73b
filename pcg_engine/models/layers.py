"""Building blocks shared by the Qwen3 models, each with a plain-PyTorch path and a fused-kernel path.

The plain path is what Inductor compiles on the CPU and what `fuse(kernels=False)` keeps; the kernel
path calls the project's Triton kernels through torch.library custom ops (opaque to Dynamo, safe in
CUDA graphs). Which one runs is a module attribute set once by the fuse transform, never a value
read per step, so Dynamo sees a constant.
"""

import torch
from torch import nn

from pcg_engine.kernels.activation import silu_and_mul_ref
from pcg_engine.kernels.norm import add_rms_norm_ref, rms_norm_ref


def _kernel_ops():
    import pcg_engine.kernels.ops  # noqa: F401  (registers torch.ops.pcg.*)
    return torch.ops.pcg


class RMSNorm(nn.Module):
    """RMSNorm; with a residual, the fused residual-add + norm returning (normed, new_residual)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.use_kernels = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            if self.use_kernels:
                return _kernel_ops().rms_norm(x, self.weight, self.eps)
            return rms_norm_ref(x, self.weight, self.eps)
        if self.use_kernels:
            return _kernel_ops().add_rms_norm(x, residual, self.weight, self.eps)
        return add_rms_norm_ref(x, residual, self.weight, self.eps)


def silu_and_mul(x: torch.Tensor, use_kernels: bool) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for the fused gate/up output."""
    if use_kernels:
        return _kernel_ops().silu_and_mul(x)
    return silu_and_mul_ref(x)


def concat_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the concatenation of the parts' outputs (weights copied once)."""
    weight = torch.cat([p.weight.data for p in parts], dim=0)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    fused.weight.data = weight
    return fused
