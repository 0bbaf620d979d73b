"""The split of the traced graph at attention and the sharing of identical pieces (CPU)."""

import torch

from pcg_engine.compile.split import piece_key, split_graph


def test_split_gives_2L_plus_1_submodules_alternating(dense_piecewise):
    stats = dense_piecewise.forward_fn.stats
    L = dense_piecewise.num_layers
    assert stats.submodules == 2 * L + 1
    assert stats.splitting_nodes == L
    assert stats.pieces == L + 1
    subs = dense_piecewise.forward_fn.backend.submodules
    assert [s.is_splitting_op for s in subs] == [i % 2 == 1 for i in range(2 * L + 1)]
    for sub in subs:
        has_attention = "pcg.attention" in sub.graph_module.code
        assert has_attention == sub.is_splitting_op


def test_identical_layers_share_compiled_code(dense_piecewise):
    stats = dense_piecewise.forward_fn.stats
    # First piece (embedding), last (final norm) and one for every middle piece.
    assert stats.inductor_compiles == 3 < stats.pieces
    assert stats.reuses == stats.pieces - stats.inductor_compiles
    middle = stats.keys[1:-1]
    assert len(set(middle)) == 1 and middle[0] not in (stats.keys[0], stats.keys[-1])


def test_layer_cache_reaches_the_ops_as_a_graph_input(dense_piecewise):
    """Layer identity is a tensor input (the layer's KV cache buffer, lifted by Dynamo), never a
    constant: each attention node and the KV write in the piece before it read the same placeholder,
    and every layer's is a different one."""
    split = dense_piecewise.forward_fn.backend.split_module
    placeholders = {n for n in split.graph.nodes if n.op == "placeholder"}
    calls = [n for n in split.graph.nodes if n.op == "call_module"]
    caches = []
    for i, node in enumerate(calls):
        if i % 2 == 0:
            continue
        (cache,) = [a for a in node.args if a in placeholders and "kv_cache" in a.name]
        assert all(not isinstance(a, int) for a in node.args)
        assert cache in calls[i - 1].args, "the piece before the attention must write this cache"
        caches.append(cache)
    assert len(set(caches)) == dense_piecewise.num_layers
    assert all(f"layers_modules_{i}_" in c.name for i, c in enumerate(caches))


def test_dump_graph(dense_piecewise, tmp_path):
    paths = dense_piecewise.forward_fn.dump_graph(tmp_path)
    names = sorted(p.rsplit("/", 1)[-1] for p in paths)
    assert "split_graph.py" in names and "traced_graph.py" in names
    L = dense_piecewise.num_layers
    pieces = [n for n in names if n[:3].isdigit()]
    assert len(pieces) == 2 * L + 1
    text = (tmp_path / "001_submod_1.py").read_text()
    assert "splitting op" in text and "pcg.attention" in text


def test_piece_key_ignores_names_not_structure():
    def f(x, w):
        return torch.relu(x @ w) + 1

    def g(y, v):
        return torch.relu(y @ v) + 1

    def h(x, w):
        return torch.sigmoid(x @ w) + 1

    args = [torch.randn(3, 4), torch.randn(4, 4)]
    gf, gg, gh = (torch.fx.symbolic_trace(fn) for fn in (f, g, h))
    assert piece_key(gf, args) == piece_key(gg, args)
    assert piece_key(gf, args) != piece_key(gh, args)
    assert piece_key(gf, args) != piece_key(gf, [torch.randn(3, 4, dtype=torch.float64), args[1]])


def _plain_split():
    import pcg_engine.attention.op  # noqa: F401

    def model(q, positions):
        outs = []
        for _ in range(3):
            q = q * 2
            cache = torch.zeros(2, 4, 4, 2, 8)
            rotated = torch.ops.pcg.rope_kv_write(q, q[:, :2], q[:, :2], positions, cache)
            out = torch.empty_like(q)
            torch.ops.pcg.attention(rotated, cache, out)
            q = out + 1
            outs.append(q)
        return q

    gm = torch.fx.symbolic_trace(model)
    return split_graph(gm, ["pcg::attention"])[1]


def test_split_graph_on_a_plain_fx_graph():
    subs = _plain_split()
    assert len(subs) == 7 and sum(s.is_splitting_op for s in subs) == 3


def test_attention_submodules_run_as_direct_kernel_calls(dense_piecewise):
    """Between pieces the split module calls the attention kernel itself (no dispatcher, no
    GraphModule call), with the submodule's inputs in the op's argument order."""
    from pcg_engine.attention.context import ForwardContext, set_forward_context
    from pcg_engine.compile.backend import EagerOp, eager_call

    backend = dense_piecewise.forward_fn.backend
    for sub in backend.submodules:
        runner = backend.split_module.__dict__[sub.name]
        assert isinstance(runner, EagerOp) == sub.is_splitting_op

    calls = []

    class Recorder:
        def forward(self, q, out, kv_cache, meta):
            calls.append((q, out, kv_cache, meta))

    sub = _plain_split()[1]
    run = eager_call(sub.graph_module)
    assert isinstance(run, EagerOp)
    names = [n.name for n in sub.graph_module.graph.nodes if n.op == "placeholder"]
    inputs = [torch.full((1,), float(i)) for i in range(len(names))]
    meta = object()
    with set_forward_context(ForwardContext(meta, [], Recorder())):
        assert run(*inputs) == ()
    (q, out, cache, seen_meta), = calls
    (node,) = [n for n in sub.graph_module.graph.nodes if n.op == "call_function"]
    expected = [inputs[names.index(a.name)] for a in node.args]
    assert all(got is want for got, want in zip((q, cache, out), expected)) and seen_meta is meta


def test_submodule_inputs_from_dynamo_meta_match_a_fake_run(dense_piecewise):
    """The pieces' example inputs come from the fake values Dynamo leaves on the placeholders; the
    fallback (one value missing: an FX interpreter runs the split module on the fake inputs) gives
    every submodule the same inputs by piece key, and those keys are the backend's own."""
    from torch._guards import detect_fake_mode

    from pcg_engine.compile.backend import submodule_inputs
    backend = dense_piecewise.forward_fn.backend
    gm = backend.graph
    fakes = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode(fakes)
    split, subs = split_graph(gm, backend.splitting_ops)
    from_meta = submodule_inputs(split, subs, fake_mode, fakes)
    victim = next(n for n in subs[2].graph_module.graph.nodes if n.op == "placeholder")
    del victim.meta["example_value"]
    with torch.inference_mode():   # as the backend runs: inside the set-up's dummy forward
        from_run = submodule_inputs(split, subs, fake_mode, fakes)
    assert set(from_meta) == set(from_run) == {s.name for s in subs}
    pieces = [s for s in subs if not s.is_splitting_op]
    keys_meta = [piece_key(s.graph_module, from_meta[s.name]) for s in pieces]
    keys_run = [piece_key(s.graph_module, from_run[s.name]) for s in pieces]
    assert keys_meta == keys_run == backend.stats.keys
    for s in subs:
        assert len(from_meta[s.name]) == len(from_run[s.name])
