"""Continuous batching: which requests run this step, and how many tokens each, under a token budget.

Each step serves the running requests first, oldest first (decodes take 1 token, an unfinished
prefill takes what the budget leaves), then admits waiting requests in FIFO order. When a running
request needs a block and none is free, the newest running request is preempted by recompute: its
blocks are freed and it returns to the front of the queue with its tokens kept, so everything it
produced becomes prompt for its recompute, most of it found again in the prefix cache.

Async scheduling (DESIGN.md): the engine appends a PLACEHOLDER for every token it samples and
advances num_computed_tokens at launch (update_after_step). So:
  * a running request whose last allowed token is in flight is not scheduled again;
  * a preempted request keeps its placeholders; the engine resolves them when their step is read
    back (the request is PREEMPTED, not finished, so the token is kept). Until then it is not
    readmitted: its recompute needs every token's value on the host. The queue waits behind it,
    which costs at most one step because a step's tokens are read back before the next plan.

Decode fast path (decode_batch.py): when every running request is bound to a row (row_state.py)
and is decoding, the running part of the plan is made with numpy over the rows: which rows have
their last token in flight, which cross a block boundary (only those are allocated a block, one
call each), and the plan is handed on as a ScheduledBatch that carries the rows, so neither the
input batch nor update_after_step walks the requests. Anything else (a prefill chunk, a block
shortage that needs a preemption, a full token budget) takes the general loop, which makes the
same plan.
"""

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pcg_engine.engine.block_manager import BlockManager
from pcg_engine.engine.decode_batch import DecodeBatch, ScheduledBatch, plan_decodes, publish_decoded
from pcg_engine.engine.request import PLACEHOLDER, Request, RequestStatus
from pcg_engine.errors import ConfigError, InvalidRequestError


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
        # Without chunking a sequence (a preempted one holds prompt + outputs) must fit in one step.
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError("max_num_batched_tokens", f"without chunked prefill must be >= max_model_len "
                              f"({self.max_model_len}), got {self.max_num_batched_tokens}")


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=ScheduledBatch)   # (request, new tokens), batch order
    samples: list[bool] = field(default_factory=list)      # per entry: the chunk ends at the last known token
    preempted: list[Request] = field(default_factory=list)  # lost their blocks (and batch rows) this step
    admitted: list[Request] = field(default_factory=list)   # moved from the queue to running this step
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def sampling_requests(self) -> list[Request]:
        return [r for (r, _), s in zip(self.scheduled, self.samples) if s]


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()    # WAITING and PREEMPTED, in admission order
        self.running: list[Request] = []          # oldest admitted first
        self.requests: dict[str, Request] = {}    # every unfinished request
        # The decode fast path's rows of `running` (decode_batch.py), valid while neither `running`
        # nor any row's owner changed: made again when (running version, RowState, its version) moves.
        self._running_version = 0
        self._decode_batch: DecodeBatch | None = None

    # Queue ---------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")
        if request.status != RequestStatus.WAITING:
            raise ValueError(f"{request.request_id!r}: only a new (WAITING) request can be added")
        # The last index a token of this request may take: past it, nothing is ever scheduled.
        request.last_index = min(len(request.prompt_token_ids) + request.sampling_params.max_tokens,
                                 self.config.max_model_len) - 1
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request: Request, status: RequestStatus, stop_reason=None) -> None:
        """Take a request out (waiting, running or preempted) and free its blocks. Idempotent."""
        if not status.is_finished:
            raise ValueError(f"status: must be a FINISHED_* status, got {status.name}")
        if request.is_finished:
            return
        if self.requests.get(request.request_id) is request:    # tolerate a request never added
            del self.requests[request.request_id]
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                self._running_version += 1
            else:
                self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = status
        request.finish_reason = status.finish_reason
        request.stop_reason = stop_reason
        request.finish_time = time.monotonic()

    def abort_request(self, request_id: str) -> Request | None:
        """Abort an unfinished request; None when no unfinished request has this id."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # Admission checks (for the engine, before add_request) ---------------------------------------

    def max_blocks_for(self, request: Request) -> int:
        """Blocks the request can need at its longest."""
        return self.block_manager.cdiv_blocks(request.max_total_tokens(self.config.max_model_len))

    def fits_in_cache(self, num_tokens: int) -> bool:
        return self.block_manager.cdiv_blocks(num_tokens) <= self.block_manager.num_total_blocks

    def check_request(self, request: Request) -> None:
        """Raise InvalidRequestError for a request that could never run to its end."""
        cfg, n = self.config, request.num_prompt_tokens
        if n == 0:
            raise InvalidRequestError("prompt_token_ids", "must hold at least 1 token")
        if n > cfg.max_model_len:
            raise InvalidRequestError("prompt_token_ids", f"{n} tokens; max_model_len allows 1..{cfg.max_model_len}")
        total = request.max_total_tokens(cfg.max_model_len)
        if not self.fits_in_cache(total):
            most = self.block_manager.num_total_blocks * self.block_manager.block_size
            # (getattr: the scheduler asks only max_tokens of its requests' parameters elsewhere)
            truncate = getattr(request.sampling_params, "truncate_prompt_tokens", None)
            if n >= most and truncate is not None:
                # Cut to truncate_prompt_tokens and still too long: name the setting that kept them.
                raise InvalidRequestError("truncate_prompt_tokens", f"{truncate} keeps {n} prompt tokens; the KV "
                                          f"cache holds at most {most}; allowed: 1..{most - 1}")
            if n >= most:     # the prompt alone: no max_tokens would fit
                raise InvalidRequestError("prompt_token_ids", f"prompt has {n} tokens; the KV cache holds at most "
                                          f"{most}; allowed: at most {most - 1} prompt tokens")
            raise InvalidRequestError("max_tokens", f"prompt + max_tokens = {total} tokens; the KV cache holds at "
                                      f"most {most}; max_tokens allowed: 1..{most - n}")

    # Planning ------------------------------------------------------------------------------------

    # The three helpers below run for every running request every step: they read token_ids
    # directly rather than through Request's size properties.

    def _last_token_in_flight(self, request: Request) -> bool:
        return bool(request.num_placeholders) and request.num_tokens > request.last_index

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        remaining = request.num_tokens - num_computed
        if remaining <= budget:
            return max(remaining, 0)
        return budget if self.config.enable_chunked_prefill else 0

    def _schedule_one(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        out.scheduled.append((request, num_new))
        out.samples.append(request.num_computed_tokens + num_new == request.num_tokens)
        out.num_batched_tokens += num_new

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._running_version += 1
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.appendleft(request)   # victims go newest first, so the oldest ends up in front

    def schedule(self) -> SchedulerOutput:
        cfg, blocks = self.config, self.block_manager
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens

        i = 0
        block_table, bs = blocks.block_table, blocks.block_size
        running = self.running
        if running:
            left = plan_decodes(self, out, budget)
            if left is not None:
                budget, i = left, len(running)
        while i < len(running) and budget > 0:
            request = running[i]
            computed = request.num_computed_tokens
            # A decode (one token to compute) whose last block has room: the common case at large
            # batch, handled inline without the helpers' calls. With async scheduling its one
            # token is usually the placeholder of the step in flight.
            n = request.num_tokens
            if n == computed + 1 and n <= len(block_table(request.request_id)) * bs:
                if request.num_placeholders and n > request.last_index:
                    i += 1               # its last allowed token is in flight: nothing to compute
                    continue
                out.scheduled.append((request, 1))
                out.samples.append(True)
                out.num_batched_tokens += 1
                budget -= 1
                i += 1
                continue
            num_new = self._num_new_tokens(request, computed, budget)
            if num_new == 0 or self._last_token_in_flight(request):
                i += 1
                continue
            while not blocks.allocate(request, num_new):
                victim = self.running[-1]     # newest; never one already scheduled (those are before i)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                self._schedule_one(out, request, num_new)
                budget -= num_new
                i += 1

        # After a preemption the cache is full: admitting now would only evict what was just freed.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            request = self.waiting[0]
            if request.num_placeholders:
                break                          # preempted with a token in flight: wait for its value
            cached = blocks.get_num_cached_prefix_tokens(request)
            num_new = self._num_new_tokens(request, cached, budget)
            if num_new == 0 or not blocks.allocate(request, num_new):
                break                          # FIFO: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.running.append(request)
            self._running_version += 1
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            out.admitted.append(request)
            if out.scheduled.rows is not None:
                # The fast path's plan (perhaps its batch's shared list) no longer covers the
                # batch: a plain copy without the arrays.
                out.scheduled, out.samples = ScheduledBatch(out.scheduled), list(out.samples)
            self._schedule_one(out, request, num_new)
            budget -= num_new
        return out

    def update_after_step(self, scheduled) -> None:
        """After launching a step: advance num_computed_tokens and publish newly full blocks.

        Takes a SchedulerOutput or its `scheduled` list. Call it before appending this step's
        tokens or placeholders (either order is safe: publishing stops at uncomputed tokens).
        """
        if isinstance(scheduled, SchedulerOutput):
            scheduled = scheduled.scheduled
        cache_full_blocks, bs = self.block_manager.cache_full_blocks, self.block_manager.block_size
        rows = getattr(scheduled, "rows", None)
        if rows is not None:                   # the decode fast path: all bound to one RowState
            state = scheduled.requests[0]._rows if len(rows) else None
            if state is None:
                return
            after = scheduled.seq_lens         # all-decode: each row computes up to its last token
            if after is None:
                before = state.num_computed[rows]
                after = before + scheduled.num_new
                filled = np.flatnonzero(before // bs != after // bs)
            else:
                state.num_computed[rows] = after
                if self.block_manager.enable_prefix_caching:
                    publish_decoded(self.block_manager, scheduled, state, after)
                return
            state.num_computed[rows] = after
            if self.block_manager.enable_prefix_caching and len(filled):
                # A block ending in a placeholder is published when that token is resolved
                # (and, placeholders trailing, no earlier block waits): skip the call.
                at = rows[filled]
                end = after[filled]
                keep = state.token_ids[at, end - 1] != PLACEHOLDER
                if not keep.all():
                    filled, at, end = filled[keep], at[keep], end[keep]
                if len(filled):
                    # One batched call: tokens straight from the rows, not per request.
                    self.block_manager.cache_full_blocks_rows(
                        list(map(scheduled.requests.__getitem__, filled.tolist())), state.token_ids, at,
                        np.minimum(end, state.num_tokens[at]) // bs)
            return
        for request, num_new in scheduled:
            before = request.num_computed_tokens
            request.num_computed_tokens = after = before + num_new
            # Only a step that fills a block can publish one here (a block held back by a
            # placeholder is published when the placeholder is resolved: LLMEngine._resolve).
            if before // bs != after // bs:
                cache_full_blocks(request)
