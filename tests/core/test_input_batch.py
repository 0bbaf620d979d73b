"""The persistent input batch: InputBatch.prepare's flat batch equals a plain per-request Python rebuild.

Random workloads drive one InputBatch the way the engine does (rows added, grown by appending tokens
and blocks, released on finish and preemption, reused), with prefill chunks and decodes mixed, with
and without padding, and with async placeholders whose value comes from the previous step's sampled
tokens on the device (resolved on the host one step later through set_token).
"""

import ctypes
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pcg_engine.engine.input_batch import InputBatch
from pcg_engine.engine.request import PLACEHOLDER, Request
from pcg_engine.engine.scheduler import ScheduledBatch

BS = 4
MAX_LEN = 64
MAX_SEQS = 8
MAX_TOKENS = 48
NUM_BLOCKS = 200


def rebuild(scheduled, tables, prev_sample_pos, previous_tokens, Tp, Rp):
    """The flat batch by hand, one request and one token at a time."""
    ids, pos, slots, qsl, lens, logits_idx, sample_rows = [], [], [], [0], [], [], []
    for request, n in scheduled:
        c = request.num_computed_tokens
        for p in range(c, c + n):
            t = request.token_ids[p]
            if t == PLACEHOLDER:
                t = int(previous_tokens[prev_sample_pos[request.request_id]])
            ids.append(t)
            pos.append(p)
            slots.append(tables[request.request_id][p // BS] * BS + p % BS)
        qsl.append(qsl[-1] + n)
        lens.append(c + n)
        if c + n == request.num_tokens:
            logits_idx.append(qsl[-1] - 1)
            sample_rows.append(request)
    T, R = len(ids), len(scheduled)
    pad_t = Tp - T
    return SimpleNamespace(
        input_ids=ids, positions=pos, slots=slots + [-1] * pad_t, pad_t=pad_t,
        qsl=qsl + [min(T + k, Tp) for k in range(1, Rp - R + 1)], seq_lens=lens + [0] * (Rp - R),
        logits_idx=logits_idx, sample_rows=sample_rows, T=T, R=R)


def check_step(batch, scheduled, tables, prev_sample_pos, previous_tokens, pad_tokens_to=None, pad_reqs_to=None):
    T = sum(n for _, n in scheduled)
    R = len(scheduled)
    Tp = max(pad_tokens_to or T, T)
    Rp = max(pad_reqs_to or R, R)
    want = rebuild(scheduled, tables, prev_sample_pos, previous_tokens, Tp, Rp)
    got = batch.prepare(scheduled, pad_tokens_to=pad_tokens_to, pad_reqs_to=pad_reqs_to,
                        previous_tokens=previous_tokens)
    meta = got.metadata
    assert got.num_real_tokens == T and got.num_real_reqs == R
    assert got.input_ids.shape == (Tp,) and got.positions.shape == (Tp,)
    assert got.input_ids[:T].tolist() == want.input_ids
    assert got.positions[:T].tolist() == want.positions
    assert meta.slot_mapping.tolist() == want.slots
    # Padding tokens: any in-vocabulary id and position, always the scratch slot.
    assert (got.input_ids[T:] >= 0).all() and (got.positions[T:] >= 0).all()
    assert (got.positions[T:] < MAX_LEN).all()
    assert meta.query_start_loc.tolist() == want.qsl
    assert meta.seq_lens.tolist() == want.seq_lens
    assert meta.num_reqs == Rp and meta.num_tokens == Tp
    assert meta.max_seq_len == max(want.seq_lens)
    assert meta.max_query_len == max(max(n for _, n in scheduled), 1 if Rp > R else 0)
    assert meta.query_start_loc_cpu.tolist() == want.qsl
    assert meta.seq_lens_cpu.tolist() == want.seq_lens
    assert meta.query_start_loc.dtype == torch.int32 and meta.seq_lens.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64 and meta.block_table.dtype == torch.int32
    for r, (request, _) in enumerate(scheduled):
        table = tables[request.request_id]
        needed = -(-want.seq_lens[r] // BS)
        assert meta.block_table[r, :needed].tolist() == table[:needed]
    assert got.logits_indices.tolist() == want.logits_idx
    assert got.sample_rows == want.sample_rows
    return got


class MemmoveCopies:
    """engine/driver_copy.DriverCopy's interface over CPU memory: the addresses and byte counts the
    batch hands to the driver on CUDA, copied by memmove, so that CPU runs check them. refuse: every
    call returns False, as the driver's errors do: the batch must copy by torch instead."""

    def __init__(self, refuse: bool = False):
        self.refuse, self.calls = refuse, 0

    def host_to_device(self, spans) -> bool:
        self.calls += 1
        if not self.refuse:
            for dst, src, n in spans:
                ctypes.memmove(dst, src, n)
        return not self.refuse


COPIERS = {"torch": lambda: None, "driver": MemmoveCopies, "refused": lambda: MemmoveCopies(refuse=True)}


class Workload:
    """Engine-like driver of one InputBatch with random decisions. copier: how the batch's copies
    go (COPIERS; None keeps the device's own)."""

    def __init__(self, seed, async_mode, device="cpu", copier=None):
        self.rng = random.Random(seed)
        self.async_mode = async_mode
        self.device = torch.device(device)
        self.batch = InputBatch(MAX_SEQS, MAX_LEN, BS, MAX_TOKENS, self.device)
        if copier is not None:
            self.batch.buffers.driver = COPIERS[copier]()
        self.free_blocks = list(range(1, NUM_BLOCKS))
        self.rng.shuffle(self.free_blocks)
        self.active: list[Request] = []
        self.tables: dict[str, list[int]] = {}
        self.ids = 0
        self.prev_sample_pos: dict[str, int] = {}   # request -> index in the last step's sampled tokens
        self.previous_tokens = None
        self.unresolved: list[tuple[Request, int, int]] = []   # (request, token index, sample index)

    def new_request(self):
        n = self.rng.randint(1, 30)
        r = Request(f"r{self.ids}", [self.rng.randint(0, 999) for _ in range(n)],
                    SimpleNamespace(max_tokens=MAX_LEN - n))
        self.ids += 1
        self.active.append(r)
        self.tables[r.request_id] = []
        self.batch.add(r)
        return r

    def release(self, r, preempt=False):
        self.free_blocks += self.tables.pop(r.request_id)
        self.batch.remove(r.request_id)
        self.active.remove(r)
        if preempt:      # back with its tokens, blocks gone, recomputed from 0
            r.num_computed_tokens = 0
            self.active.append(r)
            self.tables[r.request_id] = []
            self.batch.add(r)

    def launch(self, scheduled, got, rng, mirror: bool):
        """"Launch" a prepared step: computed advances, the sampling rows get a placeholder (async)
        or their token. mirror: also tell the batch each change (set_token, update), as the
        general path does; the decode path's batch learns them from sync_rows instead."""
        sampled = torch.tensor([rng.randint(3, 999) for _ in got.sample_rows], dtype=torch.long, device=self.device)
        for r, n in scheduled:
            r.num_computed_tokens += n
        # Async: step s-1's placeholders are resolved on the host after step s is launched.
        for r, index, j in self.unresolved:
            if r in self.active and index < r.num_tokens and r.token_ids[index] == PLACEHOLDER:
                value = int(self.previous_tokens[j])
                r.resolve_placeholder(index, value)
                if mirror:
                    self.batch.set_token(r.request_id, index, value)
        self.unresolved, self.prev_sample_pos = [], {}
        for j, r in enumerate(got.sample_rows):
            if self.async_mode:
                self.unresolved.append((r, r.num_tokens, j))
                r.append_output(PLACEHOLDER)
            else:
                r.append_output(int(sampled[j]))
            self.prev_sample_pos[r.request_id] = j
            if mirror:
                self.batch.update(r)
        self.previous_tokens = sampled

    def step(self, pad):
        rng = self.rng
        while len(self.active) < MAX_SEQS and rng.random() < 0.5:
            self.new_request()
        candidates = [r for r in self.active if r.num_tokens > r.num_computed_tokens
                      and r.num_tokens < MAX_LEN]
        rng.shuffle(candidates)
        scheduled, budget = [], MAX_TOKENS // 2
        for r in candidates:
            remaining = r.num_tokens - r.num_computed_tokens
            if budget <= 0 or rng.random() < 0.2:
                continue
            n = min(remaining, budget, rng.choice([remaining, remaining, rng.randint(1, remaining)]))
            table = self.tables[r.request_id]
            while len(table) * BS < r.num_computed_tokens + n:
                table.append(self.free_blocks.pop())
            self.batch.update(r, table)
            scheduled.append((r, n))
            budget -= n
        if not scheduled:
            return False
        pad_t = pad_r = None
        if pad:
            T = sum(n for _, n in scheduled)
            pad_t = min(MAX_TOKENS, T + rng.randint(0, 8))
            if all(n == 1 for _, n in scheduled) and rng.random() < 0.5:
                pad_r = min(MAX_SEQS, len(scheduled) + rng.randint(0, 3))
                pad_t = max(pad_t, pad_r)
        got = check_step(self.batch, scheduled, self.tables, self.prev_sample_pos, self.previous_tokens,
                         pad_t, pad_r)
        self.launch(scheduled, got, rng, mirror=True)
        # Finish some, preempt some (only without a token in flight, as the scheduler does).
        for r in list(self.active):
            if r.num_tokens >= MAX_LEN - 1 or rng.random() < 0.05:
                self.release(r)
            elif r.num_placeholders == 0 and rng.random() < 0.05:
                self.release(r, preempt=True)
        return True


@pytest.mark.parametrize("copier", ["torch", "driver"])
@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("seed", range(4))
def test_prepare_matches_rebuild_on_random_workloads(seed, pad, async_mode, copier):
    w = Workload(seed, async_mode, copier=copier)
    addresses = [t.data_ptr() for t in (w.batch.input_ids, w.batch.positions, w.batch.slot_mapping,
                                        w.batch.query_start_loc, w.batch.seq_lens, w.batch.step_block_table)]
    steps = placeholders = 0
    for _ in range(60):
        ph = sum(r.token_ids[r.num_computed_tokens:].count(PLACEHOLDER) for r in w.active)
        if w.step(pad):
            steps += 1
            placeholders += ph
    assert steps > 30
    assert (placeholders > 0) == async_mode, "the async run must feed placeholders, the sync run none"
    # Static device buffers: graphs captured over them stay valid.
    assert addresses == [t.data_ptr() for t in (w.batch.input_ids, w.batch.positions, w.batch.slot_mapping,
                                                w.batch.query_start_loc, w.batch.seq_lens,
                                                w.batch.step_block_table)]


def test_rows_are_reused_and_block_tables_append():
    batch = InputBatch(2, MAX_LEN, BS, MAX_TOKENS, torch.device("cpu"))
    a = Request("a", list(range(10, 17)), SimpleNamespace(max_tokens=8))
    b = Request("b", list(range(20, 23)), SimpleNamespace(max_tokens=8))
    ra, rb = batch.add(a), batch.add(b)
    assert ra != rb and batch.row_of == {"a": ra, "b": rb}
    with pytest.raises(RuntimeError, match="full"):
        batch.add(Request("c", [1], SimpleNamespace(max_tokens=1)))
    batch.update(a, [5, 9])
    tables = {"a": [5, 9], "b": [7]}
    batch.update(b, [7])
    check_step(batch, [(a, 7), (b, 3)], tables, {}, None)
    a.num_computed_tokens, b.num_computed_tokens = 7, 3
    a.append_output(42)
    batch.update(a)
    batch.update(a, [5, 9, 11])                  # appended block
    tables["a"] = [5, 9, 11]
    check_step(batch, [(a, 1)], tables, {}, None)
    # Preemption: the row starts over with fewer blocks, then grows again.
    batch.update(a, [])
    batch.update(a, [3, 4])
    a.num_computed_tokens = 0
    tables["a"] = [3, 4]
    check_step(batch, [(a, 8)], tables, {}, None)
    batch.remove("b")
    c = Request("c", [1, 2, 3, 4, 5], SimpleNamespace(max_tokens=3))
    assert batch.add(c) == rb                    # b's row, reused
    batch.update(c, [8, 2])
    tables["c"] = [8, 2]
    got = check_step(batch, [(c, 5), (a, 8)], tables, {}, None, pad_tokens_to=16)
    assert got.metadata.slot_mapping[13:].tolist() == [-1, -1, -1]
    batch.remove("a")
    batch.remove("a")                            # idempotent
    assert batch.row_of == {"c": rb}


def test_placeholder_without_a_step_in_flight_is_an_error():
    batch = InputBatch(2, MAX_LEN, BS, MAX_TOKENS, torch.device("cpu"))
    a = Request("a", [5, 6, 7], SimpleNamespace(max_tokens=4))
    batch.add(a)
    batch.update(a, [1])
    a.num_computed_tokens = 3
    a.append_output(PLACEHOLDER)
    batch.update(a)
    with pytest.raises(RuntimeError, match="placeholder"):
        batch.prepare([(a, 1)])


def test_set_token_after_release_is_harmless():
    batch = InputBatch(2, MAX_LEN, BS, MAX_TOKENS, torch.device("cpu"))
    a = Request("a", [5, 6, 7], SimpleNamespace(max_tokens=4))
    batch.add(a)
    batch.remove("a")
    batch.set_token("a", 3, 9)        # resolved after its request finished: ignored
    b = Request("b", [1, 2], SimpleNamespace(max_tokens=4))
    row = batch.add(b)
    batch.set_token("b", 5, 9)        # beyond what the row holds: ignored
    assert np.array_equal(batch.token_ids[row, :2], [1, 2])


@pytest.mark.parametrize("order", ["same", "reversed", "subset"])
def test_placeholders_take_previous_tokens_in_any_order(order):
    """Async decode steps: each placeholder input takes its own row's token of the previous step,
    whether the batch keeps its order (one device copy), reverses it or drops a row (gathers)."""
    rng = random.Random(order)
    batch = InputBatch(MAX_SEQS, MAX_LEN, BS, MAX_TOKENS, torch.device("cpu"))
    reqs = [Request(f"r{i}", [rng.randint(3, 999) for _ in range(rng.randint(1, 9))], SimpleNamespace(max_tokens=20))
            for i in range(5)]
    tables = {}
    for i, r in enumerate(reqs):
        batch.add(r)
        tables[r.request_id] = [10 * i + k + 1 for k in range(6)]
        batch.update(r, tables[r.request_id])
    first = batch.prepare([(r, r.num_tokens) for r in reqs])
    for r in reqs:
        r.num_computed_tokens = r.num_tokens
        r.append_output(PLACEHOLDER)
    sampled = torch.tensor([rng.randint(3, 999) for _ in first.sample_rows])
    step = {"same": reqs, "reversed": reqs[::-1], "subset": reqs[:1] + reqs[2:]}[order]
    got = batch.prepare([(r, 1) for r in step], previous_tokens=sampled)
    want = [int(sampled[first.sample_rows.index(r)]) for r in step]
    assert got.input_ids.tolist() == want


class DecodeWorkload(Workload):
    """Mostly decode steps in a stable order, handed over as the scheduler's fast path does
    (ScheduledBatch with rows, seq_lens, requests; the same rows array while nothing changes), so
    prepare keeps the device block table by appending; now and then an arrival, a finish, a
    preemption or a row whose blocks are replaced (same count, other ids) breaks the pattern."""

    def __init__(self, seed, async_mode, device="cpu", copier=None):
        super().__init__(seed, async_mode, device, copier)
        self.rows = None          # the last decode step's rows array, reused while unchanged
        self.decode_steps = self.appends = 0

    def step(self, pad):
        rng = self.rng
        if len(self.active) < MAX_SEQS and rng.random() < 0.1:
            self.new_request()
        if self.active and rng.random() < 0.03:          # blocks replaced without a rebind
            r = rng.choice(self.active)
            table = self.tables[r.request_id]
            self.free_blocks += table
            self.tables[r.request_id] = table = [self.free_blocks.pop(0) for _ in table]
            self.batch.update(r, [])
            self.batch.update(r, table)
        todo = [r for r in self.active if r.num_tokens > r.num_computed_tokens and r.num_tokens < MAX_LEN]
        if not todo:
            return False
        if any(r.num_tokens - r.num_computed_tokens > 1 for r in todo):
            scheduled, budget = [], MAX_TOKENS
            for r in todo:
                n = min(r.num_tokens - r.num_computed_tokens, budget)
                if n:
                    scheduled.append((r, n))
                    budget -= n
            self.rows = None
        else:
            scheduled = ScheduledBatch((r, 1) for r in todo)
            rows = np.array([self.batch.row_of[r.request_id] for r in todo], dtype=np.int64)
            if self.rows is None or not np.array_equal(rows, self.rows):
                self.rows = rows
            scheduled.rows, scheduled.requests = self.rows, list(todo)
            scheduled.num_new = np.ones(len(todo), np.int64)
            scheduled.seq_lens = np.array([r.num_tokens for r in todo], dtype=np.int64)
            self.decode_steps += 1
        grown = []
        for i, (r, n) in enumerate(scheduled):
            table = self.tables[r.request_id]
            before = len(table)
            while len(table) * BS < r.num_computed_tokens + n:
                table.append(self.free_blocks.pop())
            if isinstance(scheduled, ScheduledBatch) and len(table) == before + 1 and rng.random() < 0.9:
                grown.append(i)      # as the scheduler's fast path grows it: told to sync_rows
                self.batch.state.table_len[self.batch.row_of[r.request_id]] += 1
            else:
                self.batch.update(r, table)
        if isinstance(scheduled, ScheduledBatch):
            scheduled.grown = np.array(grown, dtype=np.int64)
            if grown and rng.random() < 0.7:
                scheduled.new_blocks = [self.tables[scheduled[i][0].request_id][-1] for i in grown]
            self.batch.sync_rows(scheduled, lambda rid: self.tables[rid])
            self.appends += len(grown)
        pad_t = pad_r = None
        if pad and isinstance(scheduled, ScheduledBatch) and rng.random() < 0.7:
            pad_r = min(MAX_SEQS, len(scheduled) + rng.choice([0, 0, 1, 3]))
            pad_t = pad_r
        got = check_step(self.batch, scheduled, self.tables, self.prev_sample_pos, self.previous_tokens,
                         pad_t, pad_r)
        self.launch(scheduled, got, rng, mirror=False)   # the rows reach the batch by sync_rows
        for r in list(self.active):
            if r.num_tokens >= MAX_LEN - 1 or rng.random() < 0.02:
                self.release(r)
                self.rows = None
            elif r.num_placeholders == 0 and rng.random() < 0.02:
                self.release(r, preempt=True)
                self.rows = None
        return True


@pytest.mark.parametrize("copier", list(COPIERS))
@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("seed", range(4))
def test_decode_steps_append_to_the_device_block_table(seed, pad, async_mode, copier, device="cpu"):
    """The all-decode path (device block table kept by appending, constant parts kept in the
    staging, in-order placeholders by one device copy) gives the same flat batch as the rebuild,
    its uploads made by torch, by the driver's interface (memmove on the CPU) or by torch after the
    driver refused them."""
    w = DecodeWorkload(seed, async_mode, device, copier)
    for _ in range(4):
        w.new_request()
    appended = 0
    for _ in range(150):
        before = w.batch.device_table.rows
        w.step(pad)
        appended += before is not None and w.batch.device_table.rows is before
    assert w.decode_steps > 80 and w.appends > 20
    assert appended > 40, "most decode steps should keep the device block table"
    if copier in ("driver", "refused"):
        assert w.batch.buffers.driver.calls >= w.decode_steps     # every step's upload asked it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(3))
def test_gpu_decode_steps_append_to_the_device_block_table(seed, async_mode):
    """The same on CUDA, where the appends are written by kernels/scatter.py's kernel (recorded
    launches, k changing from step to step) instead of index_copy_."""
    test_decode_steps_append_to_the_device_block_table(seed, True, async_mode, None, "cuda")


def test_invalidate_sends_everything_again():
    batch = InputBatch(2, MAX_LEN, BS, MAX_TOKENS, torch.device("cpu"))
    a = Request("a", [5, 6, 7], SimpleNamespace(max_tokens=8))
    batch.add(a)
    batch.update(a, [3])
    tables = {"a": [3, 8]}
    check_step(batch, [(a, 3)], tables, {}, None)
    a.num_computed_tokens = 3
    a.append_output(11)
    decode = ScheduledBatch([(a, 1)])
    decode.rows, decode.requests = np.array([batch.row_of["a"]]), [a]
    decode.num_new, decode.seq_lens = np.ones(1, np.int64), np.array([4])
    check_step(batch, decode, tables, {}, None)
    batch.update(a, [3, 8])
    batch.step_block_table.zero_()          # as a warm-up's dummy step does
    batch.invalidate()
    a.num_computed_tokens = 4
    a.append_output(12)
    decode.seq_lens = np.array([5])
    check_step(batch, decode, tables, {}, None)


def test_host_metadata_only_when_asked():
    """The host copies of query starts and sequence lengths (read by the torch reference backend
    only) are left out when the model runner says its backend does not read them; the device
    fields are the same."""
    outs = []
    for host in (True, False):
        batch = InputBatch(4, 64, 4, 32, torch.device("cpu"), host_metadata=host)
        reqs = []
        for i, n in enumerate((3, 6)):
            r = Request(f"h{i}", list(range(1, n + 1)), SimpleNamespace(max_tokens=4))
            batch.add(r)
            batch.update(r, [1 + i, 5 + i])
            reqs.append(r)
        outs.append(batch.prepare([(r, r.num_tokens) for r in reqs]))
    with_host, without = outs
    assert with_host.metadata.seq_lens_cpu.tolist() == [3, 6] and with_host.metadata.query_start_loc_cpu is not None
    assert without.metadata.seq_lens_cpu is None and without.metadata.query_start_loc_cpu is None
    for name in ("query_start_loc", "seq_lens", "slot_mapping"):
        assert torch.equal(getattr(with_host.metadata, name), getattr(without.metadata, name))
    assert torch.equal(with_host.input_ids, without.input_ids)
