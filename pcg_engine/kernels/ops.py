"""The fused kernels as torch.library custom ops: opaque to Dynamo, capturable by CUDA graphs.

Dynamo cannot trace a triton.jit launcher's Python (grid lambdas, tensor.stride() arithmetic,
the launch itself), and Inductor must not try to fuse into it. Behind a custom op each kernel is
one node whose fake implementation gives the output shapes and dtypes, so a graph with symbolic
token count traces through it, and the real launcher runs when the compiled graph (or a CUDA
graph capture of it) executes.

All ops are functional: they return new contiguous tensors and mutate nothing.

  torch.ops.pcg.rms_norm(x, weight, eps) -> out
  torch.ops.pcg.add_rms_norm(x, residual, weight, eps) -> (out, new_residual)
  torch.ops.pcg.silu_and_mul(x) -> out
  torch.ops.pcg.fused_moe(x, w13, w2, topk_weights, topk_ids) -> out
"""

import torch

from pcg_engine.kernels import activation, fused_moe as moe, norm


@torch.library.custom_op("pcg::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return norm.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("pcg::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return norm.add_rms_norm(x, residual, weight, eps)


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op("pcg::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return activation.silu_and_mul(x)


@silu_and_mul.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op("pcg::fused_moe", mutates_args=())
def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    return moe.fused_moe(x, w13, w2, topk_weights, topk_ids)


@fused_moe.register_fake
def _(x, w13, w2, topk_weights, topk_ids):
    return x.new_empty((x.shape[0], w2.shape[1]))
