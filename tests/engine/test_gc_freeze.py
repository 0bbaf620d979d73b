"""The engine freezes start-up's objects out of the garbage collector's reach (engine/gc_freeze.py),
gives them back on close, and never keeps a closed engine's reference cycles frozen."""

import gc
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
from engine_helpers import make_llm

from pcg_engine.errors import ConfigError


class Node:
    pass


def reachable_cycle(holder: list) -> weakref.ref:
    """A self-referencing object kept alive only through `holder`: once the holder lets it go, only
    the cycle collector can free it."""
    node = Node()
    node.self = node
    holder.append(node)
    return weakref.ref(node)


@pytest.fixture(autouse=True)
def clean_collector():
    gc.unfreeze()        # earlier tests' engines were never closed and left everything frozen
    yield
    gc.unfreeze()


@pytest.fixture
def build(dense_path):
    """make_llm on the tiny checkpoint; every engine still open is closed after the test, failed or not."""
    built = []

    def make(**config):
        built.append(make_llm(dense_path, **config))
        return built[-1]
    yield make
    for llm in built:
        if llm.engine.runner.model is not None:
            llm.close()


def test_start_up_objects_are_frozen_until_close(build):
    holder = []
    ref = reachable_cycle(holder)
    llm = build()
    assert gc.get_freeze_count() > 10_000
    assert llm.engine.runner.timings["gc_frozen_objects"] > 10_000
    holder.clear()
    gc.collect()
    assert ref() is not None, "a frozen object must be out of the collector's reach"
    out = llm.generate([[1, 2, 3]], {"max_tokens": 4, "temperature": 0})
    assert len(out[0].token_ids) == 4
    llm.close()
    assert gc.get_freeze_count() == 0
    assert ref() is None, "close must hand the frozen objects back before the runner's collection"


def test_next_engine_collects_what_a_frozen_one_left(dense_path, build):
    holder = []
    ref = reachable_cycle(holder)
    first = make_llm(dense_path)   # not through `build`: never closed
    holder.clear()
    del first                      # its cycles (and this one) are frozen
    gc.collect()
    assert ref() is not None
    build()                        # un-freezes and collects before freezing again
    assert ref() is None


def test_close_unfreezes_whoever_froze(build):
    """An engine built with gc_freeze=False still un-freezes on close: another engine may have
    frozen its objects, and its runner's collection must reach their cycles."""
    holder = []
    ref = reachable_cycle(holder)
    unfrozen = build(gc_freeze=False)
    build()                        # freezes everything alive, the cycle too
    holder.clear()
    gc.collect()
    assert ref() is not None
    unfrozen.close()
    assert ref() is None


def test_gc_freeze_off_leaves_the_collector_alone(build):
    holder = []
    ref = reachable_cycle(holder)
    llm = build(gc_freeze=False)
    assert gc.get_freeze_count() == 0
    assert "gc_frozen_objects" not in llm.engine.runner.timings
    holder.clear()
    gc.collect()
    assert ref() is None


def test_gc_freeze_must_be_a_bool(build):
    with pytest.raises(ConfigError, match="gc_freeze"):
        build(gc_freeze="yes")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_finished_requests_leave_no_reference_cycles(build, async_scheduling):
    """Requests go when they finish, by reference counting: nothing of a step (the decode fast
    path's batch and its plan list above all, decode_batch.py) may hold them in a cycle, or every
    finished request would pile up for the cycle collector's full collections."""
    engine = build(async_scheduling=async_scheduling, gc_freeze=False).engine
    params = {"max_tokens": 40, "temperature": 0, "ignore_eos": True, "detokenize": False}
    gc.collect()
    gc.garbage.clear()
    debug = gc.get_debug()
    gc.set_debug(debug | gc.DEBUG_SAVEALL)   # the collector keeps what it finds unreachable in gc.garbage
    try:
        for wave in range(3):           # requests join and finish: fast-path batches come and go
            for i in range(5):
                engine.add_request([1 + wave, 2 + i, 3, 4, 5, 6], params)
            for _ in range(15):
                engine.step()
        while engine.has_unfinished_requests():
            engine.step()
        gc.collect()
        kinds = {type(o).__name__ for o in gc.garbage}
    finally:
        gc.set_debug(debug)
        gc.garbage.clear()
    assert not kinds & {"Request", "DecodeBatch", "ScheduledBatch", "SamplingParams"}, sorted(kinds)


def test_an_unclosed_engine_unfreezes_at_exit(dense_path):
    """A script that never closes its engine: by the time the interpreter's final collections run
    (after every atexit handler, including one the script registered before building the engine,
    which atexit runs after the engine's), nothing is left frozen, and Triton's nanobind reports no
    leaked object on exit (what it printed, ~30 lines, before the handler)."""
    script = textwrap.dedent(f"""
        import atexit, gc
        atexit.register(lambda: print("FROZEN_AT_EXIT", gc.get_freeze_count(), flush=True))
        from pcg_engine.llm import LLM
        llm = LLM({str(dense_path)!r}, device="cpu", mode="eager")
        print("FROZEN_AFTER_START", gc.get_freeze_count(), flush=True)
        llm.generate([[1, 2, 3]], {{"max_tokens": 2, "temperature": 0}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    counts = dict(line.split() for line in proc.stdout.splitlines() if line.startswith("FROZEN_"))
    assert int(counts["FROZEN_AFTER_START"]) > 10_000
    assert int(counts["FROZEN_AT_EXIT"]) == 0
    assert "leaked" not in proc.stderr, proc.stderr[-2000:]
