"""Qwen3-MoE's sparse block: a softmax router picks top-k experts per token, weights normalised.

Expert weights are stacked at load time the way the fused MoE kernel wants them: `w13` [E, 2I, D]
(gate rows then up rows) and `w2` [E, D, I]. With kernels on, `pcg::fused_moe` runs them (two GEMV
launches for a few tokens, one grouped GEMM per projection above) and `pcg::moe_topk_softmax` routes
in one launch; without, torch's top-k and softmax and a per-expert PyTorch loop (the reference, and
the unfused baseline of the benchmarks). The loop learns each expert's tokens on the host, so it is
wrapped in a custom op: Dynamo keeps it as one opaque node instead of breaking the graph at it.
"""

import torch
from torch import nn

from pcg_engine.custom_ops import pcg_op
from pcg_engine.kernels.fused_moe import fused_moe_ref
from pcg_engine.kernels.moe_route import topk_softmax_ref
from pcg_engine.models.layers import Linear, _kernel_ops


@pcg_op("moe_experts_ref(Tensor h, Tensor w13, Tensor w2, Tensor weights, Tensor ids) -> Tensor",
        fake=lambda h, w13, w2, weights, ids: torch.empty_like(h))
def moe_experts_ref(h, w13, w2, weights, ids):
    return fused_moe_ref(h, w13, w2, weights, ids)


class SparseMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        E, D, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.top_k, self.intermediate = E, config.num_experts_per_tok, I
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.gate = Linear(D, E)     # few-row steps may take the skinny GEMM (kernels/skinny_gemm.py's TUNED)
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, D))
        self.w2 = nn.Parameter(torch.empty(E, D, I))
        self.use_kernels = False

    def route(self, h: torch.Tensor):
        """(weights in h's dtype, expert ids), each [T, top_k]: transformers' softmax over all
        experts in fp32, top-k, the k weights normalised to sum 1 where norm_topk_prob says."""
        logits = self.gate(h)
        if self.norm_topk_prob:
            # The same weights in three kernels instead of five (softmax, top-k, sum, divide, cast):
            # softmax is monotonic, so the top-k probabilities belong to the top-k logits, and those k
            # probabilities normalised, exp(l_i) / Z over the sum of exp(l_j) / Z, are the softmax of
            # the k logits (equal up to fp32 rounding). At batch 1 each kernel of a decode step costs
            # ~1-2 us, paid in every MoE layer (48 in Qwen3-30B-A3B). One difference: two different
            # logits whose fp32 probabilities round to the same value (far below the largest logit,
            # differing in their last bits) tie in transformers' top-k, which may then take either
            # expert, where this takes the larger logit; the weights are the same either way.
            if self.use_kernels:    # the three in one launch (kernels/moe_route.py)
                return _kernel_ops().moe_topk_softmax(logits, self.top_k)
            return topk_softmax_ref(logits, self.top_k)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return weights.to(h.dtype), ids

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(h)
        if self.use_kernels:
            return _kernel_ops().fused_moe(h, self.w13, self.w2, weights, ids)
        return torch.ops.pcg.moe_experts_ref(h, self.w13, self.w2, weights, ids)
