"""What the engine returns: per request, its tokens, text, finish reason and timing."""

from dataclasses import dataclass, field


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


@dataclass
class RequestOutput:
    """Cumulative state of one request; `new_token_ids` / `new_text` are this step's delta."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None            # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None
    metrics: RequestMetrics
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    logprobs: list[dict] | None = None   # per output token: {"token": id, "logprob": x, "top": [(id, x), ...]}
    prompt: str | None = None
    error: str | None = None
