"""Compiled (split and whole) models against eager on a mixed workload, on the CPU: no graphs, but
the split, the compiled pieces and the bucket padding all run."""

import os

import pytest
import torch

from compile_helpers import SCHEDULE, run_workload


def _check_against_eager(eager, compiled, schedule=SCHEDULE, prompts=None):
    paths = []

    def check(results, index):
        (ref, ref_inputs), (out, inputs) = results
        assert [r.request_id for r in ref_inputs.sample_rows] == [r.request_id for r in inputs.sample_rows]
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {index}: {m}")
        paths.append((inputs.num_real_tokens, inputs.input_ids.shape[0], compiled.last_path))

    run_workload([eager, compiled], check, schedule=schedule, **({"prompts": prompts} if prompts else {}))
    return paths


def test_piecewise_matches_eager_for_many_token_counts(dense_eager, dense_piecewise):
    paths = _check_against_eager(dense_eager, dense_piecewise)
    buckets = dense_piecewise.token_buckets
    assert buckets[0] == 1 and buckets[-1] == 32
    for real, padded, path in paths:
        if real <= buckets[-1]:
            assert padded == min(b for b in buckets if b >= real) and path == "piecewise"
        else:
            assert padded == real and path == "compiled"
    assert {real for real, _, _ in paths} == {sum(n for _, n in step) for step in SCHEDULE}


def test_dynamo_traces_once_across_batch_shapes(dense_eager, dense_piecewise):
    forward = dense_piecewise.forward_fn
    _check_against_eager(dense_eager, dense_piecewise)
    assert forward.stats.set_ups == 1       # traced (or loaded from a saved trace) once, never retraced
    assert forward.eager_calls == 0          # one-token steps ran the compiled graph (bucket 1)


def test_one_token_runs_compiled_unpadded_without_a_second_trace(dense_eager, dense_piecewise, monkeypatch):
    """The token dim is unbacked (compile/piecewise.py): T = 1 is no Dynamo specialisation, so with
    no padding at all every T, 1 included, runs the one trace and matches eager."""
    forward = dense_piecewise.forward_fn
    traces, compiles = forward.stats.dynamo_traces, forward.stats.inductor_compiles
    monkeypatch.setattr(dense_piecewise, "token_buckets", [])      # nothing padded
    prompts = {"a": [5, 6, 7], "b": list(range(10, 17)), "c": list(range(20, 22))}
    schedule = [[("a", 3)], [("a", 1)], [("b", 7)], [("a", 1)], [("c", 2)], [("a", 1), ("b", 1)], [("c", 1)],
                [("a", 1), ("b", 1), ("c", 1)], [("b", 1)]]
    paths = _check_against_eager(dense_eager, dense_piecewise, schedule=schedule, prompts=prompts)
    assert [(real, padded) for real, padded, _ in paths] == [(t, t) for t in (3, 1, 7, 1, 2, 2, 1, 3, 1)]
    assert {path for _, _, path in paths} == {"compiled"}
    assert forward.stats.dynamo_traces == traces and forward.stats.set_ups == 1 and forward.stats.inductor_compiles == compiles
    assert forward.eager_calls == 0


def test_compile_mode_matches_eager(dense_eager, dense_compile):
    assert dense_compile.token_buckets == []        # nothing padded, T = 1 included
    stats = dense_compile.forward_fn.stats
    assert stats.pieces == 1 and stats.inductor_compiles == 1
    paths = _check_against_eager(dense_eager, dense_compile)
    assert all(padded == real and path == "compiled" for real, padded, path in paths)
    assert stats.set_ups == 1 and dense_compile.forward_fn.eager_calls == 0


def test_timings_recorded(dense_piecewise):
    t = dense_piecewise.timings
    for key in ("dynamo_s", "inductor_s", "compile_cache_hit", "dynamo_traces", "inductor_compiles"):
        assert key in t, key
    # The values, not only the keys (a test audit: zeroed timings passed). The session's first
    # runner of this configuration misses the cache: it traced once and compiled its distinct pieces.
    if not t["compile_cache_hit"]:
        assert t["dynamo_traces"] == 1 and t["inductor_compiles"] >= 1, t
    assert t["dynamo_s"] > 0 and t["inductor_s"] > 0, t
    assert "capture_s" not in t            # no CUDA: nothing captured
    assert dense_piecewise.graph_pool.captures == {}


@pytest.mark.parametrize("tokens", [1, 2, 3, 32, 33])
def test_pick_padding(dense_piecewise, tokens):
    class R:
        pass
    scheduled = [(R(), tokens)]
    pad, pad_reqs, path = dense_piecewise.pick_padding(scheduled)
    if tokens <= 32:
        assert pad == min(b for b in dense_piecewise.token_buckets if b >= tokens)
        assert pad == tokens or tokens not in (1, 2, 32)
        assert path == "piecewise"
    else:
        assert pad is None and path == "compiled"


def test_piecewise_with_kernel_custom_ops_matches_eager(tiny_dense, cache_root):
    """The CUDA configuration's graph: norms and activation are Triton custom ops inside the pieces
    (run by Triton's interpreter on a CPU machine, hence the few small steps)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    from compile_helpers import make_runner
    eager = make_runner(tiny_dense, "eager", kernels=True)
    compiled = make_runner(tiny_dense, "piecewise", kernels=True, max_capture_tokens=4,
                           compile_cache_dir=str(cache_root))
    assert compiled.token_buckets == [1, 2, 4]
    assert "pcg.rms_norm" in "".join(s.graph_module.code for s in compiled.forward_fn.backend.submodules)
    prompts = {"a": [5, 6, 7, 8, 9], "b": [10, 11, 12]}
    schedule = [[("a", 5)], [("a", 1)], [("b", 3), ("a", 1)]]     # T = 5 (above the buckets), 1, 4

    def check(results, index):
        torch.testing.assert_close(results[1][0], results[0][0], atol=1e-4, rtol=1e-4)
    run_workload([eager, compiled], check, schedule=schedule, prompts=prompts)
    stats = compiled.forward_fn.stats
    assert stats.dynamo_traces == 1 and stats.inductor_compiles == 3 and stats.pieces == 5
    assert compiled.forward_fn.eager_calls == 0


def test_norm_folded_into_skinny_projections_matches_unfolded(tiny_dense, tmp_path, monkeypatch):
    """With the fused qkv and gate_up shapes in the skinny GEMM's table, each decoder layer calls
    add_rms_norm_linear instead of the norm and the projection (attend / down take the rest): the
    same numbers as without (on the CPU the op runs the two kernels it replaces)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    from compile_helpers import make_runner
    from pcg_engine.kernels import skinny_gemm
    plain = make_runner(tiny_dense, "eager", kernels=True)
    qkv_shape = tuple(plain.model.model.layers[0].self_attn.qkv_proj.weight.shape)
    up_shape = tuple(plain.model.model.layers[0].mlp.gate_up_proj.weight.shape)
    table = {(m, *shape): skinny_gemm.SkinnyConfig(16, 32, True) for m in (1, 2, 4, 8, 16)
             for shape in (qkv_shape, up_shape)}
    monkeypatch.setattr(skinny_gemm, "TUNED", table)
    folded = make_runner(tiny_dense, "eager", kernels=True)
    # A cache of its own: the patched table changes the trace, which a saved trace would keep.
    compiled = make_runner(tiny_dense, "piecewise", kernels=True, max_capture_tokens=4,
                           compile_cache_dir=str(tmp_path / "cc"))
    layer = folded.model.model.layers[1]
    assert layer.self_attn.qkv_proj.use_kernels and layer.mlp.gate_up_proj.use_kernels
    assert "pcg.add_rms_norm_linear" in "".join(s.graph_module.code for s in compiled.forward_fn.backend.submodules)
    prompts = {"a": [5, 6, 7, 8, 9], "b": [10, 11, 12]}
    schedule = [[("a", 5)], [("a", 1)], [("b", 3), ("a", 1)]]

    def check(results, index):
        torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(results[2][0], results[0][0], atol=1e-4, rtol=1e-4)
    run_workload([plain, folded, compiled], check, schedule=schedule, prompts=prompts)


def test_eager_piece_compiler_matches_eager(tiny_dense, dense_eager, cache_root, monkeypatch):
    """PCG_PIECE_COMPILER=eager (an A/B switch): the same split, the pieces run as their FX graphs,
    no Inductor compile; the same numbers as eager. A name it does not know is refused by name."""
    from compile_helpers import make_runner
    from pcg_engine.compile.backend import PcgBackend
    monkeypatch.setenv("PCG_PIECE_COMPILER", "eager")
    runner = make_runner(tiny_dense, "piecewise", max_capture_tokens=32, compile_cache_dir=str(cache_root))
    paths = _check_against_eager(dense_eager, runner)
    stats = runner.forward_fn.stats
    assert stats.dynamo_traces == 1 and stats.pieces == 5 and stats.splitting_nodes == 4
    # one "compile" per distinct piece key, each the FX graph's own forward
    assert 0 < stats.inductor_compiles < stats.pieces
    assert all(isinstance(fn.__self__, torch.fx.GraphModule) for fn in runner.forward_fn.backend.artifacts.values())
    assert {path for _, _, path in paths} == {"piecewise", "compiled"}
    monkeypatch.setenv("PCG_PIECE_COMPILER", "tvm")
    with pytest.raises(ValueError, match="PCG_PIECE_COMPILER='tvm'"):
        PcgBackend()
