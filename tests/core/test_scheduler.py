"""Scheduler: continuous batching, chunked prefill, preemption, aborts, the async in-flight rules."""

from types import SimpleNamespace

import pytest

from pcg_engine.engine.block_manager import BlockManager
from pcg_engine.engine.request import PLACEHOLDER, Request, RequestStatus
from pcg_engine.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pcg_engine.errors import ConfigError, InvalidRequestError

BS = 4


def req(rid, tokens, max_tokens=16, arrival=None):
    return Request(rid, tokens, SimpleNamespace(max_tokens=max_tokens), arrival_time=arrival)


def make(num_blocks=64, seqs=8, budget=64, max_len=256, chunked=True, caching=True):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(seqs, budget, max_len, chunked), bm)


def step(s, token=7, placeholder=False):
    """Schedule, 'launch' and append one token for every request that samples."""
    out = s.schedule()
    s.update_after_step(out)
    for r in out.sampling_requests:
        r.append_output(PLACEHOLDER if placeholder else token)
    s.block_manager.check_invariants()
    return out


def plan(out):
    return [(r.request_id, n) for r, n in out.scheduled]


def test_config_validation():
    with pytest.raises(ConfigError, match="max_num_seqs"):
        SchedulerConfig(0, 8, 8)
    with pytest.raises(ConfigError, match="max_model_len"):
        SchedulerConfig(1, 8, -3)


def test_prefill_then_decodes():
    s = make()
    a = req("a", list(range(10)))
    s.add_request(a)
    out = step(s)
    assert plan(out) == [("a", 10)] and out.samples == [True] and out.admitted == [a]
    assert out.num_batched_tokens == 10 and a.status == RequestStatus.RUNNING
    assert a.first_scheduled_time is not None
    out = step(s)
    assert plan(out) == [("a", 1)] and out.samples == [True] and out.admitted == []
    assert a.num_computed_tokens == 11 and a.num_tokens == 12


def test_chunked_prefill_token_counts_exact():
    s = make(budget=4)
    a, b = req("a", list(range(10))), req("b", list(range(50, 53)))
    s.add_request(a)
    s.add_request(b)
    assert plan(step(s)) == [("a", 4)]
    out = step(s)
    assert plan(out) == [("a", 4)] and out.samples == [False]
    out = step(s)                                      # a's last 2 prompt tokens, b's first 2
    assert plan(out) == [("a", 2), ("b", 2)] and out.samples == [True, False]
    assert out.num_batched_tokens == 4
    out = step(s)
    assert plan(out) == [("a", 1), ("b", 1)] and out.samples == [True, True]


def test_running_requests_go_first_and_decodes_take_one():
    s = make(budget=8)
    s.add_request(req("a", [1, 2]))
    step(s)
    s.add_request(req("b", list(range(20))))
    out = step(s)
    assert plan(out) == [("a", 1), ("b", 7)]


def test_without_chunked_prefill_the_queue_waits():
    s = make(budget=8, chunked=False, max_len=8)
    s.add_request(req("a", [1, 2]))
    s.add_request(req("b", list(range(8))))
    s.add_request(req("c", [5]))
    assert plan(step(s)) == [("a", 2)]                 # b (8) no longer fits, and c may not pass it
    assert plan(step(s)) == [("a", 1)]
    s.finish_request(s.requests["a"], RequestStatus.FINISHED_STOPPED)
    assert plan(step(s)) == [("b", 8)]
    # A preempted request recomputes prompt + outputs in one step: the budget must cover max_model_len.
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        SchedulerConfig(4, 8, 9, enable_chunked_prefill=False)


def test_max_num_seqs():
    s = make(seqs=2)
    for i in range(4):
        s.add_request(req(f"r{i}", [i, i]))
    assert plan(step(s)) == [("r0", 2), ("r1", 2)]
    assert plan(step(s)) == [("r0", 1), ("r1", 1)]
    s.finish_request(s.requests["r0"], RequestStatus.FINISHED_STOPPED)
    assert plan(step(s)) == [("r1", 1), ("r2", 2)]
    assert s.num_running == 2 and s.num_waiting == 1


def test_fifo_head_of_line_blocks_on_blocks():
    s = make(num_blocks=5)                             # 4 usable blocks
    s.add_request(req("a", list(range(8))))            # 2 blocks + room
    s.add_request(req("b", list(range(100, 112))))     # 3 blocks: not now
    s.add_request(req("c", [1]))                       # would fit, but must not overtake b
    assert plan(step(s)) == [("a", 8)]
    assert [r.request_id for r in s.waiting] == ["b", "c"]


def test_fifo_by_arrival_and_duplicate_ids():
    s = make()
    for i in range(3):
        s.add_request(req(f"r{i}", [i]))
    assert [r.request_id for r, _ in step(s).scheduled] == ["r0", "r1", "r2"]
    with pytest.raises(InvalidRequestError, match="request_id"):
        s.add_request(req("r1", [1]))


def test_prefix_hit_at_admission():
    s = make()
    s.add_request(req("a", list(range(9))))
    step(s)
    s.add_request(req("b", list(range(9))))
    out = step(s)
    assert plan(out) == [("a", 1), ("b", 1)]
    assert s.requests["b"].num_cached_tokens == 8


def test_preempt_newest_and_resume_with_prefix_reuse():
    s = make(num_blocks=6, budget=64)                  # 5 usable blocks
    a, b = req("a", list(range(8))), req("b", list(range(100, 107)))
    s.add_request(a)
    s.add_request(b)
    step(s)                                            # a: 2 blocks, b: 2 blocks, 1 free
    out = step(s, token=1)                             # a's 9th token takes the free block
    assert plan(out) == [("a", 1), ("b", 1)] and out.preempted == []
    out = step(s, token=2)                             # b's 9th token finds no block: b, the newest, goes
    assert plan(out) == [("a", 1)] and out.preempted == [b]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(s.waiting) == [b] and b.num_preemptions == 1
    assert b.num_tokens == 9                           # its outputs stay, as prompt for the recompute
    assert s.block_manager.get_num_cached_prefix_tokens(b) == 8
    s.finish_request(a, RequestStatus.FINISHED_STOPPED)
    out = step(s)
    assert out.admitted == [b] and plan(out) == [("b", 1)] and out.samples == [True]
    assert b.num_cached_tokens == 0                    # first-schedule hit, not overwritten on resume
    assert b.num_computed_tokens == 9


def test_request_preempts_itself_when_it_is_the_newest():
    s = make(num_blocks=3)                             # 2 usable blocks
    a = req("a", list(range(8)))
    s.add_request(a)
    step(s)
    out = step(s)                                      # needs a 3rd block: only a itself to give up
    assert out.scheduled == [] and out.preempted == [a]
    assert s.block_manager.num_free_blocks == 2
    out = step(s)                                      # cannot come back: 9 tokens need 3 blocks
    assert out.is_empty and list(s.waiting) == [a]
    assert s.max_blocks_for(a) > s.block_manager.num_total_blocks
    # A prompt that alone fills the cache leaves room for no output token: named as the prompt.
    with pytest.raises(InvalidRequestError, match="prompt_token_ids: prompt has 8 tokens; the KV cache holds at "
                                                  "most 8; allowed: at most 7 prompt tokens"):
        s.check_request(req("x", list(range(8)), max_tokens=1))
    with pytest.raises(InvalidRequestError, match=r"max_tokens: prompt \+ max_tokens = 12 tokens; the KV cache "
                                                  r"holds at most 8; max_tokens allowed: 1\.\.1"):
        s.check_request(req("y", list(range(7)), max_tokens=5))


def test_no_admission_in_a_step_that_preempted():
    s = make(num_blocks=4)                             # 3 usable
    s.add_request(req("a", [1, 2, 3, 4]))
    s.add_request(req("b", [5, 6, 7, 8]))
    step(s)                                            # a and b: 1 block each, 1 free
    s.add_request(req("c", [9]))
    out = step(s)                                      # a takes the free block; b can't, so b goes
    assert plan(out) == [("a", 1)] and [r.request_id for r in out.preempted] == ["b"]
    assert [r.request_id for r in s.waiting] == ["b", "c"]


def test_aborts_waiting_running_preempted_and_unknown():
    s = make(num_blocks=3)
    a, b = req("a", list(range(8))), req("b", [1])
    s.add_request(a)
    s.add_request(b)
    step(s)
    step(s)                                            # a preempts itself; b waits behind it
    assert a.status == RequestStatus.PREEMPTED
    assert s.abort_request("a") is a and a.status == RequestStatus.FINISHED_ABORTED
    assert a.finish_reason == "abort" and a.finish_time is not None
    assert s.abort_request("a") is None and s.abort_request("nope") is None
    out = step(s)
    assert plan(out) == [("b", 1)]
    c = req("c", [3])
    s.add_request(c)
    assert s.abort_request("c") is c                   # waiting
    assert s.abort_request("b") is b                   # running
    assert not s.has_unfinished_requests()
    assert s.block_manager.num_free_blocks == s.block_manager.num_total_blocks
    s.block_manager.check_invariants()


def test_finish_request_frees_and_is_idempotent():
    s = make()
    a = req("a", list(range(6)))
    s.add_request(a)
    step(s)
    s.finish_request(a, RequestStatus.FINISHED_LENGTH)
    assert a.finish_reason == "length" and s.num_running == 0
    s.finish_request(a, RequestStatus.FINISHED_STOPPED)
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert s.block_manager.num_used_blocks == 0
    with pytest.raises(ValueError, match="status"):
        s.finish_request(req("b", [1]), RequestStatus.RUNNING)


def test_async_last_allowed_token_in_flight_is_not_scheduled():
    s = make()
    a = req("a", [1, 2, 3], max_tokens=2)
    s.add_request(a)
    step(s, placeholder=True)                           # output 1 in flight
    out = step(s, placeholder=True)                     # decodes it; output 2 (the last) in flight
    assert plan(out) == [("a", 1)] and a.num_output_tokens == 2
    assert step(s, placeholder=True).is_empty           # nothing more may be planned
    a.resolve_placeholder(3, 11)
    assert step(s).is_empty                             # still the last one in flight


def test_async_max_model_len_in_flight_is_not_scheduled():
    s = make(max_len=5)
    a = req("a", [1, 2, 3, 4], max_tokens=100)
    s.add_request(a)
    step(s, placeholder=True)
    assert a.num_tokens == 5 and step(s, placeholder=True).is_empty


def test_async_decode_input_is_the_placeholder():
    s = make()
    a = req("a", [1, 2, 3])
    s.add_request(a)
    step(s, placeholder=True)
    out = step(s, placeholder=True)
    assert plan(out) == [("a", 1)] and a.num_placeholders == 2
    a.resolve_placeholder(3, 5)
    assert a.num_computed_tokens == 4 and a.token_ids[4] == PLACEHOLDER


def test_preempted_with_token_in_flight_waits_for_it():
    s = make(num_blocks=3)                             # 2 usable blocks
    a = req("a", list(range(7)))
    s.add_request(a)
    step(s, placeholder=True)                          # 7 computed, token 7 in flight (2 blocks)
    step(s, placeholder=True)                          # 8 computed, token 8 in flight
    out = step(s, placeholder=True)                    # needs a 3rd block: preempts itself
    assert out.preempted == [a] and a.num_placeholders == 2
    assert step(s).is_empty                            # its tokens are still unknown
    a.resolve_placeholder(7, 70)                       # the engine reads the steps back
    a.resolve_placeholder(8, 80)
    s.finish_request(a, RequestStatus.FINISHED_STOPPED, stop_reason=80)
    assert a.stop_reason == 80 and s.block_manager.num_used_blocks == 0


def test_preempted_request_with_placeholders_is_not_readmitted():
    s = make(num_blocks=4)                             # 3 usable blocks
    a, b = req("a", [1, 2, 3, 4]), req("b", [5, 6, 7])
    s.add_request(a)
    s.add_request(b)
    step(s, placeholder=True)                          # 1 block each
    step(s, placeholder=True)                          # a takes the last block; b has 2 in flight
    out = step(s, placeholder=True)                    # b's 5th token needs a block: b goes
    assert out.preempted == [b] and b.num_placeholders == 2
    s.abort_request("a")                               # room for b now, but its tokens are unknown
    assert step(s).is_empty
    b.resolve_placeholder(3, 8)
    b.resolve_placeholder(4, 9)
    out = step(s)
    assert out.admitted == [b] and plan(out) == [("b", 5)] and b.num_cached_tokens == 0


def test_preempted_request_resumes_after_resolution():
    s = make(num_blocks=5, budget=64)                  # 4 usable blocks
    a, b = req("a", list(range(8))), req("b", list(range(20, 27)))
    s.add_request(a)
    s.add_request(b)
    step(s, placeholder=True)                          # a: 8 computed + ph, b: 7 computed + ph; 0 free
    out = step(s, placeholder=True)                    # a needs a 3rd block: b is preempted
    assert plan(out) == [("a", 1)] and out.preempted == [b]
    assert b.num_placeholders == 1 and b.token_ids[7] == PLACEHOLDER
    assert step(s, placeholder=True).preempted == []   # b waits for its token's value
    b.resolve_placeholder(7, 1)
    out = step(s, placeholder=True)
    assert b not in [r for r, _ in out.scheduled]      # resolved, but no room (a holds 3 blocks)
    s.finish_request(a, RequestStatus.FINISHED_STOPPED)
    out = step(s)
    assert out.admitted == [b] and plan(out) == [("b", 4)] and out.samples == [True]
    assert b.num_computed_tokens == 8                  # block 0 came from the cache


def test_sample_flags_and_update_after_step():
    s = make(budget=5)
    a = req("a", list(range(12)))
    s.add_request(a)
    out = s.schedule()
    assert out.samples == [False] and out.sampling_requests == []
    s.update_after_step(out.scheduled)
    assert a.num_computed_tokens == 5 and s.block_manager.num_cached_blocks == 1
    out = s.schedule()
    s.update_after_step(out)
    assert a.num_computed_tokens == 10 and s.block_manager.num_cached_blocks == 2
    out = s.schedule()
    assert plan(out) == [("a", 2)] and out.samples == [True]
    assert isinstance(out, SchedulerOutput)


def test_fits_in_cache_and_max_blocks():
    s = make(num_blocks=5, max_len=100)                # 4 usable blocks: 16 tokens
    assert s.fits_in_cache(16) and not s.fits_in_cache(17)
    assert s.max_blocks_for(req("a", [1] * 10, max_tokens=3)) == 4
    assert s.max_blocks_for(req("a", [1] * 10, max_tokens=300)) == 25   # capped by max_model_len
    s.check_request(req("ok", [1] * 10, max_tokens=6))
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        s.check_request(req("empty", []))
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        s.check_request(req("long", [1] * 101))
