"""The step's block table on the device, kept by appending while the batch keeps its rows in order.

A step's block table has one row per scheduled request, in batch order, padded to Rp rows. Sending
it whole every step (256 rows x max_blocks int32 at batch 256) costs a numpy gather of the used
columns into the staging and a large copy; but in a run of decode steps the batch order rarely
changes and each row only ever gains a block at its end (DESIGN.md: block-table rows change by
appending). So the device copy is kept: while the step's rows equal the last step's (same order,
same padding, no row changed hands: RowState.version), only the blocks appended since go, as
(flat index, block id) pairs in the step's one copy, written by one kernel on the device
(kernels/scatter.py).

The appends must be known one by one: InputBatch.sync_rows records those of the scheduler's decode
fast path (`record`); any other edit of the host table (`unknown`) or a row's blocks replaced in
place (`drop`) makes the next step send the table whole, as does `drop` after anything else wrote
the static buffers (warm-up, graph capture).
"""

import numpy as np
import torch

from pcg_engine.kernels.scatter import scatter_

_UNKNOWN = object()     # host-table edits since the last step that were not recorded one by one


class DeviceBlockTable:
    def __init__(self, buffers, host_table: np.ndarray, num_blocks: np.ndarray):
        self.buffers = buffers                    # StepBuffers: block_table, table_index, table_value
        self.host_table, self.num_blocks = host_table, num_blocks
        self.max_blocks = host_table.shape[1]
        self._flat = buffers.block_table.view(-1)
        self._cuda = self._flat.is_cuda
        self._updates: dict[int, tuple] = {}
        # What the device holds: the host table of `rows` in batch order, padded to the key's Rp, at
        # the key's RowState version, but for the appends since: None (none), (batch positions,
        # columns, block ids), or _UNKNOWN.
        self.rows: np.ndarray | None = None
        self._key = None
        self._appended = None

    def record(self, positions: np.ndarray, columns: np.ndarray, block_ids) -> None:
        """One block appended at `columns` to the rows at batch `positions` of the coming step."""
        self._appended = (positions, columns, block_ids) if self._appended is None else _UNKNOWN

    def unknown(self) -> None:
        """The host table gained blocks that were not recorded."""
        self._appended = _UNKNOWN

    def drop(self) -> None:
        """The device copy no longer matches (blocks replaced, or the buffer written elsewhere)."""
        self.rows = None

    def stage(self, st, rows: np.ndarray, R: int, Rp: int, used: int, version: int) -> tuple[bool, int]:
        """Stage the step's table into staging `st`: (True, 0) when rows [:Rp] must be sent whole;
        (False, k) when the device holds it but for k appends, staged as (flat index, block id)."""
        key = (R, Rp, version)
        prev, appended = self.rows, self._appended
        self._appended = None
        if (prev is not None and self._key == key and appended is not _UNKNOWN
                and (rows is prev or np.array_equal(rows, prev))):
            self.rows = rows
            if appended is None:
                return False, 0
            at, cols, ids = appended           # batch positions (the device's rows), columns, ids
            k = len(at)
            index = st.table_index[:k]
            np.multiply(at, self.max_blocks, out=index)
            index += cols
            st.table_value[:k] = ids
            return False, k
        # Only the columns in use: attention never reads a row past its seq_len's blocks, so the
        # stale columns beyond (left from earlier steps) are never seen. Every block a row holds
        # goes, so that later appends find the columns before them on the device.
        used = min(max(used, int(self.num_blocks[rows].max()) if R else 0), self.max_blocks)
        bt = st.block_table
        bt[:R, :used] = self.host_table[rows, :used]
        bt[R:Rp] = 0
        self.rows, self._key = rows, key
        return True, 0

    def scatter(self, k: int) -> None:
        """Write the k staged appends (already on the device, in the step's copy) into the table."""
        if self._cuda:
            scatter_(self._flat, self.buffers.table_index, self.buffers.table_value, k)
            return
        pair = self._updates.get(k)         # the CPU's index_copy_ on views kept per k
        if pair is None:
            with torch.inference_mode(False):
                pair = self._updates[k] = (self.buffers.table_index[:k], self.buffers.table_value[:k])
        self._flat.index_copy_(0, *pair)
