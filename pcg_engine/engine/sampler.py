"""The on-device sampler and the per-row tensors it reads.

Every decode step samples R rows of a [R, V] logits tensor. Python objects (SamplingParams,
token lists) are turned into device tensors once, when a request enters a row, by
`SamplingTensors.write_rows`; a step then costs only kernels: no `.item()`, no `.tolist()`, no
branching on tensor values, so the caller's one read-back of the tokens is the only host sync
(DESIGN.md, "Async scheduling"). Host-side flags ("does any row use top-p?") skip whole stages.

Order, as in common engines: repetition / presence / frequency penalties, min_tokens masking of
EOS and stop ids, then (random rows) temperature, min_p, top_k, top_p, exponential-race sampling.
Greedy rows take the argmax after the penalties and min_tokens masking.

Returned logprobs are of the model's raw distribution: log_softmax of the logits as given, before
penalties, masking and temperature. That is what the model believes, it does not change when a
client tweaks sampling knobs, and it needs no second softmax of the processed logits.

Reproducibility: a row with a seed draws its noise from its own torch.Generator, made once per
request and kept for the request's lifetime, one [V] draw per step it samples. Its tokens then
depend only on its seed, its logits and its step count, not on the batch or the row it sits in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from pcg_engine.errors import InvalidRequestError
from pcg_engine.sampling_params import SamplingParams

_NEG_INF = float("-inf")
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


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                  # [R] int64, on the logits' device
    logprobs: torch.Tensor | None = None     # [R] float32: raw logprob of each sampled token
    top_ids: torch.Tensor | None = None      # [R, n] int64, n = max logprobs asked in the batch;
    top_logprobs: torch.Tensor | None = None  # [R, n] float32, descending; trim rows to own n


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The private random stream of a seeded request; keep it for the request's lifetime."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


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
                       rows: Sequence[int] | torch.Tensor | None = None) -> None:
        """Count this step's sampled tokens (device tensor [n]) into rows (all, in order, if
        None). Pure device work: async scheduling never has to read the tokens back first."""
        if rows is None:
            idx = torch.arange(token_ids.shape[0], device=self.device)
        elif isinstance(rows, torch.Tensor):
            idx = rows.to(self.device, non_blocking=True)
        else:
            idx = _to_device(torch.tensor(list(rows), dtype=torch.int64), self.device)
        self.num_output.index_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))
        if self.output_counts is not None:
            flat = idx * self.vocab_size + token_ids.to(torch.int64)
            ones = torch.ones_like(flat, dtype=torch.int32)
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


class Sampler:
    """Turns [R, V] logits into tokens. `generator` is the stream shared by rows without a seed
    (None: torch's default generator of the logits' device)."""

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != t.num_rows:
            raise ValueError(f"logits must be [{t.num_rows}, V], got {tuple(logits.shape)}")
        edit = not t.all_greedy or t.any_penalties or t.any_min_tokens
        # A private float32 copy when anything edits the logits: the caller's stay untouched and
        # bf16 input is fine. Plain greedy takes the argmax as given (exact in bf16 too).
        x = logits.to(torch.float32, copy=True) if edit else logits
        # Logprobs of the raw distribution, logit - logsumexp: no [R, V] log_softmax is written,
        # and the top-n come from the logits in their own (narrower) dtype.
        lse = torch.logsumexp(x.float(), dim=-1, keepdim=True) if t.max_logprobs >= 0 else None
        if edit:
            apply_penalties(x, t)
            apply_min_tokens(x, t)
        if t.all_greedy:
            tokens = x.argmax(dim=-1)
        else:
            greedy_tokens = x.argmax(dim=-1) if t.any_greedy else None
            apply_warpers(x, t, None if t.any_penalties or t.any_min_tokens else logits)
            probs = x.softmax(dim=-1)
            tokens = probs.div_(self._exponential_noise(probs, t)).argmax(dim=-1)
            if greedy_tokens is not None:
                tokens = torch.where(t.greedy, greedy_tokens, tokens)
        out = SamplerOutput(token_ids=tokens)
        if lse is not None:
            out.logprobs = (logits.gather(1, tokens[:, None]).float() - lse).squeeze(1)
            if t.max_logprobs > 0:
                top, out.top_ids = logits.topk(min(t.max_logprobs, logits.shape[1]), dim=-1)
                out.top_logprobs = top.float() - lse
        return out

    def _exponential_noise(self, probs: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """q ~ Exponential(1) per entry; argmax(p / q) is then a sample of p (the exponential
        race), with no cumsum or searchsorted and one random number per token per row."""
        q = torch.empty_like(probs)
        if t.any_unseeded_random:
            q.exponential_(generator=self.generator)
        # One [V] draw per seeded row from its own stream: unavoidable with per-request
        # generators, and it makes the row's noise independent of its neighbours.
        for i in t.seeded_rows:
            q[i].exponential_(generator=t.generators[i])
        # The CPU exponential_ may return exactly 0 (CUDA's never does: it maps curand's (0, 1]
        # away from log(1) = 0); 0/0 would be NaN, which argmax prefers to anything.
        if q.device.type != "cuda":
            q.clamp_min_(torch.finfo(torch.float32).tiny)
        return q


def apply_penalties(x: torch.Tensor, t: SamplingTensors) -> None:
    """In place on float32 [R, V]: repetition (prompt + output), then frequency and presence."""
    counts = t.output_counts
    if t.any_repetition:
        # Seen tokens become less likely whatever their sign: divide positive, multiply negative.
        rep = t.repetition_penalty[:, None]
        seen = t.prompt_mask | (counts > 0)
        x.copy_(torch.where(seen, torch.where(x > 0, x / rep, x * rep), x))
    if t.any_presence_frequency:
        c = counts.to(torch.float32)
        x.sub_(t.frequency_penalty[:, None] * c + t.presence_penalty[:, None] * (c > 0))


def apply_min_tokens(x: torch.Tensor, t: SamplingTensors) -> None:
    """In place: -inf on EOS / stop ids of rows whose output is still shorter than min_tokens."""
    if not t.any_min_tokens or not t.stop_ids.shape[1]:
        return
    active = (t.num_output < t.min_tokens)[:, None] & t.stop_valid
    # scatter_add, not scatter: padded and duplicate ids then add 0 / -inf in any order.
    x.scatter_add_(1, t.stop_ids, torch.where(active, _NEG_INF, 0.0))


def apply_warpers(x: torch.Tensor, t: SamplingTensors, raw: torch.Tensor | None = None) -> None:
    """In place: temperature, then min_p, top_k, top_p, all folded into one -inf mask.

    `raw`: the logits x was copied from, when nothing but the temperature has changed x since
    (no penalties, no min_tokens). Sorting / selecting them in their own dtype (bf16 sorts in
    half the time of float32) orders the tokens exactly as x does."""
    x.div_(t.temperature[:, None])
    thr = None
    if t.any_min_p:
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p); no softmax needed.
        thr = x.amax(dim=-1, keepdim=True) + t.min_p.log()[:, None]
    if t.max_top_k or t.any_top_p:
        kp = _top_k_top_p_threshold(x if raw is None else raw, t, thr, scale=raw is not None)
        # Each stage keeps the logits above a per-row threshold, so the chain is their maximum.
        thr = kp if thr is None else torch.maximum(thr, kp)
    if thr is not None:
        x.masked_fill_(x < thr, _NEG_INF)


def _top_k_top_p_threshold(src: torch.Tensor, t: SamplingTensors, min_p_thr: torch.Tensor | None,
                           scale: bool) -> torch.Tensor:
    """[R, 1] logit below which top-k / top-p drop a token. Ties with the cut are kept, and top-p
    renormalises over what top-k (ties included) and min_p keep, as the sequential chain does."""
    partial = not t.top_p_full_sort
    if partial:
        # Every top-p row also has a top-k: its nucleus lies inside the top max_top_k logits, so a
        # partial selection replaces the full-vocab sort (Qwen's defaults, top_k=20 top_p=0.8).
        s = src.topk(t.max_top_k, dim=-1).values
    else:
        s = src.sort(dim=-1, descending=True).values
    width = s.shape[1]
    k_idx = (t.top_k.clamp(max=width) - 1)[:, None]  # top_k is V where off
    kth_src = s.gather(1, k_idx)
    outside = None
    if partial and t.any_top_p:  # tokens tied with the k-th beyond the selection are kept too
        outside = (src == kth_src).sum(-1, keepdim=True) - (s == kth_src).sum(-1, keepdim=True)
    if scale:  # the very float32 values x holds, by the same division
        s = s.float().div_(t.temperature[:, None])
    # Rows over width have top-k off (partial path only; their top_p is then 1 too).
    kth = torch.where((t.top_k > width)[:, None], _NEG_INF, s.gather(1, k_idx))
    if not t.any_top_p:
        return kth
    s.masked_fill_(s < (kth if min_p_thr is None else torch.maximum(kth, min_p_thr)), _NEG_INF)
    probs = s.softmax(dim=-1)
    top_p = t.top_p[:, None]
    if outside is not None:  # each weighs what the k-th does: scale the target mass to match
        top_p = top_p * (1 + outside * probs.gather(1, k_idx))
    cum = probs.cumsum_(dim=-1)
    # Keep token j while the mass before it is below top_p; the first is always kept.
    n = (cum[:, :-1] < top_p).sum(dim=-1, keepdim=True) + 1
    # Rounding must not trim a row whose top-p is off.
    p_thr = torch.where(t.top_p[:, None] >= 1.0, _NEG_INF, s.gather(1, n - 1))
    return torch.maximum(kth, p_thr)
