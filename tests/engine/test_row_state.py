"""Per-row decode state (row_state.py): bound requests behave exactly like plain ones.

Two levels: a Request bound to a row against an unbound twin under random edits; and whole engines,
one whose requests are bound to the persistent batch's rows (bulk booking, scheduler decode fast
path) against one with the per-step rebuild batch (no rows: every request booked one by one by the
general loop), step by step on random workloads with stops, EOS, length limits, text, logprobs,
final-only requests, aborts, preemption and prefix caching.
"""

import random

import numpy as np
import pytest

from engine_helpers import assert_drained, make_llm, random_prompts
from pcg_engine.bench.rebuild_baseline import RebuildBatch
from pcg_engine.engine.request import PLACEHOLDER, Request
from pcg_engine.engine.row_state import BoundRequest, RowState
from pcg_engine.engine.scheduler import ScheduledBatch
from pcg_engine.sampling_params import SamplingParams


def _same(a: Request, b: Request) -> None:
    assert a.token_ids == b.token_ids
    assert (a.num_tokens, a.num_computed_tokens, a.num_placeholders, a.num_output_tokens) == \
        (b.num_tokens, b.num_computed_tokens, b.num_placeholders, b.num_output_tokens)
    assert a.output_token_ids == b.output_token_ids


@pytest.mark.parametrize("seed", range(6))
def test_bound_request_matches_unbound_twin(seed):
    rng = random.Random(seed)
    state = RowState(4, 200)
    for _ in range(4):                       # rows reused: the previous binding must not leak in
        prompt = [rng.randint(0, 999) for _ in range(rng.randint(1, 20))]
        plain, bound = Request("p", prompt, None), Request("b", prompt, None)
        row = rng.randrange(4)
        state.bind(bound, row)
        assert type(bound) is BoundRequest and type(plain) is Request
        with pytest.raises(RuntimeError, match="already bound"):
            state.bind(bound, (row + 1) % 4)
        pending = []                         # indices of placeholders, oldest first
        for _ in range(rng.randint(20, 60)):
            op = rng.random()
            if op < 0.3 and bound.num_tokens < 190:
                # Placeholders only ever trail the real tokens (the engine resolves them in order).
                token = PLACEHOLDER if pending or rng.random() < 0.5 else rng.randint(0, 999)
                if token == PLACEHOLDER:
                    pending.append(bound.num_tokens)
                for r in (plain, bound):
                    r.append_output(token)
            elif op < 0.45 and pending:
                index, token = pending.pop(0), rng.randint(0, 999)
                for r in (plain, bound):
                    r.resolve_placeholder(index, token)
                with pytest.raises(ValueError):
                    bound.resolve_placeholder(index, token)
            elif op < 0.55:
                keep = rng.randint(len(prompt), plain.num_tokens)
                for r in (plain, bound):
                    r.truncate(keep)
                pending = [i for i in pending if i < keep]
            elif op < 0.75:
                value = rng.randint(0, plain.num_tokens)
                plain.num_computed_tokens = bound.num_computed_tokens = value
            elif op < 0.8:
                # Bulk placeholders, as a launch appends them for every row at once.
                index = state.append_placeholders(np.array([row]))
                assert index.tolist() == [plain.num_tokens]
                pending.append(plain.num_tokens)
                plain.append_output(PLACEHOLDER)
            if rng.random() < 0.4:          # read now and then: the copy syncs from the row
                _same(plain, bound)
        _same(plain, bound)
        epoch = state.epoch[row]
        state.unbind(bound)
        assert type(bound) is Request and bound._rows is None and state.epoch[row] == epoch + 1
        assert not {"_rows", "_row", "_synced"} & set(vars(bound))
        _same(plain, bound)
        bound.append_output(7)               # a plain object again
        plain.append_output(7)
        _same(plain, bound)


def test_stop_screen_covers_every_rows_stop_ids():
    state = RowState(3, 8)
    state.set_stop_ids(0, [5])
    state.set_stop_ids(1, [900, 2])
    assert np.flatnonzero(state.stop_any).tolist() == [2, 5, 900]
    # Beyond the table: the last entry answers, and it is never a stop id (no alarm for the
    # tokens above the largest stop id).
    assert not state.stop_any[-1]
    assert state.stop_any.take(np.array([0, 2, 5, 901, 10**6]), mode="clip").tolist() == [False, True, True, False, False]
    state.set_stop_ids(1, [])
    assert state.stop_any[900], "a screen only ever widens"
    assert not state.stop_hit(np.array([1]), np.array([900])).any()


def test_stop_ids_widen_and_match():
    state = RowState(3, 8)
    state.set_stop_ids(0, [5])
    state.set_stop_ids(2, [1, 2, 3, 9])
    rows = np.array([0, 1, 2, 2])
    assert state.stop_hit(rows, np.array([5, 5, 9, 4])).tolist() == [True, False, True, False]
    state.set_stop_ids(2, [])
    assert not state.stop_hit(rows, np.array([1, 2, 3, 9])).any()


def _workload(seed, n):
    rng = random.Random(seed)
    prefix = random_prompts([12], seed=seed)[0]
    reqs = []
    for i in range(n):
        p = random_prompts([rng.randint(1, 14)], seed=seed * 1000 + i)[0]
        if rng.random() < 0.4:
            p = prefix + p
        kw = dict(max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.6, temperature=0)
        kind = rng.random()
        if kind < 0.15:
            kw.update(logprobs=1)
        elif kind < 0.25:
            kw.update(min_tokens=min(3, kw["max_tokens"]), repetition_penalty=1.1)
        elif kind < 0.35:
            kw.update(stop=["e"])
        if rng.random() < 0.4:
            kw.update(stop_token_ids=[rng.randint(3, 1023) for _ in range(rng.randint(1, 40))])
        # (stop strings need the text: detokenize=False with them is refused)
        detokenize = rng.random() < 0.2 or "stop" in kw
        reqs.append((f"w{i}", p, SamplingParams(detokenize=detokenize, **kw), rng.randint(0, 12),
                     rng.random() < 0.08, rng.random() < 0.4))
    return reqs


def _run(engine, reqs):
    """Every step's outputs as plain values; arrivals, aborts and final_only as the workload says."""
    trace, step = [], 0
    pending = sorted(reqs, key=lambda r: r[3])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            rid, prompt, params, _, _, final_only = pending.pop(0)
            engine.add_request(prompt, params, request_id=rid, final_only=final_only)
        if step == 9:
            for rid, *_, abort, _ in reqs:
                if abort and rid in engine.requests:
                    engine.abort_request(rid)
        trace.append(sorted((o.request_id, o.token_ids, o.new_token_ids, o.finished, o.finish_reason,
                             o.stop_reason, o.text, o.logprobs) for o in engine.step()))
        # The prefix cache too: the same blocks published by the same step (none with a placeholder).
        trace.append(sorted(engine.block_manager._hash_to_block))
        engine.block_manager.check_invariants()
        step += 1
        assert step < 3000
    assert_drained(engine)
    return trace


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_bound_rows_equal_rebuild_step_by_step(dense_path, async_scheduling):
    configs = [dict(num_kv_blocks=200, block_size=4, max_num_seqs=12),                # fast path mostly
               dict(num_kv_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=16)]  # preemptions
    for cfg in configs:
        bound = make_llm(dense_path, async_scheduling=async_scheduling, **cfg).engine
        unbound = make_llm(dense_path, async_scheduling=async_scheduling, **cfg).engine
        r = unbound.runner
        unbound.runner.batch = RebuildBatch(r.config.max_num_seqs, r.block_size, r.device)
        fast = []
        real = bound.scheduler.schedule

        def schedule():
            out = real()
            fast.append(isinstance(out.scheduled, ScheduledBatch) and out.scheduled.rows is not None)
            return out
        bound.scheduler.schedule = schedule
        for seed in (11, 12):
            reqs = _workload(seed, 24)
            assert _run(bound, reqs) == _run(unbound, reqs)
        assert sum(fast) > 10, "the decode fast path never ran"
        if cfg["num_kv_blocks"] == 24:
            assert bound.stats.preemptions > 0 and unbound.stats.preemptions > 0
