"""The Triton attention backend: fused RoPE + KV write (rope_kv.py), one unified paged-attention kernel.

Graph safety: both launches take their grids from T, num_reqs, max_query_len and tensor shapes
(bucket values) and read seq_lens / query_start_loc / block_table only on the device, so a
forward can be captured in a full CUDA graph and replayed with new contents of the same buffers.
The one exception is split-KV, whose split count uses max_seq_len (a per-step host value): the
graph runner sets `allow_split_kv = False` around capture (or uses `capturing()`), and eager
steps with small batches and long contexts get it back. The count is stored in the step's metadata
by its first attention call while splitting is allowed.

In piecewise mode the RoPE + KV write runs inside the pieces' graphs (attention/op.py); only
forward() runs between pieces, once per layer.
"""

from contextlib import contextmanager

import torch

from pcg_engine.attention.backend import AttentionBackend
from pcg_engine.attention.launch_config import choose_num_splits, kernel_variant
from pcg_engine.attention.metadata import AttentionMetadata
from pcg_engine.attention.rope_kv import rope_and_write_kv
from pcg_engine.attention.triton_attention import unified_attention


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    cuda_graph_safe = True  # provided allow_split_kv is False while capturing
    jit_compiled = True

    def __init__(self, *args, allow_split_kv: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.allow_split_kv = allow_split_kv

    @contextmanager
    def capturing(self):
        """Turns split-KV off for the duration of a CUDA-graph capture."""
        previous, self.allow_split_kv = self.allow_split_kv, False
        try:
            yield self
        finally:
            self.allow_split_kv = previous

    def num_splits(self, meta: AttentionMetadata) -> int:
        if not self.allow_split_kv:
            return 1
        return choose_num_splits(meta.num_tokens, meta.num_reqs, self.num_heads, self.num_kv_heads,
                                 self.head_dim, meta.max_query_len, meta.max_seq_len, self.cos_sin.device)

    def kernel_variant(self, meta: AttentionMetadata, split_kv: bool = True):
        # The fused RoPE + KV write has one variant per model (T sets only its grid).
        splits = self.num_splits(meta) if split_kv else 1
        return kernel_variant(self.num_heads, self.num_kv_heads, self.head_dim, meta.max_query_len, splits)

    def rope_and_write_kv(self, q, k, v, positions, kv_cache, slot_mapping, q_norm=None, k_norm=None,
                          eps: float = 1e-6) -> torch.Tensor:
        # Inside the piecewise graphs: the grid is T (the bucket) and slot_mapping a view of the
        # runner's static buffer, so a replay reads this step's slots. The rotated q is a new
        # tensor (graph memory in a piece); writing it into the attention's `out` would make that
        # buffer both the op's input and its mutated output.
        return rope_and_write_kv(q, k, v, positions, self.cos_sin, kv_cache, slot_mapping, q_norm=q_norm,
                                 k_norm=k_norm, eps=eps)

    def forward(self, q, out, kv_cache, meta: AttentionMetadata) -> None:
        # The eager part of a piecewise step, once per layer: keep the Python short. The split
        # count depends only on the step's host values, so the first layer computes it for all
        # (cached only while splitting is allowed: a capture never reads a cached count).
        if self.allow_split_kv:
            splits = meta.num_splits
            if splits is None:
                splits = meta.num_splits = self.num_splits(meta)
        else:
            splits = 1
        unified_attention(q, kv_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_table,
                          meta.num_reqs, meta.max_query_len, self.scale, splits)
