"""The Triton attention backend: fused RoPE + KV write (rope_kv.py), one unified paged-attention kernel.

Graph safety: both launches take their grids from T, num_reqs, max_query_len and tensor shapes
(bucket values) and read seq_lens / query_start_loc / block_table only on the device, so a
forward can be captured in a full CUDA graph and replayed with new contents of the same buffers.
Split-KV has two policies. An eager step's count (`choose_num_splits`) uses max_seq_len, a
per-step host value, and splits only long contexts (its merge is a second launch). Inside
`capturing()` (the full decode graphs' capture, and their eager stand-in) the count is
`graph_num_splits`, from the bucket's request count, the head counts and the SM count only, with
the tuning GRAPH_SPLIT_DECODE_TUNING (a merge kernel whose grid is the bucket's): a replay launches the captured grid
for any contexts, and small decode batches split from the first token on. The eager count is
stored in the step's metadata by its first attention call.

In piecewise mode the RoPE + KV write runs inside the pieces' graphs (attention/op.py); only
forward() runs between pieces, once per layer.
"""

from contextlib import contextmanager

import torch

from pcg_engine.attention.backend import AttentionBackend
from pcg_engine.attention.launch_config import (GRAPH_SPLIT_DECODE_TUNING, choose_num_splits, graph_num_splits,
                                                 kernel_variant)
from pcg_engine.attention.metadata import AttentionMetadata
from pcg_engine.attention.rope_kv import rope_and_write_kv
from pcg_engine.attention.triton_attention import unified_attention


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    cuda_graph_safe = True  # inside capturing(): split counts from bucket values only
    jit_compiled = True

    def __init__(self, *args, allow_split_kv: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.allow_split_kv = allow_split_kv  # False: never split (either policy)
        self.graphed = False                  # inside capturing()

    @contextmanager
    def capturing(self):
        """Around a CUDA-graph capture of forwards (and whatever stands in for its replays): split
        counts from the bucket's host values (graph_num_splits), never from max_seq_len."""
        previous, self.graphed = self.graphed, True
        try:
            yield self
        finally:
            self.graphed = previous

    def split_launch(self, meta: AttentionMetadata, graphed: bool | None = None):
        """(num_splits, tuning) of a step: tuning None is the module defaults (launch_config)."""
        graphed = self.graphed if graphed is None else graphed
        if not self.allow_split_kv:
            return 1, None
        if graphed:
            splits = graph_num_splits(meta.num_reqs, self.num_kv_heads, meta.max_query_len, self.cos_sin.device)
            return splits, GRAPH_SPLIT_DECODE_TUNING if splits > 1 else None
        return choose_num_splits(meta.num_tokens, meta.num_reqs, self.num_heads, self.num_kv_heads,
                                 self.head_dim, meta.max_query_len, meta.max_seq_len, self.cos_sin.device), None

    def num_splits(self, meta: AttentionMetadata, graphed: bool | None = None) -> int:
        return self.split_launch(meta, graphed)[0]

    def kernel_variant(self, meta: AttentionMetadata, split_kv: bool = True, graphed: bool | None = None):
        # The fused RoPE + KV write has one variant per model (T sets only its grid).
        splits, tuning = self.split_launch(meta, graphed) if split_kv else (1, None)
        return kernel_variant(self.num_heads, self.num_kv_heads, self.head_dim, meta.max_query_len, splits,
                              tuning)

    def rope_and_write_kv(self, q, k, v, positions, kv_cache, slot_mapping, q_norm=None, k_norm=None,
                          eps: float = 1e-6) -> torch.Tensor:
        # Inside the piecewise graphs: the grid is T (the bucket) and slot_mapping a view of the
        # runner's static buffer, so a replay reads this step's slots. The rotated q is a new
        # tensor (graph memory in a piece); writing it into the attention's `out` would make that
        # buffer both the op's input and its mutated output.
        return rope_and_write_kv(q, k, v, positions, self.cos_sin, kv_cache, slot_mapping, q_norm=q_norm,
                                 k_norm=k_norm, eps=eps)

    def forward(self, q, out, kv_cache, meta: AttentionMetadata) -> None:
        # The eager part of a piecewise step, once per layer: keep the Python short. The eager
        # split count depends only on the step's host values, so the first layer computes it for
        # all (a capture never reads or fills that cache: its count is the bucket's).
        if self.graphed:
            splits, tuning = self.split_launch(meta)
        else:
            splits, tuning = meta.num_splits, None
            if splits is None:
                splits = meta.num_splits = self.split_launch(meta)[0]
        unified_attention(q, kv_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_table,
                          meta.num_reqs, meta.max_query_len, self.scale, splits, tuning=tuning)
