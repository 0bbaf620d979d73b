"""Running a call that a regression would leave blocked on a named pipe (open() of a FIFO waits for
a writer): in a thread, so that the test fails, after releasing the pipes, instead of hanging."""

import os
import threading
from pathlib import Path

import pytest


def error_of(call, pipes_under: Path, timeout: float = 60):
    """The exception `call()` raised (None if it returned); fails the test if it blocks."""
    result = {}

    def run():
        try:
            call()
        except Exception as e:      # noqa: BLE001 - the test inspects it
            result["error"] = e
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        for fifo in Path(pipes_under).rglob("*"):
            if fifo.is_fifo():
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))     # lets the blocked open return
        pytest.fail("the call blocked on a named pipe")
    return result.get("error")
