"""A MoE layer's routing for a few tokens in one launch: the post-attention add + RMSNorm, the router
projection and the top-k softmax.

At decode batch sizes these were three kernels a MoE layer, each a few µs of mostly fixed cost
(Qwen3-30B-A3B, 8 layers, H200, PDL off, session 35: the norm summing o_proj's split-K partials ~1.8,
the router's skinny GEMM 2.2, kernels/moe_route.py 2.2 µs). Here one grid (tokens, expert chunks)
does all three:
  * each program loads its BLOCK_E router rows before the PDL wait (weights: no kernel writes them),
    then recomputes its token's add + RMSNorm (kernels/norm.py's roundings; from o_proj's fp32
    split-K partials when the layer took them) and writes its chunk's logits, rounded to the
    activations' dtype as the router projection's output is, to a scratch row;
  * the chunk-0 program of a token also writes the normed hidden state and the new residual, which
    the experts and the next layer read;
  * a token's last program to arrive (an atomic counter a token, as kernels/argmax.py) reads the
    E logits back and takes the top-k and their softmax (moe_route.topk_softmax_row), then zeroes
    the counter for the next launch.
So the grid depends on the token count only, no host sync: CUDA-graph safe. Each program re-reads
its token's row (S x D fp32 partials + the residual: 40 KB at 30B-A3B, from L2): cheap for a few
tokens, not for a batch, so models/moe.py takes this for at most MAX_TOKENS tokens of a shape in
FUSED, in eager steps (eager mode and the full decode graphs' capture). The compiled pieces keep the
three ops, as they keep F.linear for split-K: a trace cannot branch on the symbolic token count.

Numerics: the normed state and the residual are kernels/norm.py's, and the logits the router's up to
the order of the fp32 sum over D; where two logits round to the same bf16 value, either path takes
the lower expert. PCG_MOE_FUSED_ROUTE=0 keeps the three launches (an A/B switch, read at fuse time).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pcg_engine.kernels import pdl
from pcg_engine.kernels.moe_route import topk_softmax_ref, topk_softmax_row
from pcg_engine.kernels.norm import add_rms_norm_partials_ref, add_rms_norm_ref
from pcg_engine.kernels.pdl import gdc_launch_dependents, gdc_wait

MAX_TOKENS = 8
# (experts, hidden) -> BLOCK_E (router rows a program), for the shapes measured on the H200.
# Qwen3-30B-A3B: 128 x 2048, two rows a program as the router's skinny GEMM tile (64 programs a token).
FUSED: dict[tuple[int, int], int] = {(128, 2048): 2}


def block_experts(num_experts: int, hidden: int) -> int:
    """BLOCK_E for a router of this shape, or 0: the three launches (unmeasured shape, or switched off)."""
    if os.environ.get("PCG_MOE_FUSED_ROUTE", "1") == "0":
        return 0
    return FUSED.get((num_experts, hidden), 0)


@triton.jit
def _norm_route_kernel(x_ptr, res_ptr, nw_ptr, gw_ptr, h_ptr, res_out_ptr, logits_ptr, count_ptr, w_ptr, ids_ptr,
                       D, E, eps, num_chunks, stride_xs, stride_x, stride_r, stride_g, stride_h, stride_ro,
                       NUM_PARTIALS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                       TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    rows = chunk * BLOCK_E + tl.arange(0, BLOCK_E)
    row_ok = rows < E
    # The router's rows and the norm's weight: no kernel writes them, so they load before the wait.
    g = tl.load(gw_ptr + rows[:, None] * stride_g + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    nw = tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if PDL:  # kernels/pdl.py: x and the residual come from the kernels before
        gdc_wait()
        gdc_launch_dependents()
    dtype = h_ptr.dtype.element_ty
    # kernels/norm.py's _rms_norm_kernel, one row: the partials' sum rounded as the projection's output.
    x = tl.load(x_ptr + t * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
    if NUM_PARTIALS > 0:
        for s in tl.static_range(1, NUM_PARTIALS):
            x += tl.load(x_ptr + s * stride_xs + t * stride_x + cols, mask=col_ok, other=0.0)
        x = x.to(dtype).to(tl.float32)
    r = tl.load(res_ptr + t * stride_r + cols, mask=col_ok, other=0.0).to(tl.float32)
    summed = (x + r).to(dtype)
    x = summed.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = (x * rstd).to(dtype).to(tl.float32)
    h = (nw * y).to(dtype)
    if chunk == 0:
        tl.store(h_ptr + t * stride_h + cols, h, mask=col_ok)
        tl.store(res_out_ptr + t * stride_ro + cols, summed, mask=col_ok)
    logits = tl.sum(g.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
    tl.store(logits_ptr + t * E + rows, logits.to(dtype).to(tl.float32), mask=row_ok)
    # The token's last program to get here routes it. The barrier puts every thread's stores before
    # the atomic, whose release makes them visible to the program that acquires after it.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + t, 1, sem="acq_rel")
    if arrived == num_chunks - 1:
        experts = tl.arange(0, E_PAD)
        # .cg: read from L2, where the other programs' stores are, never a stale L1 line.
        all_logits = tl.load(logits_ptr + t * E + experts, mask=experts < E, other=0.0, cache_modifier=".cg")
        w, ids, slots = topk_softmax_row(all_logits, E, TOP_K, K_PAD, E_PAD)
        ok = slots < TOP_K
        tl.store(w_ptr + t * TOP_K + slots, w.to(w_ptr.dtype.element_ty), mask=ok)
        tl.store(ids_ptr + t * TOP_K + slots, ids, mask=ok)
        tl.store(count_ptr + t, 0)         # zero again for the next launch


class RouteWorkspace:
    """The launches' scratch for up to max_tokens tokens: each token's E logits (fp32) and its arrival
    counter, zero between launches (the token's last program resets it). One per MoE layer (its
    module keeps it), so two models, or two streams, never share counters."""

    def __init__(self, max_tokens: int, num_experts: int, device):
        self.logits = torch.empty((max_tokens, num_experts), dtype=torch.float32, device=device)
        self.counts = torch.zeros(max_tokens, dtype=torch.int32, device=device)


def norm_route(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
               gate_weight: torch.Tensor, top_k: int, block_e: int, workspace: RouteWorkspace):
    """(h, new residual, weights, ids) for T <= the workspace's tokens: h = rmsnorm(x + residual) *
    norm_weight and the new residual as kernels/norm.add_rms_norm(_partials) gives them, then the
    router's logits h @ gate_weight.T and their top-k softmax as moe_route.topk_softmax (weights in
    h's dtype, ids int64, largest first).

    x: [T, D] in residual's dtype, or o_proj's split-K partials [S, T, D] in fp32 (kernels/split_k.py).
    residual [T, D]; norm_weight [D]; gate_weight [E, D] (rows contiguous)."""
    parts = x.dim() == 3
    t, d = residual.shape
    e = gate_weight.shape[0]
    if residual.dim() != 2 or x.shape[-2:] != residual.shape or (parts and x.dtype != torch.float32) \
            or (not parts and (x.dim() != 2 or x.dtype != residual.dtype)):
        raise ValueError(f"norm_route: x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} "
                         f"{residual.dtype}: expected x [T, D] in residual's dtype or [S, T, D] float32")
    if norm_weight.shape != (d,) or gate_weight.shape[1] != d or not 1 <= top_k <= e:
        raise ValueError(f"norm_route: norm weight {tuple(norm_weight.shape)}, router {tuple(gate_weight.shape)}, "
                         f"top_k {top_k}: expected [{d}], [E, {d}] and 1 <= top_k <= E")
    if t > workspace.counts.shape[0] or e != workspace.logits.shape[1]:
        raise ValueError(f"norm_route: {t} tokens of {e} experts; the workspace holds "
                         f"{tuple(workspace.logits.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual.stride(-1) != 1:
        residual = residual.contiguous()
    gate_weight = gate_weight if gate_weight.stride(1) == 1 else gate_weight.contiguous()
    h = torch.empty((t, d), dtype=residual.dtype, device=residual.device)
    res_out = torch.empty_like(h)
    weights = torch.empty((t, top_k), dtype=residual.dtype, device=residual.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=residual.device)
    if t == 0:
        return h, res_out, weights, ids
    chunks = triton.cdiv(e, block_e)
    _norm_route_kernel[(t, chunks)](
        x, residual, norm_weight.contiguous(), gate_weight, h, res_out, workspace.logits, workspace.counts,
        weights, ids, d, e, float(eps), chunks, x.stride(0) if parts else 0, x.stride(-2), residual.stride(0),
        gate_weight.stride(0), h.stride(0), res_out.stride(0),
        NUM_PARTIALS=x.shape[0] if parts else 0, BLOCK_D=triton.next_power_of_2(d), BLOCK_E=block_e,
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(e), num_warps=4,
        **pdl.launch_kwargs(residual.device))
    return h, res_out, weights, ids


def norm_route_ref(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   gate_weight: torch.Tensor, top_k: int):
    """The three ops in torch: the add + RMSNorm (from partials if x is [S, T, D]), the router, top-k softmax."""
    if x.dim() == 3:
        h, res = add_rms_norm_partials_ref(x, residual, norm_weight, eps)
    else:
        h, res = add_rms_norm_ref(x, residual, norm_weight, eps)
    logits = (h.float() @ gate_weight.float().T).to(h.dtype)
    return (h, res, *topk_softmax_ref(logits, top_k))
