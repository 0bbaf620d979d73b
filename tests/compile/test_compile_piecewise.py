"""Compiled (split and whole) models against eager on a mixed workload, on the CPU: no graphs, but
the split, the compiled pieces and the bucket padding all run."""

import pytest
import torch

from compile_helpers import SCHEDULE, run_workload


def _check_against_eager(eager, compiled):
    paths = []

    def check(results, index):
        (ref, ref_inputs), (out, inputs) = results
        assert [r.request_id for r in ref_inputs.sample_rows] == [r.request_id for r in inputs.sample_rows]
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {index}: {m}")
        paths.append((inputs.num_real_tokens, inputs.input_ids.shape[0], compiled.last_path))

    run_workload([eager, compiled], check)
    return paths


def test_piecewise_matches_eager_for_many_token_counts(dense_eager, dense_piecewise):
    paths = _check_against_eager(dense_eager, dense_piecewise)
    buckets = dense_piecewise.token_buckets
    assert buckets[0] == 2 and buckets[-1] == 32
    for real, padded, path in paths:
        if real <= buckets[-1]:
            assert padded == min(b for b in buckets if b >= real) and path == "piecewise"
        else:
            assert padded == real and path == "compiled"
    assert {real for real, _, _ in paths} == {sum(n for _, n in step) for step in SCHEDULE}


def test_dynamo_traces_once_across_batch_shapes(dense_eager, dense_piecewise):
    forward = dense_piecewise.forward_fn
    _check_against_eager(dense_eager, dense_piecewise)
    assert forward.stats.dynamo_traces == 1
    assert forward.eager_calls == 0          # one-token steps were padded, never run eagerly


def test_compile_mode_matches_eager(dense_eager, dense_compile):
    assert dense_compile.token_buckets == [2]
    stats = dense_compile.forward_fn.stats
    assert stats.pieces == 1 and stats.inductor_compiles == 1
    _check_against_eager(dense_eager, dense_compile)
    assert stats.dynamo_traces == 1


def test_timings_recorded(dense_piecewise):
    t = dense_piecewise.timings
    for key in ("dynamo_s", "inductor_s", "compile_cache_hit", "dynamo_traces", "inductor_compiles"):
        assert key in t, key
    assert "capture_s" not in t            # no CUDA: nothing captured
    assert dense_piecewise.graph_pool.captures == {}


@pytest.mark.parametrize("tokens", [1, 2, 3, 32, 33])
def test_pick_padding(dense_piecewise, tokens):
    class R:
        pass
    scheduled = [(R(), tokens)]
    pad, pad_reqs, path = dense_piecewise.pick_padding(scheduled)
    if tokens <= 32:
        assert pad == max(2, tokens if tokens in dense_piecewise.token_buckets else
                          min(b for b in dense_piecewise.token_buckets if b >= tokens))
        assert path == "piecewise"
    else:
        assert pad is None and path == "compiled"
