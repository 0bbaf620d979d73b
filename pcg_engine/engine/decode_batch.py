"""The scheduler's decode fast path: its plan over the rows, its batch, and its publishing.

While every running request is bound to a row (row_state.py) and decoding, the scheduler plans a
step with numpy over the rows (`plan_decodes`): which rows have their last token in flight, which
cross a block boundary (only those grow, one block manager call for all), and after the launch
(Scheduler.update_after_step) the computed counts are set and the blocks that filled published in
one call (`publish_decoded`, bulk_publish.py).

The running list, the rows and their owners change only when a request joins, finishes or is
preempted; in between, each decode step finds the same rows in the same order. A DecodeBatch holds
what those steps share, so that a step neither rebuilds it nor gathers it from the rows again:

  * the rows array, a copy of the running list, its request ids, and the plan list itself (one
    ScheduledBatch of (request, 1) entries, handed out by every step with that step's fields set);
  * the rows' epochs (RowState.epoch changes only when a row changes hands, which makes a new
    batch), read when a step is resolved after a row was released;
  * the smallest length limit of the rows (RowState.last_index, set at binding): while the longest
    row is below it, no row can reach its limit, and the plan does not look row by row (it says
    whether some row does, for the booking);
  * the rows' booking flags summed up (does any row need the per-request path, do all or none
    stream outputs), recomputed when RowState.flags_version moves.

It is made again whenever its key (the scheduler's running version, the RowState and its version)
changes. The plan list is shared between steps, so whoever adds to a plan copies it first (the
scheduler's admissions do).
"""

import weakref
from itertools import compress, repeat

import numpy as np


class ScheduledBatch(list):
    """[(request, new tokens)] in batch order; from the decode fast path also numpy `rows` and
    `num_new` per entry and the `requests` (all of which sample), each row's sequence length after
    the step (`seq_lens`: set only for an all-decode step) and their maximum (`max_seq_len`),
    whether the token sampled now is some row's last allowed one (`at_limit`), the entries whose
    block table grew this step (`grown`) and, when each grew by one block, those blocks
    (`new_blocks`), and the DecodeBatch it is the plan list of (`batch_ref`, a weak reference:
    `batch`). None where not known (`batch` also once that DecodeBatch is gone).

    Why weak: the DecodeBatch holds its plan list, so a strong reference back would make every
    batch a reference cycle, and every request it held would then wait for the cycle collector
    instead of going when it finished: a batch is replaced whenever a request joins or leaves, and
    on the CPU dev machine those cycles made most finished requests (with their token lists and
    sampling parameters) pile up into the collector's oldest generation (scripts/gc_pauses.py)."""

    rows = num_new = requests = seq_lens = max_seq_len = at_limit = grown = new_blocks = batch_ref = None

    @property
    def batch(self):
        return None if self.batch_ref is None else self.batch_ref()


class DecodeBatch:
    def __init__(self, key, state, running: list, rows: np.ndarray | None):
        self.key = key
        self.rows = rows                              # None: some running request holds no row
        self.size = len(running)
        if rows is None:
            return
        rows.flags.writeable = False
        self.requests = list(running)
        self.rids = [r.request_id for r in running]
        self.epoch = state.epoch[rows]
        self.last_min = int(state.last_index[rows].min()) if len(rows) else 0
        self.samples = [True] * len(rows)
        self.scheduled = s = ScheduledBatch(zip(self.requests, repeat(1)))
        s.rows, s.requests, s.batch_ref = rows, self.requests, weakref.ref(self)
        s.num_new = np.ones(len(rows), dtype=np.int64)
        s.num_new.flags.writeable = False
        self._flags_version = -1
        self._flags = None

    @classmethod
    def of(cls, key, state, running: list) -> "DecodeBatch":
        rows = np.fromiter([r._row for r in running], np.int64, len(running))
        return cls(key, state, running, rows if len(rows) and rows.min() >= 0 else None)

    def plan(self, seq_lens: np.ndarray, max_seq_len: int, at_limit: bool, grown: np.ndarray,
             new_blocks) -> ScheduledBatch:
        """The shared plan list with this step's fields (every row, one token each)."""
        s = self.scheduled
        s.seq_lens, s.max_seq_len, s.at_limit = seq_lens, max_seq_len, at_limit
        s.grown, s.new_blocks = grown, new_blocks
        return s

    def flags(self, state) -> tuple[bool, bool, bool]:
        """(a row needs the per-request path, every row streams outputs, no row does), as of now."""
        if self._flags_version != state.flags_version:
            rows = self.rows
            stream = state.stream[rows]
            self._flags = (bool(state.needs_host[rows].any()), bool(stream.all()), not stream.any())
            self._flags_version = state.flags_version
        return self._flags


def plan_decodes(sched, out, budget: int) -> int | None:
    """Scheduler.schedule's running part when every running request is bound to a row and decoding:
    sets out.scheduled / samples / num_batched_tokens and returns the budget left, or None, having
    changed nothing, when the scheduler's general loop must plan the running requests."""
    running = sched.running
    state = running[0]._rows
    if state is None:
        return None
    batch, key = sched._decode_batch, (sched._running_version, state, state.version)
    if batch is None or batch.key != key or batch.size != len(running):
        batch = sched._decode_batch = DecodeBatch.of(key, state, running)
    rows = batch.rows
    if rows is None:
        return None                                  # not every running request holds a row
    num_tokens = state.num_tokens[rows]
    # (Tests of a whole array by count_nonzero, a C function, here and below: .all() / .any() /
    # .min() go through a Python-level wrapper and the ufunc reduction, ~2 us more on the dev VM.)
    if np.count_nonzero(num_tokens - state.num_computed[rows] != 1):
        return None                                  # a prefill chunk (or nothing to compute)
    top = int(num_tokens.max())
    requests, rids = batch.requests, batch.rids
    at_limit = False                                 # a row's token sampled now reaches its last index
    if top >= batch.last_min:                        # some row may have: look row by row
        last = state.last_index[rows]
        at_limit = np.count_nonzero(num_tokens >= last) > 0
        over = num_tokens > last if at_limit else None
        if at_limit and np.count_nonzero(over):
            # Rows whose last allowed token is in flight: nothing to compute.
            take = ~(over & (state.num_placeholders[rows] > 0))
            requests = list(compress(requests, take.tolist()))
            rids = list(compress(rids, take.tolist()))
            rows, num_tokens, batch = rows[take], num_tokens[take], None
    count = len(requests)
    if count > budget or not count:
        return None
    blocks = sched.block_manager
    bs = blocks.block_size
    table_len = state.table_len[rows]
    # One token each: a row whose token does not fit its table needs exactly one more block (its
    # table holds its computed tokens, num_tokens - 1 of them).
    grow = (num_tokens > table_len * bs).nonzero()[0]
    new_blocks = None
    if len(grow):
        if len(grow) > blocks.num_free_blocks:
            return None                              # someone must be preempted
        # In running order, as the general loop would allocate them.
        new_blocks = blocks.grow_one_each(list(map(rids.__getitem__, grow.tolist())))
        state.table_len[rows[grow]] = table_len[grow] + 1
    if batch is not None:
        out.scheduled = batch.plan(num_tokens, top, at_limit, grow, new_blocks)
        out.samples = batch.samples
    else:
        scheduled = out.scheduled = ScheduledBatch(zip(requests, repeat(1)))
        scheduled.rows, scheduled.requests = rows, requests
        scheduled.num_new = np.ones(count, dtype=np.int64)
        scheduled.seq_lens, scheduled.grown, scheduled.new_blocks = num_tokens, grow, new_blocks
        out.samples = [True] * count
    out.num_batched_tokens = count
    return budget - count


def publish_decoded(blocks, scheduled, state, after: np.ndarray) -> None:
    """Publish the blocks an all-decode step filled: its rows whose token count (= computed
    count after the step, `after`) reached a block's end, one block each."""
    bs, rows = blocks.block_size, scheduled.rows
    filled = (after % bs == 0).nonzero()[0]
    if not len(filled):
        return
    # A block ending in a placeholder (async: the token in flight) is left for when that token is
    # resolved (placeholders trail, so no earlier block waits): publish_rows skips it.
    blocks.cache_full_blocks_rows(list(map(scheduled.requests.__getitem__, filled.tolist())), state.token_ids,
                                  rows[filled], after[filled] // bs)
