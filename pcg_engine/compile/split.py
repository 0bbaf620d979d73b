"""Splitting the traced graph at the attention op, and naming pieces by their structure.

The FX graph Dynamo hands the backend is cut at every splitting-op node: each attention call gets
its own submodule and everything between two attentions becomes one piece, so L layers give L + 1
pieces alternating with L attention submodules (2L + 1 submodules in all), in the original order.

Two pieces whose graphs do the same thing on inputs of the same metadata get the same `piece_key`:
with Dynamo inlining nn modules the layer weights and KV-cache buffers are graph inputs, so the
middle pieces of a model differ only in node names, which the key ignores (a per-layer constant,
such as a layer index passed to an op inside a piece, would make every piece distinct). The backend compiles one of them and
reuses the artifact for the rest.
"""

import hashlib
from dataclasses import dataclass

import torch
from torch.fx.passes.split_module import split_module


@dataclass
class Submodule:
    name: str            # attribute of the split module ("submod_3")
    index: int           # position in execution order
    is_splitting_op: bool
    graph_module: torch.fx.GraphModule


def resolve_ops(names) -> set:
    """'pcg::attention' -> {OpOverloadPacket, its overloads}: a node may target either."""
    targets = set()
    for name in names:
        namespace, _, op = name.partition("::")
        op, _, overload = op.partition(".")
        packet = getattr(getattr(torch.ops, namespace), op)
        if overload:
            targets.add(getattr(packet, overload))
            continue
        targets.add(packet)
        for overload_name in packet.overloads():
            targets.add(getattr(packet, overload_name))
    return targets


def split_graph(gm: torch.fx.GraphModule, splitting_ops) -> tuple[torch.fx.GraphModule, list[Submodule]]:
    targets = resolve_ops(splitting_ops)
    node_to_part: dict[torch.fx.Node, int] = {}
    part, split_nodes = 0, set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target in targets:
            # The op sits alone in its own partition, between the piece before and after it.
            part += 1
            node_to_part[node] = part
            split_nodes.add(part)
            part += 1
        else:
            node_to_part[node] = part
    split = split_module(gm, None, lambda node: node_to_part[node], keep_original_order=True)
    subs = []
    # The split module calls its submodules in graph order; follow its call_module nodes.
    for node in split.graph.nodes:
        if node.op == "call_module":
            number = int(str(node.target).rsplit("_", 1)[-1])
            subs.append(Submodule(str(node.target), len(subs), number in split_nodes,
                                  getattr(split, str(node.target))))
    return split, subs


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"T({value.dtype},{tuple(str(s) for s in value.shape)},{tuple(str(s) for s in value.stride())}," \
               f"{value.device.type},{value.requires_grad})"
    if isinstance(value, torch.SymInt):
        return f"S({value.node.expr})"
    return f"V({type(value).__name__}:{value!r})"


def _target_name(target) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', None) or getattr(target, '__name__', repr(target))}" \
        if not isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) else str(target)


def piece_key(gm: torch.fx.GraphModule, example_inputs) -> str:
    """sha256 of the graph's structure (node names replaced by positions) and its inputs' metadata."""
    index: dict[torch.fx.Node, int] = {}
    lines = []

    def arg(value):
        if isinstance(value, torch.fx.Node):
            return f"%{index[value]}"
        if isinstance(value, (list, tuple)):
            return "[" + ",".join(arg(v) for v in value) + "]"
        if isinstance(value, dict):
            return "{" + ",".join(f"{k}:{arg(v)}" for k, v in sorted(value.items())) + "}"
        if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
            return str(value)
        return repr(value)

    for node in gm.graph.nodes:
        index[node] = len(index)
        target = "" if node.op in ("placeholder", "output") else _target_name(node.target)
        lines.append(f"{node.op}|{target}|{arg(node.args)}|{arg(node.kwargs)}")
    lines.extend(_describe(x) for x in example_inputs)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()
