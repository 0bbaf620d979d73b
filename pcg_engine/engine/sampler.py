"""The on-device sampler: [R, V] logits in, one token (and its logprobs) per row out.

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

The parts live in the files named after them: the per-row tensors the sampler reads in
`sampling_tensors.py`, the penalties, min_tokens masking and warpers in `logits_processors.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pcg_engine.engine.logits_processors import apply_min_tokens, apply_penalties, apply_warpers
from pcg_engine.engine.sampling_tensors import SamplingTensors


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                  # [R] int64, on the logits' device
    logprobs: torch.Tensor | None = None     # [R] float32: raw logprob of each sampled token
    top_ids: torch.Tensor | None = None      # [R, n] int64, n = max logprobs asked in the batch;
    top_logprobs: torch.Tensor | None = None  # [R, n] float32, descending; trim rows to own n


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
