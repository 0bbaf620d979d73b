"""Per-row decode state: what changes every decode step, held in numpy rows instead of Request objects.

A request that takes a row of the persistent input batch is *bound* to it (`bind`): its class is
switched to BoundRequest, whose properties read and write its token ids, token count, computed
count and placeholder count in this row. (A class switch rather than properties on Request: plain
requests, and the per-step rebuild baseline that uses only those, keep plain attributes.) A decode step can then be booked for every row at
once with a few numpy operations: the scheduler finds the rows that cross a block boundary, the
engine appends 256 placeholders, resolves 256 sampled tokens and finds the rows that stop, without a
Python loop over the requests; only rows with an *event* (a stop token, the length limit, a first
token, text or logprobs to produce) go through the per-request Python path.

A BoundRequest keeps a Python copy of its tokens, brought up to date when someone reads
request.token_ids (`sync`): placeholders only ever trail the real tokens, so the copy's first
`_synced` entries never change and only the tail is re-read. Releasing the row (`unbind`) writes the
row's values back into the request, which is a plain Request again (preempted, finished).

Reading token_ids syncs (edits) the copy, so like the engine itself it is single-threaded: read
outputs on the thread that steps the engine (the load test's engine thread does).

`epoch` counts the bindings of each row: a step records it, so a token read back after its row was
released (and perhaps handed to another request) is recognised as stale.
"""

import numpy as np

from pcg_engine.engine.request import PLACEHOLDER, Request

# Pads the stop-token columns: matches no sampled token (those are >= 0) and no placeholder.
NO_STOP = -2


class RowState:
    def __init__(self, num_rows: int, max_tokens: int):
        R = num_rows
        self.token_ids = np.zeros((R, max_tokens), dtype=np.int64)
        self.num_tokens = np.zeros(R, dtype=np.int64)
        self.num_computed = np.zeros(R, dtype=np.int64)
        self.num_placeholders = np.zeros(R, dtype=np.int64)
        self.last_index = np.zeros(R, dtype=np.int64)     # Request.last_index
        self.table_len = np.zeros(R, dtype=np.int64)      # KV blocks the block manager holds for the row
        self.epoch = np.zeros(R, dtype=np.int64)
        self.version = 0                                  # counts binds and unbinds (a row changed hands)
        self.flags_version = 0                            # counts writes of plain / stream / needs_host / stop ids
        # Set by the engine (defaults send every token through the per-request path):
        self.plain = np.zeros(R, dtype=bool)              # no text, no logprobs: tokens booked in bulk
        self.stream = np.zeros(R, dtype=bool)             # an output per step (not final_only)
        # Resolve on the per-request path: not plain, or no token read back yet (first_token_time).
        self.needs_host = np.ones(R, dtype=bool)
        self.stop_ids = np.full((R, 1), NO_STOP, dtype=np.int64)   # tokens that may stop the row
        # Per token id: a stop token of some row, now or before (a screen: stop_hit decides); its
        # last entry is never one, for the tokens beyond it.
        self.stop_any = np.zeros(1, dtype=bool)
        self.requests: list = [None] * R

    # ---- binding ------------------------------------------------------------------------------
    def bind(self, request, row: int) -> None:
        """Move the request's per-step state into `row` (fresh rows only: the request is unbound)."""
        if request._rows is not None:
            raise RuntimeError(f"{request.request_id!r} is already bound to a row")
        tokens = request.token_ids
        n = len(tokens)
        self.token_ids[row, :n] = tokens
        self.num_tokens[row] = n
        self.num_computed[row] = request.num_computed_tokens
        self.num_placeholders[row] = request.num_placeholders
        self.last_index[row] = request.last_index
        self.table_len[row] = 0
        self.epoch[row] += 1
        self.plain[row] = self.stream[row] = False
        self.needs_host[row] = True
        self.stop_ids[row] = NO_STOP
        self.requests[row] = request
        self.version += 1
        self.flags_version += 1
        request._synced = n - request.num_placeholders
        request._rows, request._row = self, row
        request.__class__ = BoundRequest

    def unbind(self, request) -> None:
        """Write the row back into the request; the row may then be reused."""
        if request._rows is not self:
            return
        row = request._row
        self.sync(request)
        request.__class__ = Request          # plain attributes again: the instance dict's values
        request.num_computed_tokens = int(self.num_computed[row])
        request.num_placeholders = int(self.num_placeholders[row])
        del request._rows, request._row, request._synced
        self.requests[row] = None
        self.epoch[row] += 1
        self.version += 1

    def sync(self, request) -> None:
        """Bring request._token_ids up to date with the row (only its unsettled tail is re-read)."""
        row = request._row
        n = int(self.num_tokens[row])
        tokens, k = request.__dict__["token_ids"], request._synced
        if k < len(tokens):
            del tokens[k:]
        if k < n:
            tokens.extend(self.token_ids[row, k:n].tolist())
        request._synced = n - int(self.num_placeholders[row])

    def describe(self, row: int, plain: bool, stream: bool, needs_host: bool, stop_ids) -> None:
        """How the bulk booking treats a freshly bound row (see the flags in __init__)."""
        self.plain[row], self.stream[row], self.needs_host[row] = plain, stream, needs_host
        self.set_stop_ids(row, stop_ids)

    def first_tokens_seen(self, rows: np.ndarray) -> None:
        """These rows' first tokens are booked: only rows that are not plain still need the host."""
        self.needs_host[rows] = ~self.plain[rows]
        self.flags_version += 1

    def set_stop_ids(self, row: int, ids) -> None:
        self.flags_version += 1
        ids = list(ids)
        if len(ids) > self.stop_ids.shape[1]:      # widen every row (rare: a request with many stop ids)
            wider = np.full((len(self.stop_ids), len(ids)), NO_STOP, dtype=np.int64)
            wider[:, :self.stop_ids.shape[1]] = self.stop_ids
            self.stop_ids = wider
        self.stop_ids[row] = NO_STOP
        self.stop_ids[row, :len(ids)] = ids
        if ids:
            top = max(ids)
            if top + 1 >= len(self.stop_any):
                # One entry past the largest id stays False: the screen's take(mode="clip") maps
                # every larger token there.
                wider = np.zeros(top + 2, dtype=bool)
                wider[:len(self.stop_any)] = self.stop_any
                self.stop_any = wider
            self.stop_any[ids] = True

    # ---- one request's edits (Request's methods call these while it is bound) -------------------
    def append(self, request, token: int) -> None:
        row = request._row
        n = self.num_tokens[row]
        self.token_ids[row, n] = token
        self.num_tokens[row] = n + 1
        if token == PLACEHOLDER:
            self.num_placeholders[row] += 1

    def set_token(self, request, index: int, token: int) -> None:
        row = request._row
        if index >= self.num_tokens[row] or self.token_ids[row, index] != PLACEHOLDER:
            raise ValueError(f"token_ids[{index}] of {request.request_id!r} is not a placeholder")
        self.token_ids[row, index] = token
        self.num_placeholders[row] -= 1

    def truncate(self, request, num_tokens: int) -> None:
        row = request._row
        n = int(self.num_tokens[row])
        if num_tokens < n:
            dropped = int(np.count_nonzero(self.token_ids[row, num_tokens:n] == PLACEHOLDER))
            self.num_placeholders[row] -= dropped
            self.num_tokens[row] = num_tokens
            request._synced = min(request._synced, num_tokens)

    # ---- every row of a step at once ----------------------------------------------------------
    def append_placeholders(self, rows: np.ndarray, num_tokens: np.ndarray | None = None) -> np.ndarray:
        """A PLACEHOLDER at the end of each row (rows distinct); returns the index each took.
        num_tokens: the rows' token counts, when the caller has them (the decode fast path's plan)."""
        index = self.num_tokens[rows] if num_tokens is None else num_tokens
        self.token_ids[rows, index] = PLACEHOLDER
        self.num_tokens[rows] = index + 1
        self.num_placeholders[rows] += 1
        return index

    def stop_hit(self, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Per row: the token is one of the row's stop tokens (EOS included unless ignored)."""
        return (self.stop_ids[rows] == tokens[:, None]).any(axis=1)


class BoundRequest(Request):
    """A Request while it holds a row: token_ids and the counts are properties over the row (the
    instance dict's entries of the same names are shadowed; token_ids' holds the synced copy)."""

    @property
    def token_ids(self) -> list[int]:
        self._rows.sync(self)
        return self.__dict__["token_ids"]

    @property
    def num_tokens(self) -> int:
        return int(self._rows.num_tokens[self._row])

    @property
    def num_computed_tokens(self) -> int:
        return int(self._rows.num_computed[self._row])

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self._rows.num_computed[self._row] = value

    @property
    def num_placeholders(self) -> int:
        return int(self._rows.num_placeholders[self._row])

    @num_placeholders.setter
    def num_placeholders(self, value: int) -> None:
        self._rows.num_placeholders[self._row] = value

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - len(self.prompt_token_ids)

    def append_output(self, token: int) -> None:
        self._rows.append(self, token)

    def resolve_placeholder(self, index: int, token: int) -> None:
        self._rows.set_token(self, index, token)

    def truncate(self, num_tokens: int) -> None:
        if num_tokens < self.num_prompt_tokens:
            raise ValueError(f"cannot truncate {self.request_id!r} into its prompt")
        self._rows.truncate(self, num_tokens)
