"""Qwen3 (dense) and Qwen3-MoE as flat models: forward(input_ids [T], positions [T]) -> hidden [T, D].

A flat batch mixes prefill chunks and decodes of many requests; everything that says which rows
belong to which request reaches attention through the forward context (DESIGN.md, "Flat batch").
The LM head is a separate call (`compute_logits`) on the rows that sample, outside the graphed region.

The projections start unfused, named like the checkpoint; `pcg_engine.models.fuse` rewrites them
after load (Q/K/V -> qkv_proj, gate/up -> gate_up_proj, expert gate/up -> w13), so this file
handles both layouts through `project_qkv` and `gate_up`.
"""

import torch
from torch import nn

import pcg_engine.attention.op  # noqa: F401  (registers torch.ops.pcg.rope_kv_write, .attention)
from pcg_engine.models.layers import Embedding, Linear, Projection, RMSNorm, _kernel_ops, silu_and_mul
from pcg_engine.models.moe import SparseMoE


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        hidden = config.hidden_size
        self.q_proj = Linear(hidden, self.q_size)
        self.k_proj = Linear(hidden, self.kv_size)
        self.v_proj = Linear(hidden, self.kv_size)
        self.o_proj = Linear(self.q_size, hidden)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        # This layer's paged KV cache, bound by the runner (attention.op.bind_kv_caches). A buffer,
        # so that Dynamo lifts it as a graph input like the weights: the layer's identity reaches the
        # ops as a tensor, never as a constant in the compiled pieces. Not persistent: no checkpoint
        # holds it, and empty until bound.
        self.register_buffer("kv_cache", torch.empty(0), persistent=False)

    def project_qkv(self, h: torch.Tensor):
        if hasattr(self, "qkv_proj"):
            return self.split_qkv(self.qkv_proj(h))
        return self.q_proj(h), self.k_proj(h), self.v_proj(h)

    def split_qkv(self, qkv: torch.Tensor):
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, *self.project_qkv(h))

    def attend(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Everything after the q/k/v projection: norms, RoPE, KV write, attention, o_proj."""
        T = q.shape[0]
        # q, k, v stay head-shaped strided views of the fused qkv output (their last dim is
        # contiguous, which is all the backends need): no copy kernel per layer.
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        # Two ops (attention/op.py). The first applies the per-head q/k RMSNorm, RoPE and the KV
        # write in one launch and stays in the compiled piece (and its CUDA graph); only the
        # attention op splits the graph and runs eagerly between pieces.
        q = torch.ops.pcg.rope_kv_write(q, k, v, positions, self.kv_cache, self.q_norm.weight,
                                        self.k_norm.weight, self.q_norm.eps)
        out = torch.empty_like(q)
        torch.ops.pcg.attention(q, self.kv_cache, out)
        out = out.view(T, self.q_size)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)
        self.use_kernels = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate_up = self.gate_up_proj(h)
        else:
            gate_up = torch.cat([self.gate_proj(h), self.up_proj(h)], dim=-1)
        return self.down(gate_up)

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU-and-mul and the down projection of the fused gate/up output."""
        if self.use_kernels and self.down_proj.use_kernels:
            # The down projection takes the skinny GEMM for few rows: SiLU-and-mul folds into it.
            return _kernel_ops().silu_mul_linear(gate_up, self.down_proj.weight)
        return self.down_proj(silu_and_mul(gate_up, self.use_kernels))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        if is_moe_layer(config, layer_idx):
            self.mlp = SparseMoE(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, h, residual):
        # The residual add is fused into the next norm: (h, residual) -> (norm(h + residual), h + residual).
        # With kernels, a norm followed by a fused projection that takes the skinny GEMM folds into
        # it (torch.ops.pcg.add_rms_norm_linear: one launch for few rows, the two kernels otherwise).
        attn, mlp = self.self_attn, self.mlp
        if residual is None:
            residual = h
            h = attn(positions, self.input_layernorm(h))
        elif h.dim() == 2 and _folds(self.input_layernorm, getattr(attn, "qkv_proj", None)):
            # (h.dim() == 3: split-K partials of the down projection, which the plain norm sums)
            ln = self.input_layernorm
            qkv, residual = _kernel_ops().add_rms_norm_linear(h, residual, ln.weight, ln.eps, attn.qkv_proj.weight)
            h = attn.attend(positions, *attn.split_qkv(qkv))
        else:
            h, residual = self.input_layernorm(h, residual)
            h = attn(positions, h)
        if isinstance(mlp, MLP) and h.dim() == 2 and _folds(self.post_attention_layernorm,
                                                            getattr(mlp, "gate_up_proj", None)):
            ln = self.post_attention_layernorm
            gate_up, residual = _kernel_ops().add_rms_norm_linear(h, residual, ln.weight, ln.eps,
                                                                  mlp.gate_up_proj.weight)
            return mlp.down(gate_up), residual
        h, residual = self.post_attention_layernorm(h, residual)
        return mlp(h), residual


def _folds(norm: RMSNorm, proj) -> bool:
    """Whether an add + RMSNorm folds into the fused projection after it: both run kernels and the
    projection's shape takes the skinny GEMM (layers.Linear.kernel_applies)."""
    return proj is not None and norm.use_kernels and proj.use_kernels


def is_moe_layer(config, layer_idx: int) -> bool:
    if getattr(config, "num_experts", 0) in (0, None):
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and (layer_idx + 1) % step == 0


class Qwen3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions):
        h = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        h, _ = self.norm(h, residual)
        return h


class Qwen3ForCausalLM(nn.Module):
    """The flat model. Also serves Qwen3-MoE: the MLP of each layer is chosen from the config."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = Projection(config.hidden_size, config.vocab_size)
        self.fused = False
        self.kernels = False

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, D] hidden states of the sampling rows -> [N, vocab] logits in the model's dtype.

        Not upcast here: greedy sampling takes the argmax as given (exact in bf16), and the
        sampler makes its own float32 copy where it edits or normalises. At 256 rows the upcast
        was a 114 µs copy of 233 MB a decode step on the H200, 5% of the step."""
        return torch.nn.functional.linear(hidden, self.lm_head_weight)
