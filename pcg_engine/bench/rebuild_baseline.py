"""The per-step rebuild that the persistent input batch replaced: the baseline of P4.

Like the book's build_batch, every step walks each scheduled request in Python, appends its
tokens, positions and KV slots to lists one token at a time, pads the block tables into a list of
lists, and turns each list into a fresh device tensor. Nothing survives between steps but the
references to each request's live block list (what the block manager hands out anyway) and, for
async scheduling, where each request's token sits in the previous step's output.

It has the same interface as InputBatch (add/remove/update/set_token and the per-step sync_rows/write_placeholders/set_tokens, prepare), so the host-overhead
harness can swap it into a running engine and time both under the same scheduler and bookkeeping.
"""

from __future__ import annotations

import torch

from pcg_engine.attention.metadata import AttentionMetadata
from pcg_engine.engine.input_batch import StepInputs
from pcg_engine.engine.request import PLACEHOLDER


class RebuildBatch:
    def __init__(self, max_num_seqs: int, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device
        self.row_of: dict[str, int] = {}      # rows only index the sampler's per-request tensors
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}
        self.sample_index: dict[str, int] = {}

    # ---- the engine's row calls: nothing to keep but the row number and the block list ----------
    def add(self, request) -> int:
        row = self.free_rows.pop()
        self.row_of[request.request_id] = row
        return row

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row)
        self.tables.pop(request_id, None)
        self.sample_index.pop(request_id, None)

    def update(self, request, block_ids: list[int] | None = None) -> None:
        if block_ids is not None:
            self.tables[request.request_id] = block_ids

    def set_token(self, request_id: str, index: int, token: int) -> None:
        pass                                   # tokens are read from the request every step

    def sync_rows(self, scheduled, block_table) -> None:
        for request, _ in scheduled:
            self.tables[request.request_id] = block_table(request.request_id)

    def write_placeholders(self, slots) -> None:
        pass

    def set_tokens(self, resolved) -> None:
        pass

    # ---- one step, rebuilt from scratch ------------------------------------------------------
    def prepare(self, scheduled, pad_tokens_to=None, pad_reqs_to=None, previous_tokens=None) -> StepInputs:
        bs = self.block_size
        input_ids, positions, slot_mapping = [], [], []
        query_start_loc, seq_lens, tables = [0], [], []
        logits_indices, sample_rows, placeholders = [], [], []
        for request, n in scheduled:
            start = request.num_computed_tokens
            blocks = self.tables[request.request_id]
            for pos in range(start, start + n):
                token = request.token_ids[pos]
                if token == PLACEHOLDER:
                    placeholders.append((len(input_ids), self.sample_index[request.request_id]))
                    token = 0
                input_ids.append(token)
                positions.append(pos)
                slot_mapping.append(blocks[pos // bs] * bs + pos % bs)
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
            tables.append(list(blocks))
            if start + n == request.num_tokens:
                logits_indices.append(query_start_loc[-1] - 1)
                sample_rows.append(request)
        width = max((len(t) for t in tables), default=1) or 1
        tables = [t + [0] * (width - len(t)) for t in tables]

        d = self.device
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=d)
        if placeholders:      # async: the real tokens are still on the device, in the last step's output
            dst = torch.tensor([p for p, _ in placeholders], dtype=torch.long, device=d)
            src = torch.tensor([s for _, s in placeholders], dtype=torch.long, device=d)
            ids_t.index_copy_(0, dst, previous_tokens.index_select(0, src))
        self.sample_index = {r.request_id: i for i, r in enumerate(sample_rows)}
        qsl_cpu = torch.tensor(query_start_loc, dtype=torch.int32)
        seq_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        meta = AttentionMetadata(
            query_start_loc=qsl_cpu.to(d), seq_lens=seq_cpu.to(d),
            block_table=torch.tensor(tables, dtype=torch.int32, device=d),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=d),
            num_reqs=len(scheduled), num_tokens=len(input_ids),
            max_query_len=max((n for _, n in scheduled), default=0), max_seq_len=max(seq_lens, default=0),
            query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_cpu)
        return StepInputs(ids_t, torch.tensor(positions, dtype=torch.long, device=d), meta,
                          torch.tensor(logits_indices, dtype=torch.long, device=d), len(input_ids),
                          len(scheduled), sample_rows)
