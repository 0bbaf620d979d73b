"""The persistent input batch: per-request state in fixed rows, and the step's flat batch built from them.

A request gets one row for its lifetime (preemption and finishing release it). The row holds its
token ids and counts (row_state.py: the request is bound to the row, so they are written there
directly) and its block table on the host; a step writes only what changed (appended blocks) and
builds the flat batch with vectorised numpy gathers over the scheduled rows, no Python loop over
tokens, and none over requests when the scheduler hands over the rows (ScheduledBatch). The result goes through pinned staging buffers into static device buffers whose
addresses never change: CUDA graphs captured over them stay valid, and the compiled model always
sees views of the same storage.

Staging is double-buffered: with async scheduling, step s+1 is prepared while step s may still be
waiting to run its host-to-device copies, and those copies must not read a buffer being refilled.
"""

from dataclasses import dataclass

import numpy as np
import torch

from pcg_engine.attention.metadata import AttentionMetadata
from pcg_engine.engine.request import PLACEHOLDER
from pcg_engine.engine.row_state import RowState


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


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, max_num_tokens: int,
                 device: torch.device):
        self.max_num_seqs, self.max_model_len, self.block_size = max_num_seqs, max_model_len, block_size
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
        pin = device.type == "cuda"
        T, R = max_num_tokens, max_num_seqs

        def dev(*shape, dtype, fill=0):
            return torch.full(shape, fill, dtype=dtype, device=device)

        # Static device buffers: graphs and compiled pieces read these addresses every step.
        self.input_ids = dev(T, dtype=torch.long)
        self.positions = dev(T, dtype=torch.long)
        self.slot_mapping = dev(T, dtype=torch.long, fill=-1)
        self.query_start_loc = dev(R + 1, dtype=torch.int32)
        self.seq_lens = dev(R, dtype=torch.int32)
        self.step_block_table = dev(R, self.max_blocks, dtype=torch.int32)
        self.logits_indices = dev(R, dtype=torch.long)
        self.placeholder_index = dev(2 * T, dtype=torch.long)   # flat rows, then their index in last step's tokens
        # Pinned host staging, two sets used alternately; one int64 buffer per step for the flat
        # arrays and one int32 buffer for the per-request ones keeps it to a few copies.
        self._staging = [self._make_staging(pin) for _ in range(2)]
        self._flip = 0
        self._non_blocking = device.type == "cuda"
        self._arange = np.arange(max(T, R) + 1, dtype=np.int64)

    def _make_staging(self, pin):
        T, R, B = self.max_num_tokens, self.max_num_seqs, self.max_blocks
        stage = {"tok": torch.zeros(3 * T + R, dtype=torch.long, pin_memory=pin),
                 "req": torch.zeros(2 * R + 1 + R * B, dtype=torch.int32, pin_memory=pin),
                 "ph": torch.zeros(2 * T, dtype=torch.long, pin_memory=pin)}
        stage.update({f"{k}_np": v.numpy() for k, v in list(stage.items())})   # views of the same memory
        return stage

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
        elif len(block_ids) < nb:  # blocks released (preemption): the row starts over
            self.block_table[row, :len(block_ids)] = block_ids
        self.num_blocks[row] = self.state.table_len[row] = len(block_ids)

    def set_token(self, request_id: str, index: int, token: int) -> None:
        """A placeholder resolved on the host: record its real value in the row."""
        self.set_tokens([(request_id, index, token)])

    def sync_rows(self, scheduled, block_table) -> None:
        """Append each scheduled row's new blocks. From the scheduler's decode fast path
        (scheduled.rows set) only the rows whose block count it changed are visited; otherwise
        every scheduled request is (a step with prefills or admissions)."""
        rows = getattr(scheduled, "rows", None)
        if rows is not None:
            changed = np.flatnonzero(self.state.table_len[rows] != self.num_blocks[rows])
            if not len(changed):
                return
            grown = rows[changed]
            have = self.num_blocks[grown]
            if np.array_equal(self.state.table_len[grown], have + 1):    # one block each: one write
                self.block_table[grown, have] = [block_table(scheduled[i][0].request_id)[-1]
                                                 for i in changed.tolist()]
                self.num_blocks[grown] = have + 1
                return
            for i in changed.tolist():
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
        # The rows and token counts: handed over by the scheduler's decode fast path, else one
        # pass over the requests; the rest is numpy over the rows.
        rows = getattr(scheduled, "rows", None)
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
        if Tp > self.max_num_tokens or Rp > self.max_num_seqs:
            raise RuntimeError(f"step of {Tp} tokens / {Rp} requests exceeds the input batch")
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
        slots = blocks * bs + positions % bs
        logits_idx = qsl[1:][sampling] - 1
        S = len(logits_idx)
        max_seq_len = int(seq_lens.max()) if R else 0

        stage = self._staging[self._flip]
        self._flip ^= 1
        tok = stage["tok_np"]
        tok[:T] = np.maximum(input_ids, 0)   # placeholders are filled on the device below
        tok[Tp:Tp + T] = positions
        tok[2 * Tp:2 * Tp + T] = slots
        if Tp > T:
            tok[T:Tp] = 0
            tok[Tp + T:2 * Tp] = 0
            tok[2 * Tp + T:3 * Tp] = -1      # padding tokens write the scratch block
        tok[3 * Tp:3 * Tp + S] = logits_idx
        req = stage["req_np"]
        req[:R + 1] = qsl
        # Padding requests own one (padding) token each when the step is padded per request
        # (full decode graphs); their seq_len 0 makes attention return zeros for them.
        if Rp > R:
            req[R + 1:Rp + 1] = np.minimum(T + np.arange(1, Rp - R + 1), Tp)
        off = Rp + 1
        req[off:off + R] = seq_lens
        req[off + R:off + Rp] = 0
        off += Rp
        bt = req[off:off + Rp * self.max_blocks].reshape(Rp, self.max_blocks)
        # Only the columns in use: attention never reads a row past its seq_len's blocks, so the
        # stale columns beyond (left from earlier steps) are never seen.
        used = -(-max_seq_len // bs)
        bt[:R, :used] = self.block_table[rows, :used]
        bt[R:] = 0

        stage_tok, stage_req = stage["tok"], stage["req"]
        nb = self._non_blocking
        self.input_ids[:Tp].copy_(stage_tok[:Tp], non_blocking=nb)
        self.positions[:Tp].copy_(stage_tok[Tp:2 * Tp], non_blocking=nb)
        self.slot_mapping[:Tp].copy_(stage_tok[2 * Tp:3 * Tp], non_blocking=nb)
        self.logits_indices[:S].copy_(stage_tok[3 * Tp:3 * Tp + S], non_blocking=nb)
        self.query_start_loc[:Rp + 1].copy_(stage_req[:Rp + 1], non_blocking=nb)
        self.seq_lens[:Rp].copy_(stage_req[Rp + 1:2 * Rp + 1], non_blocking=nb)
        self.step_block_table[:Rp].copy_(stage_req[2 * Rp + 1:2 * Rp + 1 + Rp * self.max_blocks]
                                         .view(Rp, self.max_blocks), non_blocking=nb)

        # Async scheduling: a placeholder input (-1 in the row) takes its real value from the
        # previous step's sampled tokens, on the device: nothing is read back to the host.
        ph = np.flatnonzero(input_ids == PLACEHOLDER)
        k = len(ph)
        if k:
            if previous_tokens is None:
                raise RuntimeError("a placeholder token is scheduled but no step is in flight")
            src = self.sample_index[tok_rows[ph]]
            if ph[-1] == k - 1 and np.array_equal(src, arange[:k]):
                # The first k inputs take the previous step's first k tokens in order (a decode
                # batch whose order did not change): one device copy, no index upload.
                self.input_ids[:k].copy_(previous_tokens[:k], non_blocking=nb)
            else:
                # Through pinned staging: a copy from pageable memory would wait for the GPU to
                # drain, which is exactly the overlap async scheduling exists for.
                staged = stage["ph_np"]
                staged[:k] = ph
                staged[k:2 * k] = src
                index = self.placeholder_index
                index[:2 * k].copy_(stage["ph"][:2 * k], non_blocking=nb)
                self.input_ids.index_copy_(0, index[:k], previous_tokens.index_select(0, index[k:2 * k]))
        # Where each row's sampled token will sit in this step's output, for the next step.
        self.sample_index[rows[sampling]] = arange[:S]

        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[:Rp + 1], seq_lens=self.seq_lens[:Rp],
            block_table=self.step_block_table[:Rp], slot_mapping=self.slot_mapping[:Tp],
            num_reqs=Rp, num_tokens=Tp, max_query_len=max(int(n.max()) if R else 0, 1 if Rp > R else 0),
            max_seq_len=max_seq_len,
            query_start_loc_cpu=torch.from_numpy(req[:Rp + 1].copy()),
            seq_lens_cpu=torch.from_numpy(req[Rp + 1:2 * Rp + 1].copy()))
        requests = getattr(scheduled, "requests", None)
        if requests is not None and S == R:
            sample_rows = requests
        else:
            sample_rows = [r for (r, _), s in zip(scheduled, sampling.tolist()) if s]
        return StepInputs(self.input_ids[:Tp], self.positions[:Tp], meta, self.logits_indices[:S], T, R, sample_rows,
                          rows[sampling])
