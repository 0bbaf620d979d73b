"""Per-row decode state: what changes every decode step, held in numpy rows instead of Request objects.

A request that takes a row of the persistent input batch is *bound* to it (`bind`): from then on its
token ids, token count, computed count and placeholder count live in this row, and the Request's
properties read and write them here (request.py). A decode step can then be booked for every row at
once with a few numpy operations: the scheduler finds the rows that cross a block boundary, the
engine appends 256 placeholders, resolves 256 sampled tokens and finds the rows that stop, without a
Python loop over the requests; only rows with an *event* (a stop token, the length limit, a first
token, text or logprobs to produce) go through the per-request Python path.

The Request keeps a Python copy of its tokens, brought up to date when someone reads
request.token_ids (`sync`): placeholders only ever trail the real tokens, so the copy's first
`_synced` entries never change and only the tail is re-read. Releasing the row (`unbind`) writes the
row's values back into the Request, which is a plain object again (preempted, finished).

`epoch` counts the bindings of each row: a step records it, so a token read back after its row was
released (and perhaps handed to another request) is recognised as stale.
"""

import numpy as np

from pcg_engine.engine.request import PLACEHOLDER

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
        # Set by the engine (defaults send every token through the per-request path):
        self.plain = np.zeros(R, dtype=bool)              # no text, no logprobs: tokens booked in bulk
        self.stream = np.zeros(R, dtype=bool)             # an output per step (not final_only)
        self.first_pending = np.zeros(R, dtype=bool)      # no token read back yet (first_token_time)
        self.stop_ids = np.full((R, 1), NO_STOP, dtype=np.int64)   # tokens that may stop the row
        self.requests: list = [None] * R

    # ---- binding ------------------------------------------------------------------------------
    def bind(self, request, row: int) -> None:
        """Move the request's per-step state into `row` (fresh rows only: the request is unbound)."""
        if request._rows is not None:
            raise RuntimeError(f"{request.request_id!r} is already bound to a row")
        tokens = request._token_ids
        n = len(tokens)
        self.token_ids[row, :n] = tokens
        self.num_tokens[row] = n
        self.num_computed[row] = request._num_computed
        self.num_placeholders[row] = request._num_placeholders
        self.last_index[row] = request.last_index
        self.table_len[row] = 0
        self.epoch[row] += 1
        self.plain[row] = self.stream[row] = self.first_pending[row] = False
        self.stop_ids[row] = NO_STOP
        self.requests[row] = request
        request._synced = n - request._num_placeholders
        request._rows, request._row = self, row

    def unbind(self, request) -> None:
        """Write the row back into the request; the row may then be reused."""
        if request._rows is not self:
            return
        row = request._row
        self.sync(request)
        request._num_computed = int(self.num_computed[row])
        request._num_placeholders = int(self.num_placeholders[row])
        request._rows, request._row = None, -1
        self.requests[row] = None
        self.epoch[row] += 1

    def sync(self, request) -> None:
        """Bring request._token_ids up to date with the row (only its unsettled tail is re-read)."""
        row = request._row
        n = int(self.num_tokens[row])
        tokens, k = request._token_ids, request._synced
        if k < len(tokens):
            del tokens[k:]
        if k < n:
            tokens.extend(self.token_ids[row, k:n].tolist())
        request._synced = n - int(self.num_placeholders[row])

    def set_stop_ids(self, row: int, ids) -> None:
        ids = list(ids)
        if len(ids) > self.stop_ids.shape[1]:      # widen every row (rare: a request with many stop ids)
            wider = np.full((len(self.stop_ids), len(ids)), NO_STOP, dtype=np.int64)
            wider[:, :self.stop_ids.shape[1]] = self.stop_ids
            self.stop_ids = wider
        self.stop_ids[row] = NO_STOP
        self.stop_ids[row, :len(ids)] = ids

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
    def append_placeholders(self, rows: np.ndarray) -> np.ndarray:
        """A PLACEHOLDER at the end of each row (rows distinct); returns the index each took."""
        index = self.num_tokens[rows]
        self.token_ids[rows, index] = PLACEHOLDER
        self.num_tokens[rows] = index + 1
        self.num_placeholders[rows] += 1
        return index

    def stop_hit(self, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Per row: the token is one of the row's stop tokens (EOS included unless ignored)."""
        return (self.stop_ids[rows] == tokens[:, None]).any(axis=1)
