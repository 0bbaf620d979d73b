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


def test_layer_index_stays_in_attention_nodes(dense_piecewise):
    backend = dense_piecewise.forward_fn.backend
    indices = []
    for sub in backend.submodules:
        if sub.is_splitting_op:
            (node,) = [n for n in sub.graph_module.graph.nodes if n.op == "call_function"]
            indices.append(node.args[-1])
    assert indices == list(range(dense_piecewise.num_layers))


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


def test_split_graph_on_a_plain_fx_graph():
    import pcg_engine.attention.op  # noqa: F401

    def model(q, positions):
        outs = []
        for layer in range(3):
            q = q * 2
            out = torch.empty_like(q)
            torch.ops.pcg.attention(q, q, q, positions, out, layer)
            q = out + 1
            outs.append(q)
        return q

    gm = torch.fx.symbolic_trace(model)
    split, subs = split_graph(gm, ["pcg::attention"])
    assert len(subs) == 7 and sum(s.is_splitting_op for s in subs) == 3
