"""The persistent input batch: per-request state in fixed rows, and the step's flat batch built from them.

A request gets one row for its lifetime (preemption and finishing release it). The row holds its
token ids and counts (row_state.py: the request is bound to the row, so they are written there
directly) and its block table on the host; a step writes only what changed (appended blocks) and
builds the flat batch with vectorised numpy gathers over the scheduled rows, no Python loop over
tokens, and none over requests when the scheduler hands over the rows (ScheduledBatch). The result
goes to the device in one copy (step_buffers.py) into static buffers whose addresses never change.

An all-decode step from the scheduler's fast path (ScheduledBatch.seq_lens set: one token per row,
every row samples) takes a shorter path: positions are the sequence lengths less one, the query
starts and logits rows are constants kept in the staging, and the device block table is not sent
again while the batch keeps its rows in the same order: only the blocks appended since the last
step are written, by one scatter on the device (device_block_table.py).
Anything that writes the static buffers outside prepare (warm-up, graph capture) must call
`invalidate()` unless the rows change hands before the next step.
"""

from dataclasses import dataclass

import numpy as np
import torch

from pcg_engine.attention.metadata import AttentionMetadata
from pcg_engine.engine.request import PLACEHOLDER
from pcg_engine.engine.row_state import RowState
from pcg_engine.engine.device_block_table import DeviceBlockTable
from pcg_engine.engine.step_buffers import StepBuffers


@dataclass
class StepInputs:
    """One step's flat batch, as views of the static buffers, padded to num_tokens / num_reqs."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor      # flat rows whose hidden state samples (one per sampling request)
    num_real_tokens: int
    num_real_reqs: int
    sample_rows: list                 # requests that sample this step, in logits order
    sample_row_ids: np.ndarray | None = None   # their rows (InputBatch only)
    logits_in_order: bool = False     # logits_indices is 0..num_real_reqs-1 (an all-decode step)


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, max_num_tokens: int,
                 device: torch.device, host_metadata: bool = True):
        self.max_num_seqs, self.max_model_len, self.block_size = max_num_seqs, max_model_len, block_size
        # Host copies of the query starts and sequence lengths in the metadata: only the torch
        # reference backend reads them (the model runner says), a copy and a tensor a step otherwise.
        self.host_metadata = host_metadata
        self.max_blocks = (max_model_len + block_size - 1) // block_size
        self.max_num_tokens = max_num_tokens
        self.device = device
        self.state = RowState(max_num_seqs, max_model_len + 1)
        self.token_ids = self.state.token_ids
        self.block_table = np.zeros((max_num_seqs, self.max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)     # block ids written into each row
        self.row_of: dict[str, int] = {}
        self.sample_index = np.zeros(max_num_seqs, dtype=np.int64)  # row -> index in last step's tokens
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        T, R = max_num_tokens, max_num_seqs
        # Static device buffers (graphs and compiled pieces read these addresses every step), all
        # views of one buffer so that a step is one copy from its pinned staging.
        self.buffers = b = StepBuffers(T, R, self.max_blocks, device)
        self.input_ids, self.positions, self.slot_mapping = b.input_ids, b.positions, b.slot_mapping
        self.query_start_loc, self.seq_lens, self.logits_indices = b.query_start_loc, b.seq_lens, b.logits_indices
        self.step_block_table = b.block_table
        self.device_table = DeviceBlockTable(b, self.block_table, self.num_blocks)
        pin = device.type == "cuda"
        self._non_blocking = pin
        # Out-of-order placeholders (rare): flat rows, then their index in last step's tokens.
        self.placeholder_index = torch.zeros(2 * T, dtype=torch.long, device=device)
        self._ph_staging = [torch.zeros(2 * T, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._arange = np.arange(max(T, R) + 1, dtype=np.int64)
        # Flat offsets of the rows last handed in (rows * row width of the token and block arrays).
        self._flat_rows = (None, None, None)
        pow2 = block_size & (block_size - 1) == 0
        self._block_shift = block_size.bit_length() - 1 if pow2 else None
        # The rows that sampled in the last prepared step, in logits order (sample_index holds it).
        self._sampled_rows: np.ndarray | None = None

    # ---- rows -------------------------------------------------------------------------------
    def add(self, request) -> int:
        if not self.free_rows:
            raise RuntimeError("input batch is full (max_num_seqs rows in use)")
        row = self.free_rows.pop()
        self.row_of[request.request_id] = row
        self.num_blocks[row] = 0
        self.state.bind(request, row)
        return row

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.state.unbind(self.state.requests[row])
            self.free_rows.append(row)

    def update(self, request, block_ids: list[int] | None = None) -> None:
        """Append the blocks this row has not seen yet. (Tokens need nothing: the request is bound
        to its row, so its edits land there.)"""
        if block_ids is None:
            return
        row = self.row_of[request.request_id]
        nb = int(self.num_blocks[row])
        if len(block_ids) > nb:
            self.block_table[row, nb:len(block_ids)] = block_ids[nb:]
            self.device_table.unknown()
        elif len(block_ids) < nb:  # blocks released (preemption): the row starts over
            self.block_table[row, :len(block_ids)] = block_ids
            self.device_table.drop()           # the device copy holds blocks no longer the row's
        self.num_blocks[row] = self.state.table_len[row] = len(block_ids)

    def invalidate(self) -> None:
        """The static buffers were written outside prepare: the next step sends everything."""
        self.device_table.drop()
        self._sampled_rows = None
        for s in self.buffers.staging:
            s.key = None

    def set_token(self, request_id: str, index: int, token: int) -> None:
        """A placeholder resolved on the host: record its real value in the row."""
        self.set_tokens([(request_id, index, token)])

    def sync_rows(self, scheduled, block_table) -> None:
        """Append each scheduled row's new blocks. From the scheduler's decode fast path
        (scheduled.rows set) only the rows whose block count it changed are visited; otherwise
        every scheduled request is (a step with prefills or admissions)."""
        rows = getattr(scheduled, "rows", None)
        if rows is not None:
            grown = getattr(scheduled, "grown", None)
            if grown is None:                          # not told: find them
                grown = np.flatnonzero(self.state.table_len[rows] != self.num_blocks[rows])
            if not len(grown):
                return
            at = rows[grown]
            have = self.num_blocks[at]
            if not np.count_nonzero(self.state.table_len[at] - have != 1):    # one block each: one write
                new = getattr(scheduled, "new_blocks", None)
                if new is None:
                    new = [block_table(scheduled[i][0].request_id)[-1] for i in grown.tolist()]
                self.block_table[at, have] = new
                self.num_blocks[at] = have + 1
                # For the next prepare: the same appends on the device, if it keeps the order.
                self.device_table.record(grown, have, new)
                return
            for i in grown.tolist():
                request = scheduled[i][0]
                self.update(request, block_table(request.request_id))
            return
        num_blocks, row_of = self.num_blocks, self.row_of
        for request, _ in scheduled:
            table = block_table(request.request_id)
            if len(table) != num_blocks[row_of[request.request_id]]:
                self.update(request, table)

    def write_placeholders(self, slots) -> None:
        """Nothing to do: a bound request's placeholders are written into its row as appended."""

    def set_tokens(self, resolved) -> None:
        """resolved: (request_id, index, token) of placeholders resolved on the host; one numpy write."""
        row_of, num_written = self.row_of, self.state.num_tokens
        rows, cols, vals = [], [], []
        for rid, index, token in resolved:
            row = row_of.get(rid)
            if row is not None and index < num_written[row]:
                rows.append(row)
                cols.append(index)
                vals.append(token)
        if rows:
            self.token_ids[rows, cols] = vals

    # ---- one step ---------------------------------------------------------------------------
    def prepare(self, scheduled, pad_tokens_to: int | None = None, pad_reqs_to: int | None = None,
                previous_tokens: torch.Tensor | None = None) -> StepInputs:
        """scheduled: [(request, n)] in batch order. Returns the padded flat batch on the device.

        previous_tokens (async scheduling): step s's sampled tokens on the device; a placeholder
        input is filled from there, on the device.
        """
        R = len(scheduled)
        rows = getattr(scheduled, "rows", None)
        seq_lens = getattr(scheduled, "seq_lens", None)
        if seq_lens is not None:
            Tp, Rp = max(pad_tokens_to or R, R), max(pad_reqs_to or R, R)
            self._check_size(Tp, Rp)
            return self._prepare_decode(scheduled, rows, seq_lens, Tp, Rp, previous_tokens)
        # The rows and token counts: handed over by the scheduler's decode fast path, else one
        # pass over the requests; the rest is numpy over the rows.
        if rows is None:
            row_of = self.row_of
            rows = np.fromiter((row_of[r.request_id] for r, _ in scheduled), np.int64, R)
            n = np.fromiter((k for _, k in scheduled), np.int64, R)
        else:
            n = scheduled.num_new
        computed, num_tokens = self.state.num_computed[rows], self.state.num_tokens[rows]
        T = int(n.sum())
        Tp = max(pad_tokens_to or T, T)
        Rp = max(pad_reqs_to or R, R)
        self._check_size(Tp, Rp)
        seq_lens = computed + n
        sampling = seq_lens == num_tokens
        arange = self._arange
        if T == R:        # one token per request (all decodes): the flat batch is the rows themselves
            qsl, tok_rows, positions = arange[:R + 1], rows, computed
        else:
            qsl = np.zeros(R + 1, dtype=np.int64)
            np.cumsum(n, out=qsl[1:])
            tok_rows = np.repeat(rows, n)
            positions = np.repeat(computed - qsl[:-1], n) + arange[:T]
        input_ids = self.token_ids[tok_rows, positions]
        bs = self.block_size
        blocks = self.block_table[tok_rows, positions // bs].astype(np.int64)
        logits_idx = qsl[1:][sampling] - 1
        S = len(logits_idx)
        max_seq_len = int(seq_lens.max()) if R else 0

        i, st = self.buffers.next_staging()
        st.key = None                        # the constant parts of a decode step are overwritten
        st.input_ids[:T] = np.maximum(input_ids, 0)   # placeholders are filled on the device below
        st.positions[:T] = positions
        st.slot_mapping[:T] = blocks * bs + positions % bs
        st.input_ids[T:Tp] = 0
        st.positions[T:Tp] = 0
        st.slot_mapping[T:Tp] = -1                    # padding tokens write the scratch block
        st.logits_indices[:S] = logits_idx
        st.query_start_loc[:R + 1] = qsl
        # Padding requests own one (padding) token each when the step is padded per request
        # (full decode graphs); their seq_len 0 makes attention return zeros for them.
        st.query_start_loc[R + 1:Rp + 1] = np.minimum(T + arange[1:Rp - R + 1], Tp)
        st.seq_lens[:R] = seq_lens
        st.seq_lens[R:Rp] = 0
        views = self.buffers.views(Tp, Rp, S)
        table, k = self.device_table.stage(st, rows, R, Rp, -(-max_seq_len // bs), self.state.version)
        self.buffers.upload(views, i, table)
        if k:
            self.device_table.scatter(k)

        ph = np.flatnonzero(input_ids == PLACEHOLDER)
        if len(ph):
            self._fill_placeholders(ph, tok_rows, previous_tokens, i)
        # Where each row's sampled token will sit in this step's output, for the next step.
        sampled_rows = rows[sampling]
        self.sample_index[sampled_rows] = arange[:S]
        self._sampled_rows = sampled_rows

        meta = AttentionMetadata(
            query_start_loc=views.query_start_loc, seq_lens=views.seq_lens, block_table=views.block_table,
            slot_mapping=views.slot_mapping, num_reqs=Rp, num_tokens=Tp,
            max_query_len=max(int(n.max()) if R else 0, 1 if Rp > R else 0), max_seq_len=max_seq_len,
            query_start_loc_cpu=torch.from_numpy(st.query_start_loc[:Rp + 1].copy()) if self.host_metadata else None,
            seq_lens_cpu=torch.from_numpy(st.seq_lens[:Rp].copy()) if self.host_metadata else None)
        requests = getattr(scheduled, "requests", None)
        if requests is not None and S == R:
            sample_rows = requests
        else:
            sample_rows = [r for (r, _), s in zip(scheduled, sampling.tolist()) if s]
        return StepInputs(views.input_ids, views.positions, meta, views.logits_indices, T, R, sample_rows,
                          sampled_rows)

    def _prepare_decode(self, scheduled, rows, seq_lens, Tp, Rp, previous_tokens) -> StepInputs:
        """prepare() of an all-decode step: one token per row at position seq_len - 1, every row samples."""
        R, bs, arange = len(rows), self.block_size, self._arange
        i, st = self.buffers.next_staging()
        positions = np.subtract(seq_lens, 1, out=st.positions[:R])
        flat_rows, token_base, table_base = self._flat_rows
        if flat_rows is not rows:          # the scheduler hands over the same array while nothing changes
            token_base, table_base = rows * self.token_ids.shape[1], rows * self.max_blocks
            self._flat_rows = (rows, token_base, table_base)
        input_ids = self.token_ids.take(token_base + positions)
        np.maximum(input_ids, 0, out=st.input_ids[:R])    # placeholders are filled on the device below
        if self._block_shift is not None:
            block, offset = positions >> self._block_shift, positions & (bs - 1)
        else:
            block, offset = np.divmod(positions, bs)
        slots = st.slot_mapping[:R]
        np.multiply(self.block_table.take(table_base + block), bs, out=slots, dtype=np.int64)
        slots += offset
        st.seq_lens[:R] = seq_lens
        views = self.buffers.views(Tp, Rp, R)
        qsl_cpu = views.cache.get("decode_qsl")
        if st.key != (Tp, Rp, R):           # the parts that stay the same from step to step
            st.key = (Tp, Rp, R)
            st.query_start_loc[:R + 1] = arange[:R + 1]
            st.query_start_loc[R + 1:Rp + 1] = np.minimum(R + arange[1:Rp - R + 1], Tp)
            st.logits_indices[:R] = arange[:R]
            st.input_ids[R:Tp] = 0
            st.positions[R:Tp] = 0
            st.slot_mapping[R:Tp] = -1
            st.seq_lens[R:Rp] = 0
        if qsl_cpu is None:
            qsl_cpu = views.cache["decode_qsl"] = torch.from_numpy(st.query_start_loc[:Rp + 1].copy())
        max_seq_len = getattr(scheduled, "max_seq_len", None)     # the scheduler's decode fast path has it
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        table, k = self.device_table.stage(st, rows, R, Rp, -(-max_seq_len // bs), self.state.version)
        self.buffers.upload(views, i, table)
        if k:
            self.device_table.scatter(k)
        same_order = rows is self._sampled_rows
        held = np.count_nonzero(input_ids < 0)       # placeholders (not .min(): see decode_batch.py)
        if held:
            if not same_order and self._sampled_rows is not None and np.array_equal(rows, self._sampled_rows):
                same_order = True
                self._sampled_rows = rows    # the same rows: the identity test answers next time
            if same_order and held == R:
                # Every input takes the previous step's token in the same position (a decode batch
                # whose order did not change): one device copy, no index upload.
                if previous_tokens is None:
                    raise RuntimeError("a placeholder token is scheduled but no step is in flight")
                self.input_ids[:R].copy_(previous_tokens[:R], non_blocking=self._non_blocking)
            else:
                self._fill_placeholders(np.flatnonzero(input_ids == PLACEHOLDER), rows, previous_tokens, i)
        if not same_order:
            self.sample_index[rows] = arange[:R]
            self._sampled_rows = rows
        meta = AttentionMetadata(
            query_start_loc=views.query_start_loc, seq_lens=views.seq_lens, block_table=views.block_table,
            slot_mapping=views.slot_mapping, num_reqs=Rp, num_tokens=Tp, max_query_len=1, max_seq_len=max_seq_len,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=torch.from_numpy(st.seq_lens[:Rp].copy()) if self.host_metadata else None)
        return StepInputs(views.input_ids, views.positions, meta, views.logits_indices, R, R, scheduled.requests,
                          rows, True)

    def _check_size(self, Tp: int, Rp: int) -> None:
        if Tp > self.max_num_tokens or Rp > self.max_num_seqs:
            raise RuntimeError(f"step of {Tp} tokens / {Rp} requests exceeds the input batch")

    def _fill_placeholders(self, ph: np.ndarray, tok_rows: np.ndarray, previous_tokens, i: int) -> None:
        """Async scheduling: a placeholder input (-1 in the row) takes its real value from the
        previous step's sampled tokens, on the device: nothing is read back to the host."""
        if previous_tokens is None:
            raise RuntimeError("a placeholder token is scheduled but no step is in flight")
        k = len(ph)
        src = self.sample_index[tok_rows[ph]]
        nb = self._non_blocking
        if ph[-1] == k - 1 and np.array_equal(src, self._arange[:k]):
            # The first k inputs take the previous step's first k tokens in order: one device copy.
            self.input_ids[:k].copy_(previous_tokens[:k], non_blocking=nb)
            return
        # Through pinned staging: a copy from pageable memory would wait for the GPU to drain,
        # which is exactly the overlap async scheduling exists for.
        staged = self._ph_staging[i]
        host = staged.numpy()
        host[:k] = ph
        host[k:2 * k] = src
        index = self.placeholder_index
        index[:2 * k].copy_(staged[:2 * k], non_blocking=nb)
        self.input_ids.index_copy_(0, index[:k], previous_tokens.index_select(0, index[k:2 * k]))
