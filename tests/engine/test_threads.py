"""The Python API used from several threads, as a server's threads use it.

Every thread here is joined with a timeout: a deadlock fails the test instead of blocking the run.
Results are compared with each request's solo greedy run, and every engine must end drained (no
request, row or KV block left behind).
"""

import threading
import traceback

import pytest

from engine_helpers import assert_drained, make_llm, random_prompts
from pcg_engine.attention.context import ForwardContext, get_forward_context, set_forward_context
from pcg_engine.sampling_params import SamplingParams

TIMEOUT_S = 60
PROMPTS_A = random_prompts([5, 9, 13, 20, 7, 30], seed=1)
PROMPTS_B = random_prompts([6, 11, 17, 4, 25], seed=2)


def greedy(max_tokens=24):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_threads(*fns):
    """Run each fn in its own thread, all started together; their results, in order. An exception
    in a thread is raised here (with its traceback); a thread still alive after TIMEOUT_S fails."""
    results, errors = [None] * len(fns), [None] * len(fns)
    start = threading.Barrier(len(fns))

    def body(i, fn):
        try:
            start.wait(TIMEOUT_S)
            results[i] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            errors[i] = (e, traceback.format_exc())

    threads = [threading.Thread(target=body, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    for i, err in enumerate(errors):
        if err is not None:
            raise AssertionError(f"thread {i} raised:\n{err[1]}") from err[0]
    return results


def tokens(outputs):
    return [o.token_ids for o in outputs]


# ---- separate engines, one per thread -------------------------------------------------------------

def test_forward_context_is_per_thread():
    """A context set in one thread is not seen by another (it was one module global)."""
    mine = ForwardContext(None, [], "backend-a")
    inside, leave = threading.Event(), threading.Event()

    def holder():
        with set_forward_context(mine):
            inside.set()
            leave.wait(TIMEOUT_S)
            return get_forward_context() is mine

    def other():
        inside.wait(TIMEOUT_S)
        try:
            with pytest.raises(RuntimeError, match="outside set_forward_context"):
                get_forward_context()
            theirs = ForwardContext(None, [], "backend-b")
            with set_forward_context(theirs):
                return get_forward_context() is theirs
        finally:
            leave.set()

    assert run_threads(holder, other) == [True, True]


@pytest.mark.parametrize("preset,async_scheduling", [("tiny-qwen3", False), ("tiny-qwen3-moe", True)])
def test_two_engines_in_two_threads(tiny_paths, preset, async_scheduling):
    """Two LLMs, each generating in its own thread at the same time: each gets its solo tokens.
    With one global forward context, each thread's attention read the other engine's metadata."""
    llms = [make_llm(tiny_paths[preset], async_scheduling=async_scheduling) for _ in range(2)]
    want = [tokens(llms[0].generate(PROMPTS_A, greedy())), tokens(llms[1].generate(PROMPTS_B, greedy()))]
    for _ in range(3):
        got = run_threads(lambda: tokens(llms[0].generate(PROMPTS_A, greedy())),
                          lambda: tokens(llms[1].generate(PROMPTS_B, greedy())))
        assert got == want
    for llm in llms:
        assert_drained(llm.engine)
