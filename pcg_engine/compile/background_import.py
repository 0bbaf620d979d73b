"""Importing torch's compiler stack in a thread while the weights load and the KV cache is sized.

A start of a compiled mode imports torch._dynamo and torch._inductor when it reaches the compile
set-up, after the CUDA context, the weight load and the KV-sizing forward. On a warm start those
imports are most of what the compile phases cost: under `python -X importtime`, a warm piecewise
start of the tiny model on the 2-core dev VM spent ~2.2 s importing torch._dynamo (through
torch._dynamo.aot_compile, which the saved trace loads) and ~2.9 s importing Inductor's lowering and
code generation (which loading its cached artifacts needs), of 6.5 s (session 18). Nothing before
the set-up needs them, and the steps before it wait on the disk and the GPU with the GIL released,
so a thread started first can do the imports there.

Safe because the main thread imports none of these modules before the set-up (an eager start imports
neither package), so the two threads never import into each other's half-initialised modules; the
set-up joins the thread before its own imports. An import that fails in the thread is left alone:
the main thread's own import fails or succeeds where it always did, with its error in its place.
PCG_BACKGROUND_IMPORT=0 turns the thread off (an A/B switch for start-up benchmarks, read per start).
"""

from __future__ import annotations

import importlib
import os
import threading
import time

from pcg_engine.config import COMPILED_MODES

# The warm path's heavy imports, entry points first (each pulls in most of the next ones); all of them
# and nothing more are what a warm piecewise start imports (torch 2.13; compile_fx, for one, only a
# cold start needs). A name that a torch version lacks is skipped.
MODULES = (
    "torch._dynamo",
    "torch._dynamo.aot_compile",
    "torch._dynamo.convert_frame",
    "torch._dynamo.repro.after_dynamo",
    "torch._inductor.lowering",
    "torch._inductor.select_algorithm",
    "torch._inductor.codegen.wrapper",
    "torch._inductor.codegen.memory_planning",
)


class BackgroundImport:
    """A daemon thread importing MODULES; `join()` waits for it and records how long that took."""

    def __init__(self, modules=MODULES):
        self.modules = modules
        self.import_s = 0.0          # the thread's own time
        self.failed: list[str] = []  # modules whose import raised (the main thread retries them)
        self._thread = threading.Thread(target=self._run, name="pcg-background-import", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        for name in self.modules:
            try:
                importlib.import_module(name)
            except Exception:   # ImportError in other torch versions, or anything an import raises
                self.failed.append(name)
        self.import_s = time.perf_counter() - t0

    def join(self) -> float:
        """Wait for the imports; returns the seconds waited."""
        t0 = time.perf_counter()
        self._thread.join()
        return time.perf_counter() - t0


def wanted() -> bool:
    return os.environ.get("PCG_BACKGROUND_IMPORT", "1") != "0"


def start(mode: str) -> BackgroundImport | None:
    """The thread, for a mode that compiles and when the switch is on; else None."""
    if mode not in COMPILED_MODES or not wanted():
        return None
    return BackgroundImport()
