"""The KV write inside the compiled pieces (attention/op.py): what a piece's CUDA graph would capture.

On the CPU the pieces run compiled but not captured, so this checks what capture depends on: each
piece takes its layer's KV cache as an input (the runner's own tensor, not a constant and not a
copy Inductor made for the mutation), and the write reads the slot mapping from the runner's static
buffer, at the same address for every bucket, padding rows holding -1."""

import torch

from compile_helpers import run_workload
from pcg_engine.compile.setup import dummy_metadata


def _record_writes(monkeypatch, runner):
    calls = []
    real = runner.backend.rope_and_write_kv

    def record(q, k, v, positions, kv_cache, slot_mapping, *norms):
        calls.append((kv_cache.data_ptr(), slot_mapping.data_ptr(), slot_mapping.shape[0], q.shape[0]))
        return real(q, k, v, positions, kv_cache, slot_mapping, *norms)
    monkeypatch.setattr(runner.backend, "rope_and_write_kv", record)
    return calls


def _check_writes(runner, calls):
    L = runner.num_layers
    assert calls and len(calls) % L == 0
    caches = [c.data_ptr() for c in runner.kv_caches]
    slots = runner.batch.slot_mapping.data_ptr()
    for i in range(0, len(calls), L):
        step = calls[i:i + L]
        # In layer order, into the runner's caches themselves: Inductor kept the mutation in place.
        assert [c[0] for c in step] == caches
        # Every layer of a step reads the static slot buffer, one slot per (padded) row.
        assert all(c[1] == slots and c[2] == c[3] == step[0][3] for c in step)


def test_compiled_write_goes_into_the_runners_caches(dense_compile, dense_eager, monkeypatch):
    calls = _record_writes(monkeypatch, dense_compile)

    def check(results, index):
        torch.testing.assert_close(results[1][0], results[0][0], atol=1e-4, rtol=1e-4)
    run_workload([dense_eager, dense_compile], check)
    _check_writes(dense_compile, calls)


def test_piece_inputs_are_the_layer_caches_and_static_slots(dense_piecewise, dense_eager, monkeypatch):
    runner = dense_piecewise
    calls = _record_writes(monkeypatch, runner)
    split = runner.forward_fn.backend.split_module
    pieces = [s for s in runner.forward_fn.backend.submodules if not s.is_splitting_op]
    piece_args = {}
    for index, sub in enumerate(pieces):
        compiled = split.__dict__[sub.name]

        def recorded(*args, _index=index, _compiled=compiled):
            piece_args.setdefault(_index, []).append([a.data_ptr() for a in args if isinstance(a, torch.Tensor)])
            return _compiled(*args)
        monkeypatch.setitem(split.__dict__, sub.name, recorded)

    padded = []

    def check(results, index):
        torch.testing.assert_close(results[1][0], results[0][0], atol=1e-4, rtol=1e-4)
        meta = results[1][1].metadata
        assert meta.slot_mapping.data_ptr() == runner.batch.slot_mapping.data_ptr()
        real = results[1][1].num_real_tokens
        if meta.num_tokens > real:
            padded.append(index)
            assert (meta.slot_mapping[real:] == -1).all(), "padding rows must write the scratch block"
    run_workload([dense_eager, runner], check)
    assert padded, "no step was padded"
    _check_writes(runner, calls)
    # Piece i (the one before attention i) takes layer i's cache as an input, every step; the last
    # piece (final norm) takes none.
    caches = [c.data_ptr() for c in runner.kv_caches]
    for i, cache in enumerate(caches):
        assert all(cache in args for args in piece_args[i])
        assert not any(c in args for c in caches if c != cache for args in piece_args[i])
    assert not any(c in args for c in caches for args in piece_args[len(pieces) - 1])
    # The capture's dummy step uses the same buffer, all padding.
    meta = dummy_metadata(runner, 8)
    assert meta.slot_mapping.data_ptr() == runner.batch.slot_mapping.data_ptr()
    assert (meta.slot_mapping == -1).all() and meta.num_reqs == 0
