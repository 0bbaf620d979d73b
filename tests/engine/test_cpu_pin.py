"""The stepping thread runs on one core while it steps, and only then (engine/cpu_pin.py): other
threads keep their masks, the thread gets its own mask back, a thread pinned already is left alone,
and EngineConfig.cpu_pin is validated by name."""

import os
import threading

import pytest
from engine_helpers import make_llm

from pcg_engine.engine.cpu_pin import ThreadPin, allowed_cpus, current_cpu
from pcg_engine.errors import ConfigError
from pcg_engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs Linux thread affinity and at least two cores")

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_pin_holds_the_calling_thread_only_and_gives_its_mask_back():
    start = os.sched_getaffinity(0)
    inside, release, seen = threading.Event(), threading.Event(), {}

    def worker():
        with ThreadPin() as pin:
            seen["mask"], seen["cpu"] = os.sched_getaffinity(0), pin.pinned_to
            with ThreadPin() as inner:         # nested: the outer pin stands
                seen["inner"] = inner.pinned_to, os.sched_getaffinity(0)
            seen["after_inner"] = os.sched_getaffinity(0)
            inside.set()
            release.wait(10)
        seen["after"] = os.sched_getaffinity(0)

    t = threading.Thread(target=worker)
    t.start()
    assert inside.wait(10)
    assert os.sched_getaffinity(0) == start            # this thread untouched while the other is pinned
    release.set()
    t.join()
    assert seen["cpu"] in start and seen["mask"] == {seen["cpu"]}
    assert seen["inner"] == (None, {seen["cpu"]}) and seen["after_inner"] == {seen["cpu"]}
    assert seen["after"] == start


def test_pin_to_a_given_core_and_leave_a_pinned_thread_alone():
    start = os.sched_getaffinity(0)
    last = max(start)
    try:
        with ThreadPin(last) as pin:
            assert pin.pinned_to == last and os.sched_getaffinity(0) == {last}
            assert current_cpu() == last                  # running there now
        assert os.sched_getaffinity(0) == start
        os.sched_setaffinity(0, {min(start)})             # pinned by someone else (taskset)
        with ThreadPin(last) as pin:
            assert pin.pinned_to is None and os.sched_getaffinity(0) == {min(start)}
        assert os.sched_getaffinity(0) == {min(start)}
    finally:
        os.sched_setaffinity(0, start)
    with ThreadPin(10 ** 6) as pin:                        # not a core of this process: nothing
        assert pin.pinned_to is None and os.sched_getaffinity(0) == start


def test_generate_and_stream_pin_while_stepping(dense_path, monkeypatch):
    start = os.sched_getaffinity(0)
    masks = []
    llm = make_llm(dense_path, cpu_pin=True)
    try:
        assert llm.engine.cpu_pin is True
        llm.generate([[1, 2, 3]], GREEDY, on_output=lambda out: masks.append(os.sched_getaffinity(0)))
        assert masks and all(len(m) == 1 and m <= start for m in masks)
        assert os.sched_getaffinity(0) == start
        between = [os.sched_getaffinity(0) for _ in llm.stream([4, 5, 6], GREEDY)]
        assert between and all(m == start for m in between)   # the caller's code runs with its own mask
        real_step = llm.engine.step
        during = []
        monkeypatch.setattr(llm.engine, "step", lambda: (during.append(os.sched_getaffinity(0)), real_step())[1])
        list(llm.stream([7, 8], GREEDY))
        assert during and all(len(m) == 1 for m in during)
    finally:
        llm.close()
    masks.clear()
    off = make_llm(dense_path, cpu_pin=False)
    try:
        off.generate([[1, 2, 3]], GREEDY, on_output=lambda out: masks.append(os.sched_getaffinity(0)))
        assert masks and all(m == start for m in masks)
    finally:
        off.close()


def test_cpu_pin_default_and_its_switch(monkeypatch, dense_path):
    from pcg_engine.config import EngineConfig
    monkeypatch.delenv("PCG_CPU_PIN", raising=False)
    assert EngineConfig().resolved_cpu_pin("cpu") is False and EngineConfig().resolved_cpu_pin("cuda") is True
    monkeypatch.setenv("PCG_CPU_PIN", "1")
    assert EngineConfig().resolved_cpu_pin("cpu") is True
    monkeypatch.setenv("PCG_CPU_PIN", "0")
    assert EngineConfig().resolved_cpu_pin("cuda") is False
    core = min(allowed_cpus())
    assert EngineConfig(cpu_pin=core).resolved_cpu_pin("cpu") == core   # an explicit value wins


@pytest.mark.parametrize("value", [10 ** 6, -1, "2", 1.5])
def test_cpu_pin_refused_by_name(value):
    from pcg_engine.config import EngineConfig
    with pytest.raises(ConfigError, match="cpu_pin") as info:
        EngineConfig(cpu_pin=value)
    assert "allowed" in str(info.value)
