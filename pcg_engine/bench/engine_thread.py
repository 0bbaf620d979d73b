"""The load test's serving loop: one background thread owns the engine; clients talk to it by queue.

Nothing but this thread touches the engine: the engine's lock would make a client's add_request
safe too, but the client would wait for the step in flight. A client thread calls `submit`, which
stamps the submission time and puts the request on a queue.Queue; the engine thread
drains the queue into `add_request` (passing the submission time as arrival_time, so the engine's
own RequestMetrics share the clock), runs `step()`, and stamps every token as it comes back.

All times are time.monotonic(), the clock RequestMetrics uses. A token's time is taken when step()
returns it to this thread, i.e. when a server would hand it to the client.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    request_id: str
    prompt_len: int
    output_len: int                       # tokens asked for (EOS is ignored, so also expected)
    submit_time: float = 0.0
    token_times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    engine_metrics: object = None         # the engine's RequestMetrics, for cross-checks

    @property
    def ok(self) -> bool:
        return self.finished and self.error is None


class EngineLoop(threading.Thread):
    """Runs until `close()` was called and every submitted request has finished."""

    IDLE_POLL_S = 0.02

    def __init__(self, engine, on_finish=None):
        super().__init__(name="pcg-engine-loop", daemon=True)
        self.engine = engine
        self.on_finish = on_finish        # called (in this thread) with each finished record
        self.inbox: queue.Queue = queue.Queue()
        self.records: dict[str, RequestRecord] = {}
        self.submitted = 0
        self.completed = 0
        self.failed = 0
        self.error: BaseException | None = None
        self.last_token_time = 0.0
        self.stop_time: float | None = None   # when stop() was first called
        self._closed = threading.Event()
        self._stop_requested = threading.Event()

    # ---- client side (any thread) -----------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params) -> RequestRecord:
        rec = RequestRecord(request_id, len(prompt_ids), params.max_tokens)
        rec.submit_time = time.monotonic()
        self.inbox.put((rec, prompt_ids, params))
        self.submitted += 1
        return rec

    def close(self) -> None:
        """No more submissions: the loop ends once the engine has drained."""
        self._closed.set()

    def stop(self) -> None:
        """Give up (time limit): unfinished requests are aborted and counted as failed."""
        if self.stop_time is None:
            self.stop_time = time.monotonic()
        self._stop_requested.set()
        self._closed.set()

    @property
    def stopped(self) -> bool:
        return self._stop_requested.is_set()

    def wait_stop(self, timeout: float) -> bool:
        """Sleep up to `timeout` seconds (inf: until stopped), or until stop() is called; True if it
        was. In slices: one wait of the gap a tiny --request-rate draws (1e300 s) raised
        OverflowError in the client thread, and the run died on a KeyError traceback."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if not left > 0:
                return self._stop_requested.is_set()
            if self._stop_requested.wait(min(left, 3600.0)):
                return True

    @property
    def in_flight(self) -> int:
        return self.submitted - self.completed - self.failed

    # ---- engine side ---------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self._stop_requested.is_set():
                busy = self.engine.has_unfinished_requests()
                self._admit(block=not busy)
                if self.engine.has_unfinished_requests():
                    self._step()
                elif self._closed.is_set() and self.inbox.empty():
                    return
            self._abort_unfinished()
        except BaseException as e:   # surfaced by the caller after join(); never lost in the thread
            self.error = e
            self.fail_remaining(f"engine loop died: {e!r}")

    def _abort_unfinished(self) -> None:
        for rid, rec in self.records.items():
            if not rec.finished and rid in self.engine.requests:
                self.engine.abort_request(rid)
        while self.engine.has_unfinished_requests():     # leave the engine idle for the next run
            self.engine.step()
        self.fail_remaining("stopped: the run's time limit passed")

    def _admit(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=self.IDLE_POLL_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            rec, prompt_ids, params = item
            self.records[rec.request_id] = rec
            try:
                self.engine.add_request(prompt_ids, params, request_id=rec.request_id,
                                        arrival_time=rec.submit_time)
            except Exception as e:    # a refused request fails alone; the run goes on
                self._finish(rec, "error", str(e))
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.monotonic()
        for out in outputs:
            rec = self.records.get(out.request_id)
            if rec is None or rec.finished:
                continue
            if out.new_token_ids:
                rec.token_times.extend([now] * len(out.new_token_ids))
                self.last_token_time = now
            if out.finished:
                rec.num_output_tokens = len(out.token_ids)
                rec.engine_metrics = out.metrics
                bad = out.finish_reason in ("abort", "error")
                self._finish(rec, out.finish_reason, (out.error or out.finish_reason) if bad else None)

    def _finish(self, rec: RequestRecord, reason: str | None, error: str | None) -> None:
        rec.finished, rec.finish_reason, rec.error = True, reason, error
        if error is None:
            self.completed += 1
        else:
            self.failed += 1
        if self.on_finish is not None:
            self.on_finish(rec)

    def fail_remaining(self, why: str) -> None:
        """Mark every unfinished or never-admitted request failed (after a stop or a crash)."""
        for rec in self.records.values():
            if not rec.finished:
                # the tokens it streamed before the stop (its row read output_len 0 beside a TTFT)
                rec.num_output_tokens = len(rec.token_times)
                self._finish(rec, "error", why)
        while True:
            try:
                rec, _, _ = self.inbox.get_nowait()
            except queue.Empty:
                return
            self.records[rec.request_id] = rec
            self._finish(rec, "error", why)


def run_client(loop: EngineLoop, requests: list[tuple[list[int], object]], offsets, max_concurrency: int | None,
               id_prefix: str = "req") -> float:
    """Submit requests[i] at start + offsets[i] seconds (and only while fewer than max_concurrency are
    in flight); returns the start time. Closes the loop when everything is submitted."""
    gate = threading.BoundedSemaphore(max_concurrency) if max_concurrency else None
    if gate is not None:
        loop.on_finish = lambda rec: gate.release()
    start = time.monotonic()
    try:
        for i, ((prompt_ids, params), offset) in enumerate(zip(requests, offsets)):
            delay = start + float(offset) - time.monotonic()
            # Woken by a stop: asleep until the next submission (seconds apart at low rates), the
            # client held the run open past its --timeout.
            if delay > 0 and loop.wait_stop(delay):
                break
            if gate is not None:
                gate.acquire()
            if loop.error is not None or loop.stopped:
                break
            loop.submit(f"{id_prefix}-{i}", prompt_ids, params)
    finally:
        loop.close()
    return start
