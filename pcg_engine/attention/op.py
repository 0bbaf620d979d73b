"""The attention custom op: the one node Dynamo keeps opaque and the graph is split at.

`pcg::attention(q, k, v, positions, out, layer_idx)` applies RoPE to q and k, writes k and v into
layer `layer_idx`'s paged KV cache and attends, writing into `out` (declared mutated, so the op
returns nothing and Dynamo keeps it as one node). Everything step-specific (metadata, caches,
backend) comes from the forward context.

`layer_idx` is an argument of the opaque node only: the compiled pieces between attentions never
see it, so identical layers compile to identical pieces and share code.
"""

from pcg_engine.attention.context import get_forward_context
from pcg_engine.custom_ops import pcg_op

SPLITTING_OPS = ["pcg::attention"]


def _no_output(q, k, v, positions, out, layer_idx) -> None:
    return None


@pcg_op("attention(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor(a!) out, int layer_idx) -> ()",
        fake=_no_output)
def attention(q, k, v, positions, out, layer_idx):
    context = get_forward_context()
    if context.metadata is None:  # a profiling or warm-up run with no requests
        out.zero_()
        return
    context.backend.forward(q, k, v, positions, out, context.kv_caches[layer_idx], context.metadata)
