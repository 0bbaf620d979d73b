"""The fused kernels as custom ops (registered as custom_ops.py describes): opaque to Dynamo, capturable by CUDA graphs.

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
  torch.ops.pcg.moe_topk_softmax(logits, top_k) -> (weights, ids)   (the router's top-k and softmax)
  torch.ops.pcg.linear(x, weight) -> x @ weight.T (skinny GEMM kernel for few rows, else F.linear)
  torch.ops.pcg.add_rms_norm_linear(x, residual, norm_weight, eps, weight) -> (normed @ weight.T, x + residual)
      (the add + RMSNorm folded into the next projection: one skinny launch for few rows)
  torch.ops.pcg.silu_mul_linear(gate_up, weight) -> silu_and_mul(gate_up) @ weight.T (one skinny launch
      for few rows)
"""

import torch

from pcg_engine.custom_ops import pcg_op
from pcg_engine.kernels import activation, fused_moe as moe, moe_route, norm, skinny_gemm


@pcg_op("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
        fake=lambda x, weight, eps: x.new_empty(x.shape))
def rms_norm(x, weight, eps):
    return norm.rms_norm(x, weight, eps)


@pcg_op("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
        fake=lambda x, residual, weight, eps: (x.new_empty(x.shape), x.new_empty(x.shape)))
def add_rms_norm(x, residual, weight, eps):
    return norm.add_rms_norm(x, residual, weight, eps)


@pcg_op("silu_and_mul(Tensor x) -> Tensor",
        fake=lambda x: x.new_empty((*x.shape[:-1], x.shape[-1] // 2)))
def silu_and_mul(x):
    return activation.silu_and_mul(x)


@pcg_op("fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids) -> Tensor",
        fake=lambda x, w13, w2, topk_weights, topk_ids: x.new_empty((x.shape[0], w2.shape[1])))
def fused_moe(x, w13, w2, topk_weights, topk_ids):
    return moe.fused_moe(x, w13, w2, topk_weights, topk_ids)


@pcg_op("moe_topk_softmax(Tensor logits, int top_k) -> (Tensor, Tensor)",
        fake=lambda logits, top_k: (logits.new_empty((logits.shape[0], top_k)),
                                    logits.new_empty((logits.shape[0], top_k), dtype=torch.int64)))
def moe_topk_softmax(logits, top_k):
    return moe_route.topk_softmax(logits, top_k)


@pcg_op("linear(Tensor x, Tensor weight) -> Tensor",
        fake=lambda x, weight: x.new_empty((*x.shape[:-1], weight.shape[0])))
def linear(x, weight):
    return skinny_gemm.linear(x, weight)


@pcg_op("silu_mul_linear(Tensor gate_up, Tensor weight) -> Tensor",
        fake=lambda gate_up, weight: gate_up.new_empty((*gate_up.shape[:-1], weight.shape[0])))
def silu_mul_linear(gate_up, weight):
    return skinny_gemm.silu_mul_linear(gate_up, weight)


@pcg_op("add_rms_norm_linear(Tensor x, Tensor residual, Tensor norm_weight, float eps, Tensor weight) "
        "-> (Tensor, Tensor)",
        fake=lambda x, residual, norm_weight, eps, weight: (x.new_empty((*x.shape[:-1], weight.shape[0])),
                                                            x.new_empty(x.shape)))
def add_rms_norm_linear(x, residual, norm_weight, eps, weight):
    return skinny_gemm.add_rms_norm_linear(x, residual, norm_weight, eps, weight)
