"""What the engine returns: per request, its tokens, text, finish reason and timing.

The engine makes one RequestOutput per request per step (256 of them a step at batch 256), so
building one must cost well under a microsecond: the cumulative token list and the metrics are
taken from the request only when read. Both are snapshots of the step that made the output: the
tokens are a prefix of the request's token list of fixed length (outputs are only ever appended
behind it, and a step's trailing placeholders are excluded), and the finish time shows only on the
output that finished the request.
"""

from abc import ABCMeta
from dataclasses import dataclass


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


class RequestOutput(metaclass=ABCMeta):
    """Cumulative state of one request; `new_token_ids` / `new_text` are this step's delta.

    Fields: request_id, prompt_token_ids, token_ids (outputs so far), text, finished,
    finish_reason ("stop", "length", "abort", "error" or None while running), stop_reason (the stop
    token or string), metrics (RequestMetrics), new_token_ids, new_text, logprobs (per output
    token: {"token": id, "logprob": x, "top": [(id, x), ...]}), prompt (the text as given to
    add_request, even where truncate_prompt_tokens cut its ids; None for a prompt of token ids),
    error (always None: the engine refuses a bad request when it is added, by raising).
    """

    __slots__ = ("text", "finished", "new_token_ids", "new_text", "_logprobs", "_request", "_end", "_token_ids",
                 "_metrics")
    # (ABCMeta only so that DecodeOutput, a tuple for speed, can be registered as one.)
    error = None

    def __init__(self, request, end: int, text: str, finished: bool, new_token_ids: list[int],
                 new_text: str = "", logprobs: list[dict] | None = None):
        self.text, self.finished = text, finished
        # The engine's list of the request's logprobs, which grows after this step: read as a prefix.
        self.new_token_ids, self.new_text, self._logprobs = new_token_ids, new_text, logprobs
        self._request, self._end = request, end     # _token_ids and _metrics: set when first read

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def prompt(self) -> str | None:
        # (a class attribute None before, outside __slots__: never set, and read-only to callers)
        return self._request.prompt

    @property
    def prompt_token_ids(self) -> list[int]:
        # A copy: the request's own list, changed in place by a caller (ctx = out.prompt_token_ids;
        # ctx += out.token_ids), lengthened the running request's prompt and ran it past max_tokens.
        return list(self._request.prompt_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self._request.finish_reason if self.finished else None

    @property
    def stop_reason(self) -> int | str | None:
        return self._request.stop_reason if self.finished else None

    @property
    def token_ids(self) -> list[int]:
        try:
            return self._token_ids
        except AttributeError:
            self._token_ids = self._request.token_ids[len(self._request.prompt_token_ids):self._end]
            return self._token_ids

    @property
    def logprobs(self) -> list[dict] | None:
        """This step's snapshot, like token_ids: one entry per output token so far. (The engine's
        list itself, read after later steps, held their entries too.)"""
        lps = self._logprobs
        if lps is None or self.finished:        # a finished request's list grows no more
            return lps
        return lps[:self._end - len(self._request.prompt_token_ids)]

    @property
    def metrics(self) -> RequestMetrics:
        try:
            return self._metrics
        except AttributeError:
            r = self._request
            self._metrics = RequestMetrics(r.arrival_time, r.first_scheduled_time, r.first_token_time,
                                           r.finish_time if self.finished else None, r.num_cached_tokens)
            return self._metrics

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, token_ids={self.token_ids}, text={self.text!r}, "
                f"finished={self.finished}, finish_reason={self.finish_reason!r}, "
                f"new_token_ids={self.new_token_ids}, new_text={self.new_text!r})")


class DecodeOutput(tuple):
    """The output of a request that got one token and no text this step and did not finish. The
    engine's bulk booking makes one per streaming row per step (256 a step at batch 256), so it is
    the tuple (request, end, token), built by tuple's own constructor in C from
    zip(requests, ends, tokens): no Python __init__ runs (which was ~60% of its cost). It reads like
    a RequestOutput and is registered as one (isinstance holds); the token lists and the metrics
    are made on each read (it has no fields to keep them in), new_token_ids is read-only."""

    __slots__ = ()
    text = new_text = ""
    finished = False
    logprobs = finish_reason = stop_reason = error = None

    @property
    def prompt(self) -> str | None:
        return self[0].prompt

    @property
    def request_id(self) -> str:
        return self[0].request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self[0].prompt_token_ids)      # a copy, as RequestOutput's

    @property
    def new_token_ids(self) -> list[int]:
        return [self[2]]

    @property
    def token_ids(self) -> list[int]:
        request = self[0]
        return request.token_ids[len(request.prompt_token_ids):self[1]]

    @property
    def metrics(self) -> RequestMetrics:
        r = self[0]
        return RequestMetrics(r.arrival_time, r.first_scheduled_time, r.first_token_time, None, r.num_cached_tokens)

    __repr__ = RequestOutput.__repr__


RequestOutput.register(DecodeOutput)


def abandoned(output) -> bool:
    """Whether the output's request was abandoned (LLMEngine.abandon): nobody wants it any more."""
    return (output[0] if isinstance(output, DecodeOutput) else output._request).abandoned
