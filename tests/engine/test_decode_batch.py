"""The decode fast path's batch (decode_batch.py) and the quiet booking it allows (row_booking.py).

A DecodeBatch is kept across decode steps while the running rows do not change: its plan list is
handed out again every step, its epochs, smallest length limit and booking flags are not gathered
again. The engine whose requests are bound to rows must still produce, step by step, what the one
with the per-step rebuild (no rows, everything booked per request) produces, now on workloads
where the quiet booking (every row booked at once, no per-row check) takes most steps.
"""

import random

import numpy as np
import pytest

from engine_helpers import make_llm, random_prompts
from pcg_engine.bench.rebuild_baseline import RebuildBatch
from pcg_engine.engine import row_booking
from pcg_engine.engine.block_manager import BlockManager
from pcg_engine.engine.decode_batch import DecodeBatch, ScheduledBatch
from pcg_engine.engine.request import PLACEHOLDER, Request
from pcg_engine.engine.row_state import RowState
from pcg_engine.engine.scheduler import Scheduler, SchedulerConfig
from pcg_engine.sampling_params import SamplingParams
from test_row_state import _run


def _plain_workload(seed: int, n: int, final_only: bool):
    """Plain greedy requests (no text, no logprobs): all streaming or all final-only, some with
    stop ids or EOS, staggered arrivals, a few aborts."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        p = random_prompts([rng.randint(2, 12)], seed=seed * 1000 + i)[0]
        kw = dict(max_tokens=rng.randint(4, 40), ignore_eos=rng.random() < 0.7, temperature=0, detokenize=False)
        if rng.random() < 0.3:
            kw.update(stop_token_ids=[rng.randint(3, 1023) for _ in range(rng.randint(1, 6))])
        reqs.append((f"q{i}", p, SamplingParams(**kw), rng.choice([0, 0, 0, 3, 9]), rng.random() < 0.05,
                     final_only))
    return reqs


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("final_only", [False, True], ids=["stream", "final"])
def test_quiet_booking_equals_rebuild(dense_path, monkeypatch, async_scheduling, final_only):
    quiet = []
    real = row_booking._resolve_quiet

    def counted(*args):
        out = real(*args)
        quiet.append(out is not None)
        return out
    monkeypatch.setattr(row_booking, "_resolve_quiet", counted)
    cfg = dict(num_kv_blocks=300, block_size=4, max_num_seqs=16, async_scheduling=async_scheduling)
    bound = make_llm(dense_path, **cfg).engine
    unbound = make_llm(dense_path, **cfg).engine
    r = unbound.runner
    unbound.runner.batch = RebuildBatch(r.config.max_num_seqs, r.block_size, r.device)
    for seed in (3, 4):
        reqs = _plain_workload(seed, 20, final_only)
        assert _run(bound, reqs) == _run(unbound, reqs)
    assert sum(quiet) > 20, f"the quiet booking ran {sum(quiet)} times"
    assert not all(quiet), "no step fell back to the general booking"


def _bound_scheduler(n: int, bs: int = 4):
    blocks = BlockManager(64, bs)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), blocks)
    state = RowState(8, 65)
    for i in range(n):
        req = Request(f"r{i}", [5 + i, 6, 7], SamplingParams(max_tokens=20))
        sched.add_request(req)
    out = sched.schedule()                               # the prompts, one step
    for row, (req, k) in enumerate(out.scheduled):
        state.bind(req, row)
        state.table_len[row] = len(blocks.block_table(req.request_id))
    sched.update_after_step(out)
    for req, _ in out.scheduled:
        req.append_output(1)
    return sched, state


def _decode(sched):
    out = sched.schedule()
    sched.update_after_step(out)
    for req, _ in out.scheduled:
        req.append_output(2)
    return out


def test_plan_list_is_shared_and_copied_before_an_admission():
    sched, state = _bound_scheduler(3)
    first = _decode(sched)
    assert isinstance(first.scheduled, ScheduledBatch) and first.scheduled.batch is not None
    second = _decode(sched)
    assert second.scheduled is first.scheduled and second.samples is first.samples     # kept
    assert second.scheduled.seq_lens.tolist() == [5, 5, 5] and second.scheduled.max_seq_len == 5
    batch = sched._decode_batch
    sched.add_request(Request("late", [9, 9], SamplingParams(max_tokens=4)))
    third = sched.schedule()                             # three decodes, then the admission
    assert [r.request_id for r, _ in third.scheduled] == ["r0", "r1", "r2", "late"]
    assert third.scheduled is not batch.scheduled and third.scheduled.rows is None
    assert len(batch.scheduled) == 3 and batch.samples == [True] * 3, "the shared plan was not copied"


def test_batch_is_remade_when_a_row_changes_hands():
    sched, state = _bound_scheduler(2)
    _decode(sched)
    batch = sched._decode_batch
    req = sched.running[1]
    table_len = int(state.table_len[1])
    state.unbind(req)                                    # the row released and taken again
    state.bind(req, 1)
    state.table_len[1] = table_len
    assert _decode(sched).scheduled.batch is not batch
    assert sched._decode_batch.epoch.tolist() == state.epoch[[0, 1]].tolist() != batch.epoch.tolist()


def test_flags_follow_the_rows():
    state = RowState(4, 8)
    reqs = [Request(f"r{i}", [1, 2], SamplingParams(max_tokens=3)) for i in range(3)]
    for row, req in enumerate(reqs):
        state.bind(req, row)
        state.describe(row, True, True, row == 2, [])
    batch = DecodeBatch.of(("k",), state, reqs)
    assert batch.flags(state) == (True, True, False)     # row 2 waits for its first token
    state.first_tokens_seen(np.array([2]))
    assert batch.flags(state) == (False, True, False)
    state.describe(1, True, False, False, [])
    assert batch.flags(state) == (False, False, False)   # mixed: some rows stream, some don't
    assert batch.last_min == min(r.last_index for r in reqs)



def test_decode_output_reads_like_a_request_output():
    """DecodeOutput is a tuple (request, end, token) for speed; every field a consumer reads is
    what the RequestOutput of the same step would say."""
    from pcg_engine.outputs import DecodeOutput, RequestOutput
    req = Request("d", [4, 5, 6], SamplingParams(max_tokens=9))
    req.token_ids += [7, 8, -1]
    req.first_token_time = 1.5
    fast = next(map(DecodeOutput, zip([req], [5], [8])))
    full = RequestOutput(req, 5, "", False, [8])
    assert isinstance(fast, RequestOutput)
    for name in ("request_id", "prompt_token_ids", "token_ids", "text", "finished", "finish_reason",
                 "stop_reason", "metrics", "new_token_ids", "new_text", "logprobs", "prompt", "error"):
        assert getattr(fast, name) == getattr(full, name), name
    assert fast.token_ids == [7, 8] and fast.new_token_ids == [8]
    assert repr(fast) == repr(full)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_sync_steps_append_no_placeholder(dense_path, monkeypatch, async_scheduling):
    """Sync scheduling reads a step back right after launching it: the rows get no placeholder,
    the tokens are appended when read back (async: placeholders, resolved in place). In sync, a
    row released between launch and read-back (an abort here) drops its token; the others get
    theirs."""
    seen = []
    from pcg_engine.engine import llm_engine
    real = llm_engine.resolve_rows

    def check(engine, inflight, values):
        state, rows = inflight.state, inflight.rows
        live = state.epoch[rows] == inflight.epoch
        assert inflight.appended == async_scheduling
        if not async_scheduling:
            assert not state.num_placeholders[rows[live]].any()
            assert (state.num_tokens[rows[live]] == inflight.index[live]).all()
        seen.append(int(live.sum()))
        return real(engine, inflight, values)
    monkeypatch.setattr(llm_engine, "resolve_rows", check)
    engine = make_llm(dense_path, num_kv_blocks=100, block_size=4, max_num_seqs=8,
                      async_scheduling=async_scheduling).engine
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0, detokenize=False)
    ids = [engine.add_request(p, params) for p in random_prompts([5, 7, 6], seed=9)]
    for _ in range(4):
        engine.step()
    if not async_scheduling:
        victim, other = engine.requests[ids[1]], engine.requests[ids[2]]
        before, other_before = victim.num_tokens, other.num_tokens
        launched = engine._launch(engine.scheduler.schedule())
        engine.abort_request(ids[1])                     # released while its step is in flight
        engine._resolve(launched)
        assert seen[-1] == 2 and victim.num_tokens == before and victim.num_placeholders == 0
        assert other.num_tokens == other_before + 1 and PLACEHOLDER not in other.token_ids
    while engine.has_unfinished_requests():
        engine.step()
    assert seen and engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_async_decode_steps_find_their_order_by_identity(dense_path, monkeypatch):
    """Async decode steps fill their placeholder inputs by one device copy when the rows keep their
    order; once a step has found that by comparing the arrays, the next ones find it by identity
    (the batch's rows array), without comparing again."""
    from pcg_engine.engine import input_batch
    engine = make_llm(dense_path, num_kv_blocks=100, block_size=4, max_num_seqs=8, async_scheduling=True).engine
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0, detokenize=False)
    for p in random_prompts([5, 7, 6], seed=5):
        engine.add_request(p, params)
    for _ in range(6):
        engine.step()
    compared = []
    real = np.array_equal
    monkeypatch.setattr(input_batch.np, "array_equal", lambda *a: compared.append(1) or real(*a))
    for _ in range(5):
        engine.step()
    assert engine.runner.batch._sampled_rows is engine.scheduler._decode_batch.rows
    assert len(compared) <= 1
