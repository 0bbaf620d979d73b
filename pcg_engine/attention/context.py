"""The per-step forward context: how attention gets its metadata without the forward's signature.

The model's forward takes only (input_ids, positions). The runner sets this context around each
forward; the attention custom ops read it (the KV write its slot mapping, attention the rest). Keeping it out of the signature is what lets Dynamo
trace the model once and lets the compiled pieces stay identical from step to step.
"""

from contextlib import contextmanager
from contextvars import ContextVar
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


# A context variable, not a module global: each thread has its own. Two engines stepped in two
# threads (one LLM each) set their contexts around overlapping forwards; in one global, each
# thread's attention read the other engine's slot mapping and metadata (an IndexError deep in the
# KV write, an "outside set_forward_context()" error, or KV written into the wrong slots).
# ContextVar.get() costs ~15 ns more than a global read per attention op (threading.local: ~25-50).
_CONTEXT: ContextVar[ForwardContext | None] = ContextVar("pcg_forward_context", default=None)


def get_forward_context() -> ForwardContext:
    context = _CONTEXT.get()
    if context is None:
        raise RuntimeError("attention called outside set_forward_context(): the runner sets it per step")
    return context


@contextmanager
def set_forward_context(context: ForwardContext):
    token = _CONTEXT.set(context)
    try:
        yield context
    finally:
        _CONTEXT.reset(token)
