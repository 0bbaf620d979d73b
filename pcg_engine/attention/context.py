"""The per-step forward context: how attention gets its metadata without the forward's signature.

The model's forward takes only (input_ids, positions). The runner sets this context around each
forward; the attention custom ops read it (the KV write its slot mapping, attention the rest). Keeping it out of the signature is what lets Dynamo
trace the model once and lets the compiled pieces stay identical from step to step.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pcg_engine.attention.metadata import AttentionMetadata


@dataclass
class ForwardContext:
    metadata: AttentionMetadata | None
    # The runner's caches, for tools and tests; the ops take their layer's cache as an argument
    # (attention/op.py), so nothing per-layer is looked up here.
    kv_caches: list[torch.Tensor]
    backend: "object"  # an AttentionBackend


_CONTEXT: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside set_forward_context(): the runner sets it per step")
    return _CONTEXT


@contextmanager
def set_forward_context(context: ForwardContext):
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, context
    try:
        yield context
    finally:
        _CONTEXT = previous
