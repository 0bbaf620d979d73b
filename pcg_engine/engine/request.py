"""One generation request: its tokens, how far they are computed, and where it is in its life.

A plain data model. The scheduler moves requests between states and the engine fills in tokens and
times; nothing here decides anything.
"""

import enum
import time
from typing import Any

# Stands for a sampled token that is still on the device (async scheduling). Never a real token id,
# so a block holding one can be recognised and kept out of the prefix cache.
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"              # blocks released; waits at the front of the queue to recompute
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """The user-facing reason ("stop", "length", "abort", "error"), None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """token_ids = prompt + outputs. Outputs may end in PLACEHOLDERs while their step is in flight.

    num_computed_tokens counts the tokens (from the start) whose KV is written, or will be by a
    launched step: with async scheduling it advances at launch, before the step's tokens are known.

    While the request holds a row of the persistent batch it is a BoundRequest (row_state.py): the
    same object, its class switched, its tokens and counts kept in the row.
    """

    _rows = None        # the RowState of a BoundRequest
    _row = -1
    abandoned = False   # LLMEngine.abandon: its caller wants none of its outputs
    prompt = None       # the prompt text as given (LLMEngine.add_request); None for token ids

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: Any,
                 arrival_time: float | None = None, eos_token_id: int | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.eos_token_id = eos_token_id

        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0       # prefix-cache hit when first scheduled
        self.num_placeholders = 0        # PLACEHOLDERs among the outputs
        self.num_preemptions = 0

        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None   # the stop token or string, when one stopped it

        # For quick tests in the per-step loops: a token outside stop_token_set (set by the engine)
        # at an index below last_index (set by the scheduler: prompt + max_tokens, capped by
        # max_model_len) cannot end the request, unless a stop string does, which the engine
        # checks on its text path.
        self.stop_token_set: frozenset[int] = frozenset()
        self.last_index: int = 1 << 62
        self.final_only = False          # outputs only when finished (LLMEngine.add_request)

    # Derived sizes -------------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Outputs so far, placeholders included: they count against max_tokens."""
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def max_total_tokens(self, max_model_len: int | None = None) -> int:
        """The most tokens (prompt + outputs) this request can ever hold."""
        total = self.num_prompt_tokens + self.max_tokens
        return total if max_model_len is None else min(total, max_model_len)

    # Token edits ---------------------------------------------------------------------------------

    def append_output(self, token: int) -> None:
        """Append a sampled token, or PLACEHOLDER for one still on the device."""
        self.token_ids.append(token)
        if token == PLACEHOLDER:
            self.num_placeholders += 1

    def resolve_placeholder(self, index: int, token: int) -> None:
        """Replace the PLACEHOLDER at absolute position `index` by the token read back."""
        if self.token_ids[index] != PLACEHOLDER:
            raise ValueError(f"token_ids[{index}] of {self.request_id!r} is not a placeholder")
        self.token_ids[index] = token
        self.num_placeholders -= 1

    def truncate(self, num_tokens: int) -> None:
        """Drop outputs from position num_tokens on (e.g. the speculative token after a stop)."""
        if num_tokens < self.num_prompt_tokens:
            raise ValueError(f"cannot truncate {self.request_id!r} into its prompt")
        dropped = self.token_ids[num_tokens:]
        del self.token_ids[num_tokens:]
        self.num_placeholders -= dropped.count(PLACEHOLDER)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, placeholders={self.num_placeholders})")
