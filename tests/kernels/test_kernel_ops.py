"""The pcg:: custom ops: schemas and fake kernels, opaque nodes under torch.compile, CUDA graphs."""

import pytest
import torch

import pcg_engine.kernels.ops  # noqa: F401  (registers torch.ops.pcg.*)
from pcg_engine.kernels.activation import silu_and_mul_ref
from pcg_engine.kernels.fused_moe import fused_moe_ref
from pcg_engine.kernels.norm import add_rms_norm_ref, rms_norm_ref

FP32 = dict(rtol=1e-4, atol=1e-4)
OPS = ["rms_norm", "add_rms_norm", "silu_and_mul", "fused_moe"]


def make_inputs(device, n=5, d=32, inter=16, num_experts=4, top_k=2, dtype=torch.float32):
    x = torch.randn(n, d, device=device, dtype=dtype)
    residual = torch.randn(n, d, device=device, dtype=dtype)
    w = torch.randn(d, device=device, dtype=dtype)
    gate_up = torch.randn(n, 2 * inter, device=device, dtype=dtype)
    w13 = (torch.randn(num_experts, 2 * inter, d, device=device) / d ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, d, inter, device=device) / inter ** 0.5).to(dtype)
    topk_weights, topk_ids = torch.topk(torch.randn(n, num_experts, device=device).softmax(-1), top_k)
    return dict(x=x, residual=residual, w=w, gate_up=gate_up, w13=w13, w2=w2,
                topk_weights=topk_weights, topk_ids=topk_ids)


def op_args(name, t):
    return {
        "rms_norm": (t["x"], t["w"], 1e-6),
        "add_rms_norm": (t["x"], t["residual"], t["w"], 1e-6),
        "silu_and_mul": (t["gate_up"],),
        "fused_moe": (t["x"], t["w13"], t["w2"], t["topk_weights"], t["topk_ids"]),
    }[name]


def reference(name, t):
    return {
        "rms_norm": rms_norm_ref,
        "add_rms_norm": add_rms_norm_ref,
        "silu_and_mul": silu_and_mul_ref,
        "fused_moe": fused_moe_ref,
    }[name](*op_args(name, t))


@pytest.mark.parametrize("name", OPS)
def test_op_matches_reference_and_fake(name, device):
    t = make_inputs(device)
    op = getattr(torch.ops.pcg, name)
    out = op(*op_args(name, t))
    torch.testing.assert_close(out, reference(name, t), **FP32)
    # The fake kernel must agree with the real one on shapes, dtypes and strides, or Inductor
    # plans the surrounding buffers wrongly.
    torch.library.opcheck(op, op_args(name, t), test_utils=("test_schema", "test_faketensor"))


def fused_layer(x, residual, w, w13, w2, topk_weights, topk_ids, gate_up):
    """A decoder layer's worth of the ops, with torch arithmetic between them for Inductor."""
    h, residual = torch.ops.pcg.add_rms_norm(x * 2.0, residual, w, 1e-6)
    act = torch.ops.pcg.silu_and_mul(gate_up + 1.0)
    moe = torch.ops.pcg.fused_moe(h, w13, w2, topk_weights, topk_ids)
    return torch.ops.pcg.rms_norm(moe + residual, w, 1e-6), act * 0.5


def eager_layer(x, residual, w, w13, w2, topk_weights, topk_ids, gate_up):
    h, residual = add_rms_norm_ref(x * 2.0, residual, w, 1e-6)
    act = silu_and_mul_ref(gate_up + 1.0)
    moe = fused_moe_ref(h, w13, w2, topk_weights, topk_ids)
    return rms_norm_ref(moe + residual, w, 1e-6), act * 0.5


def test_compile_fullgraph_keeps_ops_opaque(device):
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    t = make_inputs(device)
    args = [t[k] for k in ("x", "residual", "w", "w13", "w2", "topk_weights", "topk_ids", "gate_up")]
    torch._dynamo.reset()
    compiled = torch.compile(fused_layer, backend=record, fullgraph=True, dynamic=True)
    for out, ref in zip(compiled(*args), eager_layer(*args)):
        torch.testing.assert_close(out, ref, **FP32)
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    for name in OPS:
        assert sum(target in (f"pcg.{name}", f"pcg.{name}.default") for target in targets) == 1, targets


def test_compile_traces_fakes_with_symbolic_tokens(device):
    # aot_eager runs AOTAutograd's functionalisation and fake-tensor tracing through the fake
    # kernels, as Inductor does, without the minute-long C++ build on a CPU machine (the gpu test
    # below compiles with Inductor for real).
    t = make_inputs(device)
    args = [t[k] for k in ("x", "residual", "w", "w13", "w2", "topk_weights", "topk_ids", "gate_up")]
    torch._dynamo.reset()
    compiled = torch.compile(fused_layer, backend="aot_eager", fullgraph=True, dynamic=True)
    for out, ref in zip(compiled(*args), eager_layer(*args)):
        torch.testing.assert_close(out, ref, **FP32)
    t = make_inputs(device, n=3)  # a new token count runs the same graph
    args = [t[k] for k in ("x", "residual", "w", "w13", "w2", "topk_weights", "topk_ids", "gate_up")]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for out, ref in zip(compiled(*args), eager_layer(*args)):
            torch.testing.assert_close(out, ref, **FP32)


@pytest.mark.gpu
@pytest.mark.parametrize("name", OPS)
def test_gpu_op_capture_and_replay(name, rel_err):
    t = make_inputs("cuda", n=64, d=2048, inter=768, num_experts=128, top_k=8, dtype=torch.bfloat16)
    args = op_args(name, t)
    op = getattr(torch.ops.pcg, name)
    op(*args)  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(*args)
    for _ in range(2):
        fresh = make_inputs("cuda", n=64, d=2048, inter=768, num_experts=128, top_k=8, dtype=torch.bfloat16)
        for key in ("x", "residual", "gate_up", "topk_weights", "topk_ids"):
            t[key].copy_(fresh[key])
        graph.replay()
        ref = reference(name, t)
        outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
        for o, r in zip(outs, refs):
            assert rel_err(o, r) <= 1e-2


@pytest.mark.gpu
def test_gpu_compiled_layer_in_cuda_graph(rel_err):
    t = make_inputs("cuda", n=32, d=1024, inter=768, num_experts=16, top_k=4, dtype=torch.bfloat16)
    args = [t[k] for k in ("x", "residual", "w", "w13", "w2", "topk_weights", "topk_ids", "gate_up")]
    torch._dynamo.reset()
    compiled = torch.compile(fused_layer, fullgraph=True)
    compiled(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = compiled(*args)
    fresh = make_inputs("cuda", n=32, d=1024, inter=768, num_experts=16, top_k=4, dtype=torch.bfloat16)
    for key in ("x", "residual", "gate_up", "topk_weights", "topk_ids"):
        t[key].copy_(fresh[key])
    graph.replay()
    for out, ref in zip(outs, eager_layer(*args)):
        assert rel_err(out, ref) <= 2e-2
