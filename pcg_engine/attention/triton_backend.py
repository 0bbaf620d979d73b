"""The Triton attention backend: fused RoPE + KV write, then one unified paged-attention kernel.

Graph safety: both launches take their grids from T, num_reqs, max_query_len and tensor shapes
(bucket values) and read seq_lens / query_start_loc / block_table only on the device, so a
forward can be captured in a full CUDA graph and replayed with new contents of the same buffers.
The one exception is split-KV, whose split count uses max_seq_len (a per-step host value): the
graph runner sets `allow_split_kv = False` around capture (or uses `capturing()`), and eager
steps with small batches and long contexts get it back.
"""

from contextlib import contextmanager

import torch

from pcg_engine.attention.backend import AttentionBackend
from pcg_engine.attention.metadata import AttentionMetadata
from pcg_engine.attention.rope_kv import rope_and_write_kv
from pcg_engine.attention.triton_attention import choose_num_splits, kernel_variant, unified_attention


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

    def forward(self, q, k, v, positions, out, kv_cache, meta: AttentionMetadata) -> None:
        T = q.shape[0]
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = q.view(T, H, D)
        # The rotated q goes into `out` itself: the program that writes a row's output is the one
        # that read that row's q (split-KV writes out only in the later merge kernel), so no
        # temporary is needed. out is a buffer of its own (the op's contract), never a view of q.
        o = out.view(T, H, D)
        q_buf = o if out.dtype == q.dtype else None
        q_rot = rope_and_write_kv(q, k.view(T, Hk, D), v.view(T, Hk, D), positions, self.cos_sin,
                                  kv_cache, meta.slot_mapping, q_out=q_buf)
        unified_attention(q_rot, kv_cache, o, meta.query_start_loc, meta.seq_lens, meta.block_table,
                          meta.num_reqs, meta.max_query_len, self.scale, self.num_splits(meta))
