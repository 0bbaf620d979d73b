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

Fused RoPE (rope_decode_attention.py), in the full decode graphs only (`capturing(fuse_rope=True)`,
which FullDecodeGraphs enters around the eager model): rope_and_write_kv launches nothing and
returns a placeholder for the rotated q, keeping its raw inputs; the next forward() (the same
layer's attention op, the next call the model makes) launches the decode attention that normalises
and rotates q and k and writes k, v itself, one launch a layer fewer. A step that is not one decode
token a request runs the deferred rope_kv launch there instead, into the placeholder, then attention
as usual. Eager forwards only: the raw q, k, v stay valid between the two ops because this backend
holds them, which an Inductor graph that reuses its buffers would not respect. Off unless
PCG_FUSED_ROPE_ATTENTION=1 (read at import; measured slower in the model, see FUSED_ROPE_ATTENTION).
"""

from contextlib import contextmanager
from typing import NamedTuple

import torch

from pcg_engine import switches
from pcg_engine.attention.backend import AttentionBackend
from pcg_engine.attention.launch_config import (GRAPH_SPLIT_DECODE_TUNING, choose_num_splits, graph_num_splits,
                                                 kernel_variant)
from pcg_engine.attention.metadata import AttentionMetadata
from pcg_engine.attention.rope_decode_attention import rope_decode_attention
from pcg_engine.attention.rope_kv import rope_and_write_kv
from pcg_engine.attention.triton_attention import HEAD_DIMS, cached_plan, unified_attention
from pcg_engine.errors import ConfigError

# Off by default: in the model it lost on the H200 (session 5 final call, Qwen3-0.6B batch-1 full_decode
# 1.003 ms a token with it vs 0.927 without, same call), though one layer alone timed faster
# from a cold L2 (bench_kernels --only rope_attention: 9.6 vs 10.7 us at 384 keys) and slower
# back to back (8.8 vs 7.8): every split program repeats the q (and the owner the k) norm + RoPE
# prologue, which PDL no longer hides. PCG_FUSED_ROPE_ATTENTION=1 turns it on (A/B runs).
FUSED_ROPE_ATTENTION = switches.read("PCG_FUSED_ROPE_ATTENTION", "0") == "1"


class _DeferredRope(NamedTuple):
    """rope_and_write_kv's arguments, kept for the attention call that follows it."""
    q_rot: torch.Tensor   # the placeholder returned for the rotated q: that call's q
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    cuda_graph_safe = True  # inside capturing(): split counts from bucket values only
    jit_compiled = True

    def __init__(self, *args, allow_split_kv: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        if self.head_dim not in HEAD_DIMS:
            # The kernels tile a head in one power-of-two block. A checkpoint whose head_dim the
            # config accepts (any even one) failed on its first step, on a bare assert.
            raise ConfigError("attention_backend", f"'triton' runs head_dim {', '.join(map(str, HEAD_DIMS))}; this "
                                                   f"checkpoint's head_dim is {self.head_dim}: use "
                                                   "attention_backend='torch' (modes eager, compile or piecewise)")
        self.allow_split_kv = allow_split_kv  # False: never split (either policy)
        self.graphed = False                  # inside capturing()
        self.fuse_rope = False                # inside capturing(fuse_rope=True), switch on
        self._deferred: _DeferredRope | None = None

    @contextmanager
    def capturing(self, fuse_rope: bool = False):
        """Around a CUDA-graph capture of forwards (and whatever stands in for its replays): split
        counts from the bucket's host values (graph_num_splits), never from max_seq_len. fuse_rope:
        decode steps fuse the RoPE + KV write into attention (module docstring; eager forwards only)."""
        previous = self.graphed, self.fuse_rope
        self.graphed, self.fuse_rope = True, fuse_rope and FUSED_ROPE_ATTENTION
        try:
            yield self
        finally:
            self.graphed, self.fuse_rope = previous
            self._deferred = None   # a forward that failed half-way leaves nothing for the next

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
        # The fused RoPE + KV write has one variant per model (T sets only its grid). graphed=True
        # is the full decode graphs, which fuse RoPE into decode attention when the switch is on.
        splits, tuning = self.split_launch(meta, graphed) if split_kv else (1, None)
        variant = kernel_variant(self.num_heads, self.num_kv_heads, self.head_dim, meta.max_query_len, splits,
                                 tuning)
        fuse = self.fuse_rope if graphed is None else graphed and FUSED_ROPE_ATTENTION
        if split_kv and fuse and self.fusable(meta, splits, tuning):
            variant = variant._replace(rope_fused=True)
        return variant

    @staticmethod
    def fusable(meta: AttentionMetadata, splits: int, tuning) -> bool:
        """Whether rope_decode_attention runs the step: one decode token a request (T == R, as the
        full decode graphs' metadata has it), the split merge as a kernel, and split-KV on, i.e. a
        small batch (graph_num_splits > 1: up to 8 requests on an H200 with 8 kv heads). Measured on
        the H200 (session 5 call 4): Qwen3-8B batch-1 full_decode 4.757 -> 4.630 ms a token with the
        fusion, but at 256 decodes (one split) the step's GPU time rose 1.94 -> 2.14 ms: there
        the attention loop carries the fused prologue's registers across every key tile, while
        the separate RoPE + KV write costs one short kernel among 256-row ones."""
        return (meta.max_query_len == 1 and meta.num_tokens == meta.num_reqs >= 1 and splits > 1
                and not (tuning is not None and tuning.fused_merge))

    def rope_and_write_kv(self, q, k, v, positions, kv_cache, slot_mapping, q_norm=None, k_norm=None,
                          eps: float = 1e-6) -> torch.Tensor:
        # Inside the piecewise graphs: the grid is T (the bucket) and slot_mapping a view of the
        # runner's static buffer, so a replay reads this step's slots. The rotated q is a new
        # tensor (graph memory in a piece); writing it into the attention's `out` would make that
        # buffer both the op's input and its mutated output.
        if self.fuse_rope:
            # Deferred to the attention call (module docstring). A write still pending means an
            # attention call went missing: its layer's KV would be lost, so fail here.
            if self._deferred is not None:
                raise RuntimeError("rope_and_write_kv: the previous deferred RoPE + KV write had no attention call")
            q_rot = q.new_empty(q.shape)
            self._deferred = _DeferredRope(q_rot, q, k, v, positions, kv_cache, slot_mapping, q_norm, k_norm, eps)
            return q_rot
        return rope_and_write_kv(q, k, v, positions, self.cos_sin, kv_cache, slot_mapping, q_norm=q_norm,
                                 k_norm=k_norm, eps=eps)

    def layer_calls(self, meta: AttentionMetadata, q, kv_cache, out, layers: tuple, last=None):
        """For a replay program (compile/replay_program.py): the launches forward() would make for
        each of `layers` ((q, kv_cache, out) addresses of tensors with these tensors' shapes, strides
        and dtypes), as a launch_plan.LayerCalls, the step's launch plan looked up once for them all
        (`last`: the program's previous one, served again where it still holds). None: run forward()
        for each (no plan recorded yet for this step's host values, or a call the plans do not serve)."""
        if self.graphed or self.fuse_rope or self._deferred is not None:
            return None
        splits = meta.num_splits
        if splits is None:
            splits = meta.num_splits = self.split_launch(meta)[0]
        plan = cached_plan(q, kv_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_table, meta.num_reqs,
                           meta.max_query_len, self.scale, splits)
        if plan is None:
            return None
        return plan.for_layers(layers, meta.query_start_loc.data_ptr(), meta.seq_lens.data_ptr(),
                               meta.block_table.data_ptr(), last)

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
        deferred = self._deferred
        if deferred is not None:
            self._deferred = None
            if q.data_ptr() != deferred.q_rot.data_ptr() or kv_cache.data_ptr() != deferred.kv_cache.data_ptr():
                raise RuntimeError("attention: a deferred RoPE + KV write is pending for another q or KV cache")
            d = deferred
            if self.fusable(meta, splits, tuning):
                rope_decode_attention(d.q, d.k, d.v, d.positions, self.cos_sin, kv_cache, d.slot_mapping, out,
                                      meta.seq_lens, meta.block_table, meta.num_reqs, self.scale, splits,
                                      d.q_norm, d.k_norm, d.eps, tuning=tuning)
                return
            rope_and_write_kv(d.q, d.k, d.v, d.positions, self.cos_sin, kv_cache, d.slot_mapping, q_out=q,
                              q_norm=d.q_norm, k_norm=d.k_norm, eps=d.eps)
        unified_attention(q, kv_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_table,
                          meta.num_reqs, meta.max_query_len, self.scale, splits, tuning=tuning)
