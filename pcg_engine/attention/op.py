"""The attention custom ops: the KV write that graphs capture, and the attention the graph is split at.

Each layer makes two calls (registered as custom_ops.py describes, so Dynamo keeps each one node):

  q_rot = pcg::rope_kv_write(q, k, v, positions, kv_cache, q_norm, k_norm, eps)
                                           q/k norm and RoPE on q and k; k, v into the cache
  pcg::attention(q_rot, kv_cache, out)                        paged attention into `out`

Only `pcg::attention` is a splitting op. The KV write stays inside the piece before it, so in
piecewise mode it is captured in that piece's CUDA graph and only the attention kernel runs eagerly
between pieces (the write used to be a second launch from Python per layer per step). That is
safe in a graph because nothing of the write depends on a per-step host value: its grid is T (the
bucket), and its slot mapping is a view of the runner's static buffer, the same address for every
step of a bucket (`metadata.slot_mapping`, read from the forward context when the piece runs).

Which layer: the layer's KV cache is a tensor argument of both ops, never an int. The model keeps
it as a non-persistent buffer of its attention module (`bind_kv_caches`, called by the runner once
the caches are allocated); Dynamo lifts module buffers as graph inputs like the weights, so a piece
takes its layer's cache as an input (at a fixed address: the runner allocates the caches once, so
a CUDA-graph replay needs no copy), and identical layers still compile to identical pieces that
share one artifact. A constant `layer_idx` inside a piece would make every layer's piece distinct.

`kv_cache` is declared mutated by the write (`Tensor(a!)`): Inductor then orders the write before
the attention that reads the same input, and its re-inplacing pass keeps it an in-place write into
the graph input (no copy of the cache; checked in tests/compile/test_kv_write_op.py).

Everything step-specific (metadata, backend) comes from the forward context. With no metadata (the
runner's memory-profiling forward) the write does nothing and the attention writes zeros.
"""

import torch

from pcg_engine.attention.context import get_forward_context
from pcg_engine.custom_ops import pcg_op

SPLITTING_OPS = ["pcg::attention"]


def _rotated_like(q, k, v, positions, kv_cache, q_norm=None, k_norm=None, eps=1e-6):
    return q.new_empty(q.shape)


@pcg_op("rope_kv_write(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor(a!) kv_cache, "
        "Tensor? q_norm=None, Tensor? k_norm=None, float eps=1e-6) -> Tensor",
        fake=_rotated_like)
def rope_kv_write(q, k, v, positions, kv_cache, q_norm=None, k_norm=None, eps=1e-6):
    """q [T, Hq, D], k and v [T, Hk, D] (last dim contiguous), positions [T] -> rotated q [T, Hq, D];
    rotated k and v written into kv_cache [2, NB, BS, Hk, D] at the step's slot mapping.
    q_norm, k_norm [D]: Qwen3's per-head RMSNorm of q and k, applied first (in the same launch on
    the Triton backend)."""
    context = get_forward_context()
    meta = context.metadata
    if meta is None:
        # No requests (memory profiling). Inside a graph capture this would record a forward that
        # never writes the cache: a capture must run with metadata over the static buffers.
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("rope_kv_write captured without metadata: the KV write would be missing "
                               "from the graph (capture with padding metadata, see compile/setup.py)")
        return q.clone()
    return context.backend.rope_and_write_kv(q, k, v, positions, kv_cache, meta.slot_mapping, q_norm, k_norm, eps)


def _no_output(q, kv_cache, out) -> None:
    return None


@pcg_op("attention(Tensor q, Tensor kv_cache, Tensor(a!) out) -> ()", fake=_no_output)
def attention(q, kv_cache, out):
    """q [T, Hq, D] already rotated, kv_cache holding this step's k and v; out [T, Hq, D]."""
    context = get_forward_context()
    meta = context.metadata
    if meta is None:  # a profiling run with no requests
        out.zero_()
        return
    context.backend.forward(q, out, kv_cache, meta)


def bind_kv_caches(model: torch.nn.Module, kv_caches) -> None:
    """Give each attention module (in layer order) its layer's cache; kv_caches=None unbinds them.

    Before a compiled forward is traced: Dynamo guards on the buffers' shapes, so rebinding caches
    of another shape later would retrace."""
    modules = [m for m in model.modules() if hasattr(m, "kv_cache") and hasattr(m, "layer_idx")]
    if kv_caches is None:
        for m in modules:
            m.kv_cache = torch.empty(0, device=m.kv_cache.device)
        return
    if len(modules) != len(kv_caches):
        raise ValueError(f"{len(kv_caches)} KV caches for {len(modules)} attention layers")
    for m in modules:
        m.kv_cache = kv_caches[m.layer_idx]
