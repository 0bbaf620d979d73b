"""Building blocks shared by the Qwen3 models, each with a plain-PyTorch path and a fused-kernel path.

The plain path is what Inductor compiles on the CPU and what `fuse(kernels=False)` keeps; the kernel
path calls the project's Triton kernels through torch.library custom ops (opaque to Dynamo, safe in
CUDA graphs). Which one runs is a module attribute set once by the fuse transform, never a value
read per step, so Dynamo sees a constant.
"""

import torch
import torch.nn.functional as F
from torch import nn

from pcg_engine.kernels import split_k
from pcg_engine.kernels.activation import silu_and_mul_ref
from pcg_engine.kernels.norm import add_rms_norm_partials, add_rms_norm_partials_ref, add_rms_norm_ref, rms_norm_ref


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
        if residual is not None and x.dim() == residual.dim() + 1:
            # x: split-K partials of the projection before (kernels/split_k.py); eager steps only,
            # never traced (Linear.forward), so a direct kernel call, not a custom op.
            fn = add_rms_norm_partials if self.use_kernels else add_rms_norm_partials_ref
            return fn(x, residual, self.weight, self.eps)
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


class Embedding(nn.Embedding):
    """nn.Embedding without its random init: the loader fills every weight from the checkpoint.

    The init was not just wasted work: 155M normal_ draws for Qwen3's table, and on the meta device
    normal_ goes through torch._refs and imports Dynamo (3.4 s of an eager CPU start-up)."""

    def reset_parameters(self) -> None:
        pass


class Projection(nn.Linear):
    """nn.Linear without bias and without its random init (see Embedding): the LM head, the router."""

    def __init__(self, in_features: int, out_features: int, **kwargs):
        super().__init__(in_features, out_features, bias=False, **kwargs)

    def reset_parameters(self) -> None:
        pass


class Linear(Projection):
    """A projection without bias whose few-row CUDA calls may take the skinny GEMM kernel.

    With kernels on, it calls torch.ops.pcg.linear, which picks kernels/skinny_gemm.py's kernel for
    up to 16 rows of a shape measured to beat cuBLAS there and F.linear otherwise. Shapes with no
    measured win keep plain F.linear (`kernel_applies`), so they pay no custom-op call in eager steps.

    split_k > 0 (set by models/fuse.py for o_proj and down_proj, see kernels/split_k.py): an eager
    call of up to split_k.MAX_ROWS rows returns the fp32 partial products [S, rows, N] instead of the
    output, for the add + RMSNorm after it (RMSNorm.forward) to sum.
    """

    def __init__(self, in_features: int, out_features: int, **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        self.use_kernels = False
        self.split_k = 0

    def kernel_applies(self) -> bool:
        from pcg_engine.kernels.skinny_gemm import has_tuned
        return has_tuned(*self.weight.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Not under torch.compile (tested before the token count, which is symbolic in a trace and
        # must not be branched on), and a compiled prefill step must not pay for partials anyway.
        if self.split_k and not torch.compiler.is_compiling() and x.dim() == 2 \
                and 0 < x.shape[0] <= split_k.MAX_ROWS:
            return split_k.partials(x, self.weight, self.split_k)
        if self.use_kernels:
            return _kernel_ops().linear(x, self.weight)
        return F.linear(x, self.weight)


def concat_linear(parts: list[nn.Linear]) -> Linear:
    """One Linear whose output is the concatenation of the parts' outputs (weights copied once)."""
    weight = torch.cat([p.weight.data for p in parts], dim=0)
    fused = Linear(weight.shape[1], weight.shape[0], device=weight.device, dtype=weight.dtype)
    fused.weight.data = weight
    return fused
