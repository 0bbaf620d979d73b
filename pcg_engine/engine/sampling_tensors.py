"""The per-row sampling state on the device: what the sampler and the logits processors read.

Python objects (SamplingParams, token lists) are turned into device tensors once, when a request
enters a row, by `SamplingTensors.write_rows`; after that a step only gathers the rows that sample
(`select`) and counts the tokens they drew (`record_sampled`), both on the device, so the caller's
one read-back of the tokens stays the only host sync (DESIGN.md, "Async scheduling"). Host-side
flags ("does any row use top-p?") tell the sampler which whole stages it may skip.

Kept apart from `sampler.py` and `logits_processors.py` because its life is the request's, not
the step's: a row is written when a request is admitted and cleared when it finishes, and all a
step does here is select rows and count tokens; the sampler and the processors only read it.
"""

from __future__ import annotations

from hashlib import sha256
from typing import NamedTuple, Sequence

import torch

from pcg_engine.errors import InvalidRequestError
from pcg_engine.sampling_params import SamplingParams

# Per-row float fields written together in one host-to-device copy.
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")
_ROW_TENSORS = _FLOAT_FIELDS + ("top_k", "min_tokens", "num_output", "greedy", "stop_ids",
                                 "stop_valid")


class SamplingRow(NamedTuple):
    """One request as the sampler needs it. `eos_token_ids` is masked while min_tokens is not
    reached (unless ignore_eos); token ids must lie in [0, vocab_size)."""

    params: SamplingParams
    output_token_ids: Sequence[int] = ()
    prompt_token_ids: Sequence[int] = ()
    generator: torch.Generator | None = None
    eos_token_ids: int | Sequence[int] | None = None


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The private random stream of a seeded request; keep it for the request's lifetime."""
    g = torch.Generator(device=device)
    g.manual_seed(_cpu_seed(seed) if g.device.type == "cpu" else seed)
    return g


def _cpu_seed(seed: int) -> int:
    """torch's CPU generator (mt19937) keeps only a seed's low 32 bits: seeds that differed above
    them (1 and 2**32 + 1) drew the same tokens. A seed at or past 2**32 (negative ones as
    manual_seed reads them, modulo 2**64) is hashed down to 32 bits instead; smaller seeds are
    kept, so their streams are unchanged. (CUDA's generator takes all 64 bits.)"""
    seed %= 2**64
    if seed < 2**32:
        return seed
    return int.from_bytes(sha256(seed.to_bytes(8, "little")).digest()[:4], "little")


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    # A pageable host-to-device copy synchronises the stream; a pinned non_blocking one does not.
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class SamplingTensors:
    """Per-row sampling state on the device, plus host flags derived from the rows' params.

    Usable two ways. Per step: `SamplingTensors.from_rows(rows, V, device)`. Persistent (cheaper):
    keep one `empty(capacity, V, device)` store; `write_rows` when requests enter rows,
    `clear_rows` when they leave, `select(sample_rows)` each step to gather the rows that sample,
    and `record_sampled(tokens, sample_rows)` after it so output counts (penalties) and output
    lengths (min_tokens) advance on the device without the tokens ever visiting the host.
    Rows with params None are free; sampling one returns a harmless token.
    """

    def __init__(self, capacity: int, vocab_size: int, device: torch.device | str):
        self.vocab_size = vocab_size
        self.device = dev = torch.device(device)
        for name in _FLOAT_FIELDS:
            neutral = 1.0 if name in ("temperature", "top_p", "repetition_penalty") else 0.0
            setattr(self, name, torch.full((capacity,), neutral, dtype=torch.float32, device=dev))
        self.top_k = torch.full((capacity,), vocab_size, dtype=torch.int64, device=dev)
        self.min_tokens = torch.zeros(capacity, dtype=torch.int32, device=dev)
        self.num_output = torch.zeros(capacity, dtype=torch.int32, device=dev)
        self.greedy = torch.ones(capacity, dtype=torch.bool, device=dev)
        # EOS + stop ids masked while num_output < min_tokens; padding is id 0 with valid False.
        self.stop_ids = torch.zeros(capacity, 0, dtype=torch.int64, device=dev)
        self.stop_valid = torch.zeros(capacity, 0, dtype=torch.bool, device=dev)
        # [R, V], allocated only once some row uses a penalty.
        self.prompt_mask: torch.Tensor | None = None
        self.output_counts: torch.Tensor | None = None
        self.params: list[SamplingParams | None] = [None] * capacity
        self.generators: list[torch.Generator | None] = [None] * capacity
        self._refresh_flags()

    @classmethod
    def empty(cls, capacity: int, vocab_size: int, device: torch.device | str) -> SamplingTensors:
        return cls(capacity, vocab_size, device)

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingRow | tuple], vocab_size: int,
                  device: torch.device | str) -> SamplingTensors:
        t = cls(len(rows), vocab_size, device)
        t.write_rows(range(len(rows)), rows)
        return t

    @property
    def num_rows(self) -> int:
        return len(self.params)

    def write_rows(self, indices: Sequence[int], rows: Sequence[SamplingRow | tuple]) -> None:
        """Put requests into rows. Everything is checked on the host before anything is written,
        so a refused request leaves the store as it was. A seeded row without a generator gets a
        fresh one (read it back from `self.generators` if you rebuild per step)."""
        indices = list(indices)
        rows = [r if isinstance(r, SamplingRow) else SamplingRow(*r) for r in rows]
        V = self.vocab_size
        floats, ints, greedy, stops, gens = [], [], [], [], []
        pen_rows, pen_prompt, pen_output = [], [], []
        for i, r in zip(indices, rows):
            p = r.params
            g = p.greedy
            # Greedy rows get neutral warpers: they skip them anyway, and it keeps flags honest.
            floats.append([1.0 if g else p.temperature, 1.0 if g else p.top_p,
                           0.0 if g else p.min_p, p.repetition_penalty, p.presence_penalty,
                           p.frequency_penalty])
            k = p.top_k if (not g and 0 < p.top_k < V) else V
            ints.append([k, p.min_tokens, len(r.output_token_ids)])
            greedy.append(g)
            ids: list[int] = []
            if p.min_tokens > 0:
                eos = r.eos_token_ids
                if eos is not None and not p.ignore_eos:
                    ids += [eos] if isinstance(eos, int) else list(eos)
                ids += p.stop_token_ids
                self._check_ids("stop_token_ids", ids)
            stops.append(ids)
            gen = r.generator
            if g:
                gen = None
            elif gen is None and p.seed is not None:
                gen = make_generator(p.seed, self.device)
            gens.append(gen)
            if _uses_penalties(p):
                pen_rows.append(i)
                pen_prompt.append(self._check_ids("prompt_token_ids", r.prompt_token_ids))
                pen_output.append(self._check_ids("output_token_ids", r.output_token_ids))

        dev = self.device
        idx = _to_device(torch.tensor(indices, dtype=torch.int64), dev)
        f = _to_device(torch.tensor(floats, dtype=torch.float32).reshape(-1, 6), dev)
        for c, name in enumerate(_FLOAT_FIELDS):
            getattr(self, name)[idx] = f[:, c]
        n = _to_device(torch.tensor(ints, dtype=torch.int64).reshape(-1, 3), dev)
        self.top_k[idx] = n[:, 0]
        self.min_tokens[idx] = n[:, 1].int()
        self.num_output[idx] = n[:, 2].int()
        self.greedy[idx] = _to_device(torch.tensor(greedy, dtype=torch.bool), dev)
        self._write_stops(idx, stops)
        if pen_rows:
            self._write_penalty_tokens(pen_rows, pen_prompt, pen_output)
        # The flags scan every row: skip it when no row's contribution changes (the engine writes
        # and clears a row per admission and per finish; most rows are plain greedy).
        neutral = (all(_flag_neutral(self.params[i]) for i in indices)
                   and all(_flag_neutral(r.params) for r in rows))
        for i, r, gen in zip(indices, rows, gens):
            self.params[i] = r.params
            self.generators[i] = gen
        if not neutral:
            self._refresh_flags()

    def clear_rows(self, indices: Sequence[int]) -> None:
        neutral = all(_flag_neutral(self.params[i]) for i in indices)   # as in write_rows
        for i in indices:
            self.params[i] = None
            self.generators[i] = None
        if not neutral:
            self._refresh_flags()

    def select(self, rows: Sequence[int]) -> SamplingTensors:
        """The tensors of `rows` (host indices) in that order, for one step's logits rows.
        Generators are shared, not copied, so their streams advance in the store."""
        out = SamplingTensors.__new__(SamplingTensors)
        out.vocab_size, out.device = self.vocab_size, self.device
        idx = _to_device(torch.tensor(list(rows), dtype=torch.int64), self.device)
        for name in _ROW_TENSORS:
            setattr(out, name, getattr(self, name).index_select(0, idx))
        out.params = [self.params[i] for i in rows]
        out.generators = [self.generators[i] for i in rows]
        pen = self.output_counts is not None and any(
            p is not None and _uses_penalties(p) for p in out.params)
        out.prompt_mask = self.prompt_mask.index_select(0, idx) if pen else None
        out.output_counts = self.output_counts.index_select(0, idx) if pen else None
        out._refresh_flags()
        return out

    def record_sampled(self, token_ids: torch.Tensor,
                       rows: Sequence[int] | torch.Tensor | None = None, count: int = 1) -> None:
        """Count this step's sampled tokens (device tensor [n]) into rows (all, in order, if
        None). Pure device work: async scheduling never has to read the tokens back first.
        count=-1 takes back a count made for a step that then failed to launch."""
        if rows is None:
            idx = torch.arange(token_ids.shape[0], device=self.device)
        elif isinstance(rows, torch.Tensor):
            idx = rows.to(self.device, non_blocking=True)
        else:
            idx = _to_device(torch.tensor(list(rows), dtype=torch.int64), self.device)
        self.num_output.index_add_(0, idx, torch.full_like(idx, count, dtype=torch.int32))
        if self.output_counts is not None:
            flat = idx * self.vocab_size + token_ids.to(torch.int64)
            ones = torch.full_like(flat, count, dtype=torch.int32)
            self.output_counts.view(-1).index_add_(0, flat, ones)

    # -- internals ---------------------------------------------------------------------------

    def _check_ids(self, field: str, ids: Sequence[int]) -> torch.Tensor:
        # A bad id would fault the device scatter and take the whole batch down; refuse it here.
        t = torch.as_tensor(list(ids), dtype=torch.int64)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.vocab_size):
            raise InvalidRequestError(
                field, f"token ids must be in [0, {self.vocab_size - 1}], got min {int(t.min())}"
                f" max {int(t.max())}")
        return t

    def _write_stops(self, idx: torch.Tensor, stops: list[list[int]]) -> None:
        width = max([len(x) for x in stops] + [self.stop_ids.shape[1]])
        if width > self.stop_ids.shape[1]:  # widen for every row; old rows pad with invalid 0
            pad = (0, width - self.stop_ids.shape[1])
            self.stop_ids = torch.nn.functional.pad(self.stop_ids, pad)
            self.stop_valid = torch.nn.functional.pad(self.stop_valid, pad)
        if width:
            ids = torch.tensor([x + [0] * (width - len(x)) for x in stops], dtype=torch.int64)
            valid = torch.tensor([[j < len(x) for j in range(width)] for x in stops])
            self.stop_ids[idx] = _to_device(ids.reshape(-1, width), self.device)
            self.stop_valid[idx] = _to_device(valid.reshape(-1, width), self.device)

    def _write_penalty_tokens(self, rows: list[int], prompts: list[torch.Tensor],
                              outputs: list[torch.Tensor]) -> None:
        R, V, dev = self.num_rows, self.vocab_size, self.device
        if self.output_counts is None:
            self.prompt_mask = torch.zeros(R, V, dtype=torch.bool, device=dev)
            self.output_counts = torch.zeros(R, V, dtype=torch.int32, device=dev)
        idx = _to_device(torch.tensor(rows, dtype=torch.int64), dev)
        self.prompt_mask[idx] = False
        self.output_counts[idx] = 0

        def flat(toks: list[torch.Tensor]) -> torch.Tensor:
            offs = [torch.full_like(t, r * V) for r, t in zip(rows, toks)]
            return _to_device(torch.cat(toks) + torch.cat(offs), dev)

        self.prompt_mask.view(-1)[flat(prompts)] = True
        out = flat(outputs)
        self.output_counts.view(-1).index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def _refresh_flags(self) -> None:
        """Host flags from the rows' params: which stages the sampler may skip this step."""
        # One plain loop: this runs whenever rows change or a step selects its rows.
        V = self.vocab_size
        rep = pres_freq = min_tokens = min_p = top_p = full_sort = False
        top_k, n_logprobs, n_random, seeded = 0, -1, 0, []
        for i, p in enumerate(self.params):
            if p is None:
                continue
            rep |= p.repetition_penalty != 1.0
            pres_freq |= p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            min_tokens |= p.min_tokens > 0
            if p.logprobs is not None:
                n_logprobs = max(n_logprobs, p.logprobs)
            if p.greedy:
                continue
            n_random += 1
            min_p |= p.min_p > 0.0
            top_p |= p.top_p < 1.0
            if 0 < p.top_k < V:
                top_k = max(top_k, p.top_k)
            elif p.top_p < 1.0:
                full_sort = True
            if self.generators[i] is not None:
                seeded.append(i)
        self.all_greedy = n_random == 0
        self.any_greedy = n_random < self.num_rows  # free rows count as greedy
        self.any_repetition, self.any_presence_frequency = rep, pres_freq
        self.any_penalties = rep or pres_freq
        self.any_min_tokens, self.any_min_p, self.any_top_p = min_tokens, min_p, top_p
        self.max_top_k, self.max_logprobs = top_k, n_logprobs
        self.top_p_full_sort = full_sort  # some top-p row has no top-k to bound its nucleus
        self.seeded_rows = tuple(seeded)
        self.any_unseeded_random = len(seeded) < n_random


def _uses_penalties(p: SamplingParams) -> bool:
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0)


def _flag_neutral(p: SamplingParams | None) -> bool:
    """A row that adds to no host flag in _refresh_flags (free, or greedy with no penalties,
    min_tokens or logprobs): putting one in or taking one out leaves every flag as it was."""
    return p is None or (p.greedy and p.logprobs is None and p.min_tokens <= 0
                         and not _uses_penalties(p))
