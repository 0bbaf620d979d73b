"""Qwen3-MoE configs at the edges equal transformers' Qwen3MoeForCausalLM (fp32), through the
reference expert loop and through the fused grouped-GEMM kernel (Triton's interpreter on the CPU):
top-k = num_experts, top-k = 1, norm_topk_prob false, dense layers mixed in by decoder_sparse_step
and mlp_only_layers, a number of experts that is not a power of two, a single expert.

The same hand-driven flat batches as test_hf_equivalence (packed prefill, paged decode, padding, a
late prefill mixed with decodes), each compared with transformers step by step.
"""

import pytest
import torch

from pcg_engine.models.loader import load_model
from pcg_engine.models.moe import SparseMoE
from test_hf_equivalence import prompts_for, run_schedule
from tiny_checkpoints import build_tiny_variant

VARIANTS = {
    "topk-all": dict(num_experts=5, num_experts_per_tok=5),
    "top1-unnormed": dict(num_experts_per_tok=1, norm_topk_prob=False),
    "k3-of-5-unnormed": dict(num_experts=5, num_experts_per_tok=3, norm_topk_prob=False, moe_intermediate_size=20),
    "mixed-dense": dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]),
    "one-expert": dict(num_experts=1, num_experts_per_tok=1),
}
# Which layers are sparse in "mixed-dense" (transformers' rule): (i + 1) % 2 == 0 and i not in [3].
MIXED_SPARSE = [False, True, False, False]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_moe_variant_matches_transformers(variant, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_variant(tmp_path_factory.getbasetemp(), f"tiny-moe-{variant}", **VARIANTS[variant])
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = prompts_for(seed=5)
    late = prompts_for(seed=6)[2][:6]
    history = {}
    for kernels in (False, True):
        model = load_model(path, device="cpu", dtype=torch.float32, kernels=kernels)
        moe = [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers]
        if variant == "mixed-dense":
            assert moe == MIXED_SPARSE
        assert all(m.use_kernels == kernels for m in model.modules() if isinstance(m, SparseMoE))
        history[kernels], _ = run_schedule(model, hf, prompts, late)
    # Both within run_schedule's 1e-4 relative error of transformers; element by element the two
    # expert paths (summation orders differ) stay within ~2e-4 of logits of std ~4.
    for a, b in zip(history[False], history[True]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normed", [True, False])
def test_route_is_transformers_softmax_top_k(dtype, normed, kernels):
    """SparseMoE.route against transformers' routing written out (softmax over every expert in
    fp32, top-k, the k weights divided by their sum where norm_topk_prob): the same experts, exact
    ties in the logits included (one split at the k-th place), and weights equal up to fp32
    rounding (norm_topk_prob takes the softmax of the top-k logits instead). Not covered: different
    logits whose probabilities round to one value (route's comment). With kernels (normed:
    kernels/moe_route.py) an exact tie may name another of the tied experts: the chosen logits are
    compared there."""
    from types import SimpleNamespace
    torch.manual_seed(0)
    config = SimpleNamespace(num_experts=128, hidden_size=64, moe_intermediate_size=16, num_experts_per_tok=8,
                             norm_topk_prob=normed)
    moe = SparseMoE(config).to(dtype)
    moe.use_kernels = kernels
    h = torch.randn(64, 64, dtype=dtype)
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.5)
        for tie in (False, True):
            if tie:     # exact ties in threes: experts 42.. and 84.. route like ..42, so a top 8 ends in a split tie
                moe.gate.weight[42:84] = moe.gate.weight[:42]
                moe.gate.weight[84:126] = moe.gate.weight[:42]
            weights, ids = moe.route(h)
            probs = torch.softmax(moe.gate(h), dim=-1, dtype=torch.float32)
            want_w, want_ids = torch.topk(probs, 8, dim=-1)
            if normed:
                want_w = want_w / want_w.sum(dim=-1, keepdim=True)
            if kernels and normed:
                logits = moe.gate(h)
                assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids))
            else:
                assert torch.equal(ids, want_ids)
            assert weights.dtype == dtype
            torch.testing.assert_close(weights.float(), want_w.to(dtype).float(), rtol=0,
                                       atol=1e-6 if dtype == torch.float32 else 2 ** -8)
