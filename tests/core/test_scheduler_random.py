"""Random add/step/abort/finish sequences against a simulated engine, sync and async.

The simulation keeps a fake KV cache: a slot holds the token prefix that produced it (the real KV of
a position depends on every token up to it). Before a step runs, every computed position of every
scheduled request must hold exactly its own prefix, whether its block came from the prefix cache or
from the request's own earlier steps: that catches wrong hits, blocks shared while written, and
blocks reused while still held.
"""

import random
from types import SimpleNamespace

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pcg_engine.engine.block_manager import BlockManager
from pcg_engine.engine.request import PLACEHOLDER, Request, RequestStatus
from pcg_engine.engine.scheduler import Scheduler, SchedulerConfig
from pcg_engine.errors import InvalidRequestError

PREFIXES = [[], [1, 2, 3, 1], [1, 2, 3, 1, 2, 2, 0, 1], [3, 3]]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(3, 14),
                seqs=st.integers(1, 4), budget=st.integers(1, 16), max_len=st.integers(4, 32),
                chunked=st.booleans(), caching=st.booleans(), async_=st.booleans())
    def setup(self, block_size, num_blocks, seqs, budget, max_len, chunked, caching, async_):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        if not chunked:
            budget = max(budget, max_len)      # the config refuses less
        self.cfg = SchedulerConfig(seqs, budget, max_len, chunked)
        self.sched = Scheduler(self.cfg, self.bm)
        self.async_ = async_
        self.kv = {}            # slot -> tuple of the tokens that produced it
        self.pending = {}       # (request_id, index) -> value of a placeholder, known "on the device"
        self.inflight = []      # (request, index, token) sampled by the last launched step
        self.count = 0

    # Engine simulation ---------------------------------------------------------------------------

    def true_prefix(self, r, end):
        out = []
        for i, t in enumerate(r.token_ids[:end]):
            if t == PLACEHOLDER:
                t = self.pending[(r.request_id, i)]
            out.append(t)
        return tuple(out)

    def check_stop(self, r, index, token):
        outputs = index + 1 - r.num_prompt_tokens
        if token == r.eos_token_id:
            status = RequestStatus.FINISHED_STOPPED
        elif outputs >= r.max_tokens or index + 1 >= self.cfg.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        else:
            return False
        r.truncate(index + 1)      # async: the speculative placeholder after the stop
        self.sched.finish_request(r, status, token if status == RequestStatus.FINISHED_STOPPED else None)
        return True

    def verify_plan(self, out):
        cfg, bm = self.cfg, self.bm
        ids = [r.request_id for r, _ in out.scheduled]
        assert len(ids) == len(set(ids)) <= cfg.max_num_seqs
        assert out.num_batched_tokens == sum(n for _, n in out.scheduled) <= cfg.max_num_batched_tokens
        assert len(self.sched.running) <= cfg.max_num_seqs
        assert not (out.preempted and out.admitted)
        for (r, n), samples in zip(out.scheduled, out.samples):
            c = r.num_computed_tokens
            assert r.status == RequestStatus.RUNNING and n >= 1
            assert c + n <= r.num_tokens and c + n <= cfg.max_model_len
            assert samples == (c + n == r.num_tokens)
            if samples:       # never plan past max_tokens: the last allowed token must not be in flight
                assert r.num_output_tokens < r.max_tokens
            if not cfg.enable_chunked_prefill:
                assert c + n == r.num_tokens
            assert PLACEHOLDER not in r.token_ids[c + 1:c + n], "placeholder inside a chunk"
            assert len(bm.block_table(r.request_id)) * bm.block_size >= c + n
            for p in range(c):
                assert self.kv.get(bm.slot(r.request_id, p)) == self.true_prefix(r, p + 1), \
                    f"{r.request_id}: wrong KV at {p}"
        for r in out.preempted:
            assert r.status == RequestStatus.PREEMPTED and not bm.block_table(r.request_id)

    def launch(self, out):
        bm = self.bm
        for r, n in out.scheduled:
            c = r.num_computed_tokens
            for p in range(c, c + n):
                block = bm.blocks[bm.block_table(r.request_id)[p // bm.block_size]]
                assert block.ref_count == 1 and block.hash is None, "write into a shared/published block"
                self.kv[bm.slot(r.request_id, p)] = self.true_prefix(r, p + 1)

    def resolve(self, inflight):
        for r, index, token in inflight:
            if r.is_finished:
                continue
            r.resolve_placeholder(index, token)
            if not self.check_stop(r, index, token):
                self.bm.cache_full_blocks(r)

    def do_step(self, rng):
        running, waiting = list(self.sched.running), list(self.sched.waiting)
        out = self.sched.schedule()
        self.verify_plan(out)
        k = len(out.preempted)                 # victims: the newest running requests, newest first
        assert out.preempted == running[::-1][:k]
        assert out.admitted == waiting[:len(out.admitted)], "admission must follow the queue (FIFO)"
        self.launch(out)
        sampling = out.sampling_requests
        self.sched.update_after_step(out)
        launched = []
        for r in sampling:
            token = rng.randrange(4)
            if self.async_:
                r.append_output(PLACEHOLDER)
                self.pending[(r.request_id, r.num_tokens - 1)] = token
                launched.append((r, r.num_tokens - 1, token))
            else:
                r.append_output(token)
                self.check_stop(r, r.num_tokens - 1, token)
        self.resolve(self.inflight)
        self.inflight = launched
        return out

    # Rules ---------------------------------------------------------------------------------------

    @rule(prompts=st.lists(st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(0, 3), max_size=6),
                                     st.integers(1, 10), st.sampled_from([None, 0])), min_size=1, max_size=3))
    def add(self, prompts):
        for prefix, tail, max_tokens, eos in prompts:
            self.count += 1
            r = Request(f"r{self.count}", prefix + tail, SimpleNamespace(max_tokens=max_tokens),
                        eos_token_id=eos)
            try:
                self.sched.check_request(r)    # what the engine does before adding
            except InvalidRequestError:
                continue
            self.sched.add_request(r)

    @rule(seed=st.integers(0, 2**16), steps=st.integers(1, 4))
    def step(self, seed, steps):
        rng = random.Random(seed)
        for _ in range(steps):
            self.do_step(rng)

    @rule(pick=st.integers(0, 100), how=st.sampled_from(["abort", "fail", "unknown"]))
    def kill(self, pick, how):
        """A user abort (of any unfinished request) or an engine error (of a running one)."""
        if how == "unknown" or not self.sched.requests:
            assert self.sched.abort_request("no-such-request") is None
        elif how == "abort":
            ids = sorted(self.sched.requests)
            r = self.sched.abort_request(ids[pick % len(ids)])
            assert r.status == RequestStatus.FINISHED_ABORTED and not self.bm.block_table(r.request_id)
        elif self.sched.running:
            r = self.sched.running[pick % len(self.sched.running)]
            self.sched.finish_request(r, RequestStatus.FINISHED_ERROR)
            assert r.finish_reason == "error"

    # Checks --------------------------------------------------------------------------------------

    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants()
        s = self.sched
        assert len(s.requests) == len(s.waiting) + len(s.running)
        for r in s.running:
            assert r.status == RequestStatus.RUNNING and s.requests[r.request_id] is r
        for r in s.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert s.requests[r.request_id] is r and not self.bm.block_table(r.request_id)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        rng = random.Random(0)
        # Everything admitted must run to its end. The bound scales with the work left: with a
        # budget of one token per step, each remaining token may cost a step (plus recomputes).
        work = sum(r.max_total_tokens() for r in self.sched.requests.values())
        for _ in range(100 + 4 * work):
            if not self.sched.has_unfinished_requests():
                break
            self.do_step(rng)
            self.consistent()
        assert not self.sched.has_unfinished_requests(), "scheduler stopped making progress"
        self.resolve(self.inflight)
        assert self.bm.num_free_blocks == self.bm.num_total_blocks
        assert not self.bm._tables
        self.bm.check_invariants()


SchedulerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestScheduler = SchedulerMachine.TestCase
