"""The engine freezes start-up's objects out of the garbage collector's reach (engine/gc_freeze.py),
gives them back on close, and never keeps a closed engine's reference cycles frozen."""

import gc
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


def test_start_up_objects_are_frozen_until_close(dense_path):
    holder = []
    ref = reachable_cycle(holder)
    llm = make_llm(dense_path)
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


def test_next_engine_collects_what_a_frozen_one_left(dense_path):
    holder = []
    ref = reachable_cycle(holder)
    first = make_llm(dense_path)
    holder.clear()
    del first                      # never closed: its cycles (and this one) are frozen
    gc.collect()
    assert ref() is not None
    second = make_llm(dense_path)  # un-freezes and collects before freezing again
    assert ref() is None
    second.close()


def test_tokenizer_load_freezes_again(dense_path):
    llm = make_llm(dense_path)
    assert not llm.engine.lazy_tokenizer.loaded
    before = gc.get_freeze_count()
    made_since = [[i] for i in range(20_000)]    # tracked objects alive since the freeze
    llm.generate("hello", {"max_tokens": 2, "temperature": 0})
    assert llm.engine.lazy_tokenizer.loaded
    assert gc.get_freeze_count() >= before + len(made_since)
    llm.close()


def test_gc_freeze_off_leaves_the_collector_alone(dense_path):
    holder = []
    ref = reachable_cycle(holder)
    llm = make_llm(dense_path, gc_freeze=False)
    assert gc.get_freeze_count() == 0
    assert "gc_frozen_objects" not in llm.engine.runner.timings
    holder.clear()
    gc.collect()
    assert ref() is None
    llm.close()


def test_gc_freeze_must_be_a_bool(dense_path):
    with pytest.raises(ConfigError, match="gc_freeze"):
        make_llm(dense_path, gc_freeze="yes")
