"""The static device buffers of a step's flat batch, their pinned host staging, and the one copy between.

Every field a step sends to the device (token ids, positions, KV slots, logits rows, query starts,
sequence lengths, block table, block-table appends) lives at a fixed offset of ONE int64 device
buffer, the int32 fields reinterpreted in place. The staging buffers mirror that layout, so a step is
one host-to-device copy of a word range instead of one copy per field (each copy costs several µs of
host time on CUDA). The fields are ordered small first, block table last:

    [query starts | seq lens | append values | logits rows | append indices | ids | positions | slots | block table]

so a step's copy covers the small fields, the first Tp entries of the token fields and, when the
block table is rebuilt, its first Rp rows; what lies between (the unused tails of ids and positions,
a few KiB at the default 2048-token budget) travels too. When that waste would exceed COPY_WASTE_WORDS
(a large token budget and a small step), the token fields go as separate copies instead.

Each field starts on a 256-byte boundary, so every view is as aligned as a fresh allocation for the
kernels that read it. The field tensors are views of the same storage at fixed addresses: CUDA
graphs captured over them stay valid, and the compiled model always sees the same storage.

Staging is double-buffered: with async scheduling, step s+1 is prepared while step s may still be
waiting to run its host-to-device copy, which must not read a buffer being refilled.

Views of a step's sizes are cached per (Tp, Rp, S), so a step slices no tensor: they are made with
inference mode off, which keeps them usable both inside and outside torch.inference_mode().
"""

from dataclasses import dataclass

import numpy as np
import torch

from pcg_engine.engine import driver_copy

ALIGN_WORDS = 32                 # 256 bytes
COPY_WASTE_WORDS = 8192          # 64 KiB of unused words that one copy may carry along
_MAX_CACHED_VIEWS = 256


def _words(n_int32: int) -> int:
    return (n_int32 + 1) // 2


@dataclass
class StepViews:
    """Device views of one step's sizes, and the word ranges its copies move."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    copies: list            # [(device words, (staging words of set 0, of set 1))], block table not included
    copies_table: list      # the same with the block table's first Rp rows
    spans: tuple            # per staging set, copies as (device address, host address, bytes): driver_copy.py
    spans_table: tuple      # the same for copies_table
    cache: dict             # per-size host values a caller may keep here (e.g. the decode query starts)


class Staging:
    """One set of pinned host staging: numpy views of the fields, over `words` (int64)."""

    def __init__(self, layout: dict, sizes: dict, total: int, pin: bool, num_reqs: int, max_blocks: int):
        self.words = torch.zeros(total, dtype=torch.long, pin_memory=pin)
        w64 = self.words.numpy()
        w32 = w64.view(np.int32)
        for name, (offset, kind) in layout.items():
            n = sizes[name]
            view = w64[offset:offset + n] if kind == 64 else w32[2 * offset:2 * offset + n]
            setattr(self, name, view)
        self.block_table = self.block_table.reshape(num_reqs, max_blocks)
        self.key = None          # what the caller last wrote into the parts it does not rewrite per step


class StepBuffers:
    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks: int, device: torch.device):
        T, R, B = max_num_tokens, max_num_seqs, max_blocks
        self.max_num_tokens, self.max_num_seqs, self.max_blocks = T, R, B
        # (name, element count, 64 or 32 bits), in layout order.
        fields = [("query_start_loc", R + 1, 32), ("seq_lens", R, 32), ("table_value", R, 32),
                  ("logits_indices", R, 64), ("table_index", R, 64),
                  ("input_ids", T, 64), ("positions", T, 64), ("slot_mapping", T, 64),
                  ("block_table", R * B, 32)]
        layout, sizes, offset = {}, {}, 0
        for name, n, bits in fields:
            layout[name] = (offset, bits)
            sizes[name] = n
            offset += -(-(n if bits == 64 else _words(n)) // ALIGN_WORDS) * ALIGN_WORDS
        self.layout, self.total_words = layout, offset
        self.words = torch.zeros(offset, dtype=torch.long, device=device)
        for name, (off, bits) in layout.items():
            n = sizes[name]
            view = self.words[off:off + n] if bits == 64 else self.words[off:off + _words(n)].view(torch.int32)[:n]
            setattr(self, name, view)
        self.block_table = self.block_table.view(R, B)
        self.slot_mapping.fill_(-1)
        pin = device.type == "cuda"
        self.non_blocking = pin
        self.staging = [Staging(layout, sizes, offset, pin, R, B) for _ in range(2)]
        self.driver = driver_copy.for_device(device) if pin else None   # None: copy_ (CPU, or switched off)
        self._flip = 0
        self._views: dict = {}

    def next_staging(self) -> tuple[int, Staging]:
        i = self._flip
        self._flip ^= 1
        return i, self.staging[i]

    # ---- per-size views -----------------------------------------------------------------------
    def views(self, Tp: int, Rp: int, S: int) -> StepViews:
        key = (Tp, Rp, S)
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:   # unpadded prefill sizes vary: keep it bounded
                self._views.clear()
            with torch.inference_mode(False):
                v = self._views[key] = self._make_views(Tp, Rp, S)
        return v

    def _make_views(self, Tp: int, Rp: int, S: int) -> StepViews:
        L, B = self.layout, self.max_blocks
        ids, pos, slots, table = (L[k][0] for k in ("input_ids", "positions", "slot_mapping", "block_table"))
        table_end = table + _words(Rp * B)
        if 2 * (self.max_num_tokens - Tp) <= COPY_WASTE_WORDS:
            ranges = [(0, slots + Tp)]
        else:
            ranges = [(0, ids + Tp), (pos, pos + Tp), (slots, slots + Tp)]
        with_table = list(ranges)
        if table - ranges[-1][1] <= COPY_WASTE_WORDS:
            with_table[-1] = (ranges[-1][0], table_end)
        else:
            with_table.append((table, table_end))

        def pairs(spans):
            return [(self.words[a:b], tuple(s.words[a:b] for s in self.staging)) for a, b in spans if b > a]

        def addresses(copies):
            return tuple(tuple((dst.data_ptr(), srcs[i].data_ptr(), 8 * dst.numel()) for dst, srcs in copies)
                         for i in range(len(self.staging)))
        copies, copies_table = pairs(ranges), pairs(with_table)
        return StepViews(self.input_ids[:Tp], self.positions[:Tp], self.slot_mapping[:Tp], self.logits_indices[:S],
                         self.query_start_loc[:Rp + 1], self.seq_lens[:Rp], self.block_table[:Rp],
                         copies, copies_table, addresses(copies), addresses(copies_table), {})

    def upload(self, views: StepViews, staging_index: int, table: bool) -> None:
        """The step's one host-to-device copy (a few when the token budget is large): by the
        driver where it serves (driver_copy.py), else by copy_."""
        driver = self.driver
        if driver is not None and driver.host_to_device((views.spans_table if table else views.spans)[staging_index]):
            return
        nb = self.non_blocking
        for dst, src in (views.copies_table if table else views.copies):
            dst.copy_(src[staging_index], non_blocking=nb)
