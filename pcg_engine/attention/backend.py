"""What an attention backend must do, including what it takes to live inside a CUDA graph."""

from contextlib import contextmanager

import torch

from pcg_engine.attention.metadata import AttentionMetadata


class AttentionBackend:
    """RoPE + paged-KV write, and attention, for one model's shapes: the two halves the custom ops
    of op.py call (the write inside the compiled pieces, the attention between them).

    q [T, Hq, D], k and v [T, Hk, D] (q and k already RMS-normed per head, not yet rotated; last
    dim contiguous, rows may be strided); kv_cache [2, num_blocks, block_size, Hk, D].
    Slot -1 writes go to the scratch block 0, which the block manager never hands out.
    """

    name = "base"
    # True when forward() reads no host value that changes from step to step within a bucket and
    # never syncs with the host, so it can be captured inside a full CUDA graph.
    cuda_graph_safe = False
    # True when forward() launches JIT-compiled kernels whose variants depend on the step's host
    # values; the start-up warm-up (engine/warmup.py) then runs one step per kernel_variant.
    jit_compiled = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 cos_sin: torch.Tensor, scale: float | None = None):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.cos_sin = cos_sin
        self.scale = scale if scale is not None else head_dim ** -0.5

    def rope_and_write_kv(self, q, k, v, positions, kv_cache, slot_mapping, q_norm=None, k_norm=None,
                          eps: float = 1e-6) -> torch.Tensor:
        """Rotated k and v into kv_cache at slot_mapping [T]; returns rotated q as a new tensor.
        With q_norm / k_norm [D], q and k get the per-head RMSNorm first (Qwen3's q_norm, k_norm).
        Captured inside the piecewise graphs: it must read no per-step host value."""
        raise NotImplementedError

    def forward(self, q, out, kv_cache, meta: AttentionMetadata) -> None:
        """Attention of rotated q [T, Hq, D] over kv_cache (this step's k, v already written) into
        out [T, Hq, D], in place."""
        raise NotImplementedError

    @contextmanager
    def capturing(self, fuse_rope: bool = False):
        """Around the capture of CUDA graphs that hold forward() (and the eager stand-in for their
        replays): launch choices from the bucket's host values only. A no-op where forward() has
        no per-step choice. fuse_rope (the full decode graphs over the eager model): the backend may
        defer rope_and_write_kv into the forward() that follows it, returning a placeholder for q."""
        yield self

    def kernel_variant(self, meta: AttentionMetadata, split_kv: bool = True, graphed: bool | None = None):
        """What forward() compiles for a step with meta's host values (equal values: nothing new to
        compile); None for a backend that compiles nothing. split_kv=False: without split-KV;
        graphed=True: a step inside a full CUDA graph (None: whatever forward() would do now)."""
        return None


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def make_backend(name: str, **kwargs) -> AttentionBackend:
    """'torch' (reference, CPU and GPU), 'triton' (CUDA, graph-safe) or 'auto'."""
    device = kwargs["cos_sin"].device
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from pcg_engine.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(**kwargs)
    if name == "triton":
        from pcg_engine.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(**kwargs)
    raise ValueError(f"attention_backend: {name!r} is not one of 'auto', 'torch', 'triton'")
