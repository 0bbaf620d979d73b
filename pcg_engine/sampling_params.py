"""Sampling parameters of one request, checked when they are made (DESIGN.md, "Bad input").

Every refusal is an InvalidRequestError naming the field and the range it may hold, so a client
can fix its request; nothing here touches the batch the request would have joined.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, Mapping

import numpy as np

from pcg_engine.errors import InvalidRequestError

# Temperatures below this are treated as greedy: dividing float32 logits by them overflows to inf
# (then NaN in softmax), and the distribution they describe is argmax to float32 precision anyway.
GREEDY_TEMPERATURE = 1e-5
# And above this it is refused: the per-row temperatures are float32, where a float64-finite value
# past ~3.4e38 is inf; x / inf is 0 for every finite logit (top_k, top_p, min_p then keep every
# token) and NaN for a -inf one (min_tokens' masked EOS: the row's softmax is all NaN and it draws
# token 0 every step). At 1e6 the distribution is uniform to float32 precision already.
MAX_TEMPERATURE = 1e6
TEMPERATURE_RANGE = "in [0, 1e6] (0 means greedy)"   # the error's wording, here and in the benchmarks' flag
MAX_LOGPROBS = 20
# Distinct stop token ids a request may give. The sampler keeps them per row in a [rows, widest
# list] table (min_tokens masks them, row_state checks each sampled token against them), so one
# request's list sets the table's width for every row: 200,000 ids held 439 MiB at 256 rows for
# the engine's life. 4,096 (every newline token of a large vocabulary, say) costs ~9 MiB at 256 rows.
MAX_STOP_TOKEN_IDS = 4096
# Stop strings a request may give, and their length. Each is searched for in the request's new
# text every step, and the longest one sets how much text is held back: one request with a million
# of them slowed every step of its batch 84-fold on the dev machine (a review's probe). OpenAI's API
# takes 4; these bounds leave room for any real use.
MAX_STOP_STRINGS = 256
MAX_STOP_CHARS = 1024
# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


def _is_int(v: Any) -> bool:
    # bool is an int subclass; `True` for max_tokens is a client bug, not a 1. numpy's integers
    # are Integral (and come back as plain ints from _check_int).
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _check_int(name: str, v: Any, lo: int | None, hi: int | None, rng: str) -> int:
    if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidRequestError(name, f"must be an integer {rng}, got {v!r}")
    return int(v)


def finite_float(v: Any) -> float | None:
    """v as a finite float, or None where it is not a real number (bool excluded) or not finite.
    An int past float's range (10**400: Python's json keeps a request's integers exact) is not
    finite here, where math.isfinite and float() raise OverflowError, which no caller expects."""
    if not isinstance(v, numbers.Real) or isinstance(v, (bool, np.bool_)):
        return None
    try:
        f = float(v)
    except (OverflowError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _check_float(name: str, v: Any, ok, rng: str) -> float:
    f = finite_float(v)
    if f is None or not ok(f):
        raise InvalidRequestError(name, f"must be a finite number {rng}, got {v!r}")
    return f


def _check_bool(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise InvalidRequestError(name, f"must be true or false, got {v!r}")


@dataclass
class SamplingParams:
    """How to pick the tokens of one request. Defaults give plain sampling at temperature 1."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    # Completions per prompt. Only 1: a client written for engines that sample several (n=4) gets a
    # refusal naming the field instead of a TypeError, or one completion where it asked for four.
    n: int = 1

    def __post_init__(self) -> None:
        self.n = _check_int("n", self.n, 1, 1, "equal to 1 (one completion per request: add the prompt n "
                            "times, with different seeds, for n samples)")
        self.max_tokens = _check_int("max_tokens", self.max_tokens, 1, None, ">= 1")
        self.temperature = _check_float("temperature", self.temperature,
                                        lambda v: 0 <= v <= MAX_TEMPERATURE,
                                        TEMPERATURE_RANGE)
        self.top_p = _check_float("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
        if not _is_int(self.top_k) or not self.top_k >= -1:
            raise InvalidRequestError(
                "top_k", f"must be -1 or 0 (disabled) or an integer >= 1, got {self.top_k!r}")
        # 0 is off too, as in transformers' generate and vLLM: a request carrying a Hugging Face
        # generation config's "top_k": 0 was refused (found by a review).
        self.top_k = int(self.top_k) or -1
        self.min_p = _check_float("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
        # Bounded: the penalty divides float32 logits, and below ~1e-38 it is 0 there (every logit
        # then inf or NaN: token 0 for every row it touches).
        self.repetition_penalty = _check_float(
            "repetition_penalty", self.repetition_penalty, lambda v: 0.01 <= v <= 100, "in [0.01, 100] (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _check_float(name, getattr(self, name),
                                             lambda v: -2 <= v <= 2, "in [-2, 2]"))
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed, _SEED_MIN, _SEED_MAX,
                       f"in [{_SEED_MIN}, {_SEED_MAX}] or null")
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        _check_bool("ignore_eos", self.ignore_eos)
        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS,
                       f"in [0, {MAX_LOGPROBS}] or null")
        self.min_tokens = _check_int("min_tokens", self.min_tokens, 0, None, ">= 0")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "min_tokens", f"must be in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens}")
        _check_bool("detokenize", self.detokenize)
        if self.stop and not self.detokenize:
            # Stop strings are found in the output text: honouring them would detokenize anyway.
            raise InvalidRequestError(
                "stop", f"stop strings ({self.stop!r}) are matched on the output text, but detokenize is "
                "False; allowed: detokenize=True with stop, or stop_token_ids without detokenizing")
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, None,
                       ">= 1 or null")
        _check_bool("skip_special_tokens", self.skip_special_tokens)

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)):
            raise InvalidRequestError(
                "stop", f"must be a non-empty string or a list of them, got {stop!r}")
        for s in items:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(
                    "stop", f"must be a non-empty string or a list of non-empty strings, "
                    f"got item {s!r}")
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:     # a lone surrogate: no decoded text can ever contain it
                raise InvalidRequestError("stop", f"item {s!r} is not valid Unicode text: {e.reason} at "
                                          f"character {e.start}") from None
            if len(s) > MAX_STOP_CHARS:
                raise InvalidRequestError("stop", f"item {s[:20]!r}... has {len(s)} characters; allowed: 1 to "
                                          f"{MAX_STOP_CHARS}")
        distinct = list(dict.fromkeys(items))    # a repeat stops nothing more
        if len(distinct) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"holds {len(distinct)} distinct strings; allowed: at most "
                                      f"{MAX_STOP_STRINGS}")
        return distinct

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise InvalidRequestError(
                "stop_token_ids", f"must be a list of integers >= 0, got {ids!r}")
        for t in ids:
            if not _is_int(t) or t < 0:
                raise InvalidRequestError(
                    "stop_token_ids", f"must be a list of integers >= 0, got item {t!r}")
        distinct = list(dict.fromkeys(int(t) for t in ids))    # a repeat stops nothing more
        if len(distinct) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("stop_token_ids", f"holds {len(distinct)} distinct ids; allowed: at most "
                                      f"{MAX_STOP_TOKEN_IDS}")
        return distinct

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """Build from a client's mapping (e.g. a JSON body); unknown names are refused, not dropped,
        since a silently ignored typo ("temprature") gives the client wrong output with no hint."""
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise InvalidRequestError("sampling_params", f"must be an object, got {d!r}")
        allowed = cls.field_names()
        for name in d:
            if name not in allowed:
                raise InvalidRequestError(
                    str(name), f"unknown sampling parameter; allowed: {', '.join(allowed)}")
        return cls(**d)

    @classmethod
    def from_kwargs(cls, **kw: Any) -> SamplingParams:
        return cls.from_dict(kw)

    def validate_against_model(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must index its vocabulary, or the sampler's
        scatter would fault on the device and take the whole batch with it."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise InvalidRequestError(
                    "stop_token_ids", f"must be in [0, {vocab_size - 1}] (the model's vocabulary),"
                    f" got {t}")
