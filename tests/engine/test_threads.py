"""The Python API used from several threads, as a server's threads use it.

Every thread here is joined with a timeout: a deadlock fails the test instead of blocking the run.
Results are compared with each request's solo greedy run, and every engine must end drained (no
request, row or KV block left behind).
"""

import threading
import time
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


# ---- one engine, several threads ------------------------------------------------------------------
# The engine's lock serializes the calls (LLMEngine's docstring). Without it, the threads' steps
# interleaved: IndexErrors deep in the forward, wrong tokens, rows of aborted requests left behind.

ENGINES = [("tiny-qwen3", False), ("tiny-qwen3-moe", True)]


@pytest.fixture(params=ENGINES, ids=lambda p: f"{p[0]}-{'async' if p[1] else 'sync'}")
def llm_and_solo(request, tiny_paths):
    preset, async_scheduling = request.param
    llm = make_llm(tiny_paths[preset], async_scheduling=async_scheduling)
    solo = {"A": tokens(llm.generate(PROMPTS_A, greedy())), "B": tokens(llm.generate(PROMPTS_B, greedy())),
            "stream": tokens(llm.generate(PROMPTS_A[5], greedy(40)))[0]}
    return llm, solo


def test_two_threads_generate_on_one_llm(llm_and_solo):
    llm, solo = llm_and_solo
    for _ in range(3):
        got = run_threads(lambda: tokens(llm.generate(PROMPTS_A, greedy())),
                          lambda: tokens(llm.generate(PROMPTS_B, greedy())))
        assert got == [solo["A"], solo["B"]]
        assert_drained(llm.engine)


def test_stream_beside_generate(llm_and_solo):
    llm, solo = llm_and_solo

    def stream():
        deltas = [out.new_token_ids for out in llm.stream(PROMPTS_A[5], greedy(40))]
        return [t for d in deltas for t in d]

    for _ in range(3):
        got = run_threads(stream, lambda: tokens(llm.generate(PROMPTS_B, greedy())))
        assert got == [solo["stream"], solo["B"]]
        assert_drained(llm.engine)


def test_add_and_abort_while_another_thread_steps(llm_and_solo):
    """A serving loop steps the engine in one thread; a client adds and aborts requests directly
    from another (not through a queue as bench/engine_thread.py does)."""
    llm, solo = llm_and_solo
    engine = llm.engine
    want = dict(zip((f"r{i}" for i in range(11)), solo["A"] + solo["B"]))
    for _ in range(3):
        finals, added = {}, threading.Event()

        def loop():
            while not added.is_set() or engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finals[out.request_id] = out

        def client():
            try:
                for i, prompt in enumerate(PROMPTS_A + PROMPTS_B):
                    engine.add_request(prompt, greedy(), request_id=f"r{i}")
                engine.add_request(PROMPTS_B[4], greedy(200), request_id="victim")
                while not finals and engine.has_unfinished_requests():   # abort it mid-run
                    time.sleep(0.001)
                engine.abort_request("victim")
            finally:
                added.set()

        run_threads(loop, client)
        assert {rid: out.token_ids for rid, out in finals.items() if rid != "victim"} == want
        assert finals["victim"].finish_reason == "abort"
        assert_drained(engine)


def test_close_while_another_thread_generates(llm_and_solo):
    """close() from another thread while generate runs: it waits for the run to end, which gives
    its tokens; the closed engine then refuses the next call by name. Without the lock, close()
    freed the model under the step in flight (AttributeError: 'NoneType' ... 'compute_logits')."""
    from pcg_engine.errors import EngineClosedError
    llm, solo = llm_and_solo
    running, closing = threading.Event(), threading.Event()

    def on_output(out):
        if not running.is_set():
            running.set()
            closing.wait(TIMEOUT_S)   # close() is called now, while this run is mid-way

    def closer():
        running.wait(TIMEOUT_S)
        closing.set()
        llm.close()

    got, _ = run_threads(lambda: tokens(llm.generate(PROMPTS_A, greedy(), on_output=on_output)), closer)
    assert got == solo["A"]
    with pytest.raises(EngineClosedError, match="closed"):
        llm.generate(PROMPTS_B, greedy())


@pytest.mark.parametrize("where", ["scheduling", "forward"])
def test_a_stream_collected_in_the_middle_of_a_step_is_abandoned_after_it(llm_and_solo, where):
    """Found by a review: a dropped stream caught in a reference cycle is closed by the garbage
    collector wherever a collection falls, most often in the middle of another caller's step (the
    lock is re-entrant, so its abort ran there). Aborted inside the scheduling, its request left a
    row bound to nobody (a full batch then failed with "input batch is full" for good) and its
    outputs went round between callers for ever (has_unfinished_requests stayed True). The abort
    now waits for the step to end; here a collection is forced at each of those two points."""
    import gc
    llm, solo = llm_and_solo
    engine = llm.engine
    if where == "scheduling":
        target, name = engine.block_manager, "allocate"
    else:
        target, name = engine.runner, "execute"
    real = getattr(target, name)
    armed = []

    def collect_once(*args, **kwargs):
        if armed:
            armed.clear()
            gc.collect()               # stands for a collection that falls here
        return real(*args, **kwargs)

    class Holder:
        pass
    holder = Holder()
    holder.me = holder                 # a cycle: only the collector frees it
    holder.stream = llm.stream(PROMPTS_B[4], greedy(100))
    for _ in range(3):
        next(holder.stream)
    del holder
    setattr(target, name, collect_once)
    try:
        armed.append(True)
        assert tokens(llm.generate(PROMPTS_A, greedy())) == solo["A"]
        assert not armed, "no collection was forced: the test tests nothing"
    finally:
        delattr(target, name)          # the class's method again
    assert_drained(engine)
    # A full batch runs (a leaked row made it fail), and nothing is left pending.
    prompts = random_prompts([5 + i for i in range(engine.config.max_num_seqs)], seed=3)
    assert len(llm.generate(prompts, greedy(4))) == len(prompts)
    assert_drained(engine)
    assert not engine.has_unfinished_requests() and not engine.pending_outputs


@pytest.mark.parametrize("caller", ["generate", "stream"])
def test_ctrl_c_right_after_a_callers_step_leaves_the_other_requests_outputs(llm_and_solo, caller):
    """Found by a review: a KeyboardInterrupt landing in generate() or a stream right after its
    engine.step() returned, before the other requests' outputs were set aside, lost them: a
    bystander stream missed a token (39 of 40) or ended on "its final output was taken by another
    caller". The interruption is placed by a trace function at the first line the caller runs
    after its step returns."""
    import sys

    from pcg_engine import llm as llm_module
    llm, solo = llm_and_solo
    engine = llm.engine
    code = (llm_module.LLM._generate if caller == "generate" else llm_module.LLM._stream).__code__
    returned = []
    real_step = engine.step

    def step():
        outputs = real_step()
        returned.append(True)
        return outputs

    def local(frame, event, arg):
        if event == "line" and returned == [True]:
            returned.append(False)              # once
            raise KeyboardInterrupt
        return local

    def trace(frame, event, arg):
        return local if frame.f_code is code else None

    bystander = llm.stream(PROMPTS_A[5], greedy(40))
    got = [next(bystander).new_token_ids]     # running, with a token of every step to come
    engine.step = step
    sys.settrace(trace)
    try:
        with pytest.raises(KeyboardInterrupt):
            if caller == "generate":
                llm.generate(PROMPTS_B[:1], greedy())
            else:
                next(llm.stream(PROMPTS_B[0], greedy()))
    finally:
        sys.settrace(None)
        del engine.step
    assert returned == [True, False], "the interruption did not land after a step: the test tests nothing"
    got += [out.new_token_ids for out in bystander]
    assert sum(got, []) == solo["stream"]
    assert_drained(engine)


@pytest.mark.parametrize("how", ["closed", "collected"])
def test_a_stream_dropped_after_its_request_finished_in_another_callers_step(llm_and_solo, how):
    """Found by a review: a stream whose request had just finished in another caller's step (its
    final output in that caller's hands, to be handed back) and was then closed, or collected in
    a cycle, was not flagged: its outputs went round between callers for ever and
    has_unfinished_requests() stayed True."""
    import gc
    llm, solo = llm_and_solo
    engine = llm.engine

    class Holder:
        pass
    holder = Holder()
    holder.me = holder                 # a cycle: only the collector frees it
    holder.stream = llm.stream(PROMPTS_B[3], greedy(2))
    rid = next(iter(engine.requests))
    stream = holder.stream if how == "closed" else None
    del holder
    dropped = []

    def on_output(out):
        # The stream's request finished in generate's step: its final output is among the others.
        if not dropped and rid not in engine.requests:
            dropped.append(True)
            stream.close() if stream is not None else gc.collect()
    assert tokens(llm.generate(PROMPTS_A, greedy(), on_output=on_output)) == solo["A"]
    assert dropped, "the stream's request did not finish inside generate: the test tests nothing"
    assert not engine.has_unfinished_requests() and not engine.pending_outputs
    assert_drained(engine)


def test_a_stop_while_abandoned_streams_are_settled_loses_no_output_and_no_abort(llm_and_solo):
    """Found by a review: the settling of abandoned streams at the end of a step runs in the
    step's `finally`; a Ctrl-C there lost the step's outputs (a bystander stream missed its token)
    and the abandoned ids not yet aborted (never aborted after)."""
    import gc
    llm, solo = llm_and_solo
    engine = llm.engine
    bystander = llm.stream(PROMPTS_A[5], greedy(40))
    got = [next(bystander).new_token_ids]

    class Holder:
        pass
    holder = Holder()
    holder.me = holder
    holder.s1, holder.s2 = llm.stream(PROMPTS_B[0], greedy(30)), llm.stream(PROMPTS_B[1], greedy(30))
    next(holder.s1), next(holder.s2)
    del holder
    real_execute, real_abort = engine.runner.execute, engine.abort_request
    armed = [True, True]

    def execute(*args, **kwargs):
        if armed[0]:
            armed[0] = False
            gc.collect()               # both streams closed mid-step: their abandon waits for its end
        return real_execute(*args, **kwargs)

    def abort(*args, **kwargs):
        if armed[1]:
            armed[1] = False
            raise KeyboardInterrupt    # Ctrl-C in the settle at the step's end
        return real_abort(*args, **kwargs)
    engine.runner.execute, engine.abort_request = execute, abort
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS_B[2:3], greedy(6))
    finally:
        del engine.runner.execute, engine.abort_request
    assert armed == [False, False], "the stop did not land in the settle: the test tests nothing"
    got += [out.new_token_ids for out in bystander]
    assert sum(got, []) == solo["stream"]
    llm.generate(PROMPTS_A[:1], greedy(4))    # the next call settles what the stop left
    assert not engine.has_unfinished_requests() and not engine.pending_outputs
    assert_drained(engine)
