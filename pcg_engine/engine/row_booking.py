"""Booking a step's sampled tokens for requests bound to rows: every row at once, events one by one.

At launch each sampling row gets a PLACEHOLDER at the end of its row (RowState.append_placeholders);
when the step's tokens are read back, `resolve_rows` writes them over the placeholders of every row
with a few numpy operations and makes the outputs of the rows with nothing to report but their
token. (Sync scheduling reads a step back before anything else happens: it appends no placeholder,
and the tokens are appended at the rows' ends.)
A row takes the engine's per-request path (LLMEngine._book_tail: text, stop checks, finishing) only
when it has an *event*: a possible stop token, its length limit, text or logprobs to produce, its
first token (RowState.needs_host), or a row released since launch (finished, aborted, preempted).

The common step, no row changed hands since launch (RowState.version unchanged), skips the
staleness checks: every token read back then lands on its own placeholder. Stop tokens are screened
by one lookup in RowState.stop_any (any row's stop tokens) and checked exactly only when one shows up.
A step planned by the scheduler's decode fast path carries its DecodeBatch (decode_batch.py), which
knows without looking row by row whether any row needs the host path, reached its length limit
(the plan says) or streams outputs: then the step is booked by `_resolve_quiet`, a handful of numpy
operations for every row and no per-row test.
"""

import time
from dataclasses import dataclass, field

import numpy as np

from pcg_engine.engine.request import PLACEHOLDER
from pcg_engine.outputs import DecodeOutput


@dataclass
class Inflight:
    """A launched step whose sampled tokens are still on the device."""

    sampled: object                                   # SamplerOutput, on the device
    pending: object                                   # PendingTokens: its copy to the host (readback.py)
    slots: list = field(default_factory=list)         # (request, index in token_ids) per sampled row
    # Instead of slots, when the requests are bound to rows: the requests in sampled order, and
    # per request its row, its placeholder's index and the row's epoch at launch.
    requests: list | None = None
    state: object = None                              # their RowState
    rows: np.ndarray | None = None
    index: np.ndarray | None = None
    epoch: np.ndarray | None = None
    version: int = -1                                 # RowState.version at launch
    batch: object = None                              # the DecodeBatch of an all-decode fast-path step
    at_limit: bool = True                             # then: some row samples its last allowed token
    appended: bool = True                             # placeholders at `index` (else the rows end there)


def launch_rows(state, scheduled, inputs, sampled, pending, placeholders: bool = True) -> Inflight:
    """The launch half of the booking: a placeholder at the end of each sampling row, where its
    token will go. Without placeholders (sync scheduling, whose step is read back before anything
    else happens) the rows are left as they are and the tokens are appended when read back."""
    rows = inputs.sample_row_ids
    batch = getattr(scheduled, "batch", None)
    if batch is not None:     # every row of the batch samples; its token counts are the plan's
        index = scheduled.seq_lens
        if placeholders:
            state.append_placeholders(rows, index)
        return Inflight(sampled, pending, requests=batch.requests, state=state, rows=rows, index=index,
                        epoch=batch.epoch, version=state.version, batch=batch, at_limit=scheduled.at_limit,
                        appended=placeholders)
    index = state.append_placeholders(rows) if placeholders else state.num_tokens[rows]
    return Inflight(sampled, pending, requests=inputs.sample_rows, state=state, rows=rows, index=index,
                    epoch=state.epoch[rows], version=state.version, appended=placeholders)


def resolve_rows(engine, inflight, values: np.ndarray) -> list:
    """LLMEngine._resolve for an Inflight of bound rows; returns the step's outputs in sampled order."""
    state, rows, index, requests = inflight.state, inflight.rows, inflight.index, inflight.requests
    if inflight.batch is not None and state.version == inflight.version:
        outputs = _resolve_quiet(engine, inflight, values)
        if outputs is not None:
            return outputs
    appended = inflight.appended
    if state.version == inflight.version:
        live = ok = None                              # every row still holds its request
        _book(state, rows, index, values, appended)
        generated = len(rows)
        event = state.needs_host[rows] | (index >= state.last_index[rows])
    else:
        live = state.epoch[rows] == inflight.epoch    # else released since launch
        if appended:
            ok = live & (state.token_ids[rows, index] == PLACEHOLDER) & (index < state.num_tokens[rows])
        else:
            ok = live & (index == state.num_tokens[rows])
        _book(state, rows[ok], index[ok], values[ok], appended)
        generated = int(np.count_nonzero(ok))
        event = ok & (state.needs_host[rows] | (index >= state.last_index[rows]))
    if np.count_nonzero(state.stop_any.take(values, mode="clip")):
        event |= state.stop_hit(rows, values) if ok is None else ok & state.stop_hit(rows, values)
    any_event = np.count_nonzero(event) > 0
    quiet = ~event if ok is None else ok & ~event
    if engine.async_scheduling and engine.block_manager.enable_prefix_caching:
        _publish_unheld(engine.block_manager, state, rows, index, requests, quiet)
    # A quiet row's later tokens are all placeholders: its output ends at the token just resolved.
    stream = quiet & state.stream[rows]
    if not any_event and live is None and stream.all():
        outputs = list(map(DecodeOutput, zip(requests, (index + 1).tolist(), values.tolist())))
    else:
        stream = np.flatnonzero(stream)
        outputs = list(map(DecodeOutput, zip(map(requests.__getitem__, stream.tolist()), (index[stream] + 1).tolist(),
                                             values[stream].tolist())))
    slow = event.nonzero()[0] if live is None else (event | ~live).nonzero()[0]
    if not len(slow):
        engine.stats.generated_tokens += generated
        return outputs
    if any_event:
        state.first_tokens_seen(rows[event])
    lps = engine._logprob_lists(inflight.pending)
    now = time.monotonic()
    booked = []
    all_live = live is None
    for i, is_live, idx, token in zip(slow.tolist(), live[slow].tolist() if not all_live else [True] * len(slow),
                                      index[slow].tolist(), values[slow].tolist()):
        request = requests[i]
        if not is_live:        # preempted (unbound now, resolved in its list) or finished: dropped
            tokens = request.token_ids
            if request.is_finished:
                continue
            if not appended:
                if idx != len(tokens):
                    continue
                request.append_output(token)
            elif idx >= len(tokens) or tokens[idx] != PLACEHOLDER:
                continue
            else:
                request.resolve_placeholder(idx, token)
            generated += 1
        if request.first_token_time is None:
            request.first_token_time = now
        rid = request.request_id
        if lps is not None and rid in engine.logprobs:
            engine.logprobs[rid].append(lps(i, token, request.sampling_params.logprobs))
        output = engine._book_tail(request, idx, token, engine.detokenizers.get(rid))
        if output is not None:
            booked.append((i, output))
    engine.stats.generated_tokens += generated
    if booked:             # outputs in sampled order, as the per-request path gives them
        order = np.flatnonzero(stream) if stream.dtype == bool else stream
        merged = sorted([*zip(order.tolist(), outputs), *booked], key=lambda pair: pair[0])
        outputs = [o for _, o in merged]
    return outputs


def _resolve_quiet(engine, inflight, values: np.ndarray) -> list | None:
    """The common decode step of a fast-path batch (decode_batch.py) whose rows all still hold
    their requests: when no row needs the per-request path, none reached its length limit (the
    plan says so) and no sampled token is a stop token of any row, the tokens are booked for every
    row and every row's output is made (or none, when no row
    streams). None, having changed nothing, otherwise: resolve_rows' general path books the step."""
    state, batch = inflight.state, inflight.batch
    needs_host, stream_all, stream_none = batch.flags(state)
    if needs_host or inflight.at_limit or not (stream_all or stream_none):
        return None
    if np.count_nonzero(state.stop_any.take(values, mode="clip")):
        return None
    rows, index = inflight.rows, inflight.index
    _book(state, rows, index, values, inflight.appended)
    if engine.async_scheduling and engine.block_manager.enable_prefix_caching:
        _publish_unheld(engine.block_manager, state, rows, index, inflight.requests, None)
    engine.stats.generated_tokens += len(rows)
    if stream_none:
        return []
    return list(map(DecodeOutput, zip(inflight.requests, (index + 1).tolist(), values.tolist())))


def _book(state, rows, index, values, appended: bool) -> None:
    """The tokens into the rows: over their placeholders, or appended at the rows' ends."""
    state.token_ids[rows, index] = values
    if appended:
        state.num_placeholders[rows] -= 1
    else:
        state.num_tokens[rows] = index + 1


def _publish_unheld(blocks, state, rows, index, requests, quiet) -> None:
    """Async scheduling: a block that a placeholder kept out of the prefix cache may be publishable
    now that its tokens are resolved (quiet rows only; None: every row). Never with sync
    scheduling: a step's placeholder then sits at its row's computed count."""
    bs = blocks.block_size
    computed = state.num_computed[rows]
    ready = index // bs < computed // bs
    publish = np.flatnonzero(ready if quiet is None else quiet & ready)
    if len(publish):
        at = rows[publish]
        blocks.cache_full_blocks_rows(list(map(requests.__getitem__, publish.tolist())), state.token_ids, at,
                                      np.minimum(computed[publish], state.num_tokens[at]) // bs)
