"""What an attention backend must do, including what it takes to live inside a CUDA graph."""

import torch

from pcg_engine.attention.metadata import AttentionMetadata


class AttentionBackend:
    """RoPE + paged-KV write + attention for one model's shapes.

    q [T, Hq*D], k and v [T, Hk*D] (q and k already RMS-normed per head, not yet rotated);
    kv_cache [2, num_blocks, block_size, Hk, D]; out [T, Hq*D] is written in place.
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

    def forward(self, q, k, v, positions, out, kv_cache, meta: AttentionMetadata) -> None:
        raise NotImplementedError

    def kernel_variant(self, meta: AttentionMetadata, split_kv: bool = True):
        """What forward() compiles for a step with meta's host values (equal values: nothing new to
        compile); None for a backend that compiles nothing. split_kv=False: a graph-captured step."""
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
