"""The parallel kernel pre-compile (engine/precompile.py).

On the CPU: the model cut (which layers stand for all), and that both of the dry pass's switches
(the model cut, compile-only launches) are undone however the pass ends; that compile-only launches
hold in the thread that entered compile_only() alone, and are undone whatever order overlapping
ones in two threads leave in; on a CPU runner the pass does nothing. On a GPU (a fresh process with empty Triton and Inductor caches, so that every
variant really compiles): the pass compiles variants, and capture and warm-up after it compile none.
"""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pcg_engine.config import EngineConfig
from pcg_engine.engine import precompile
from pcg_engine.engine.model_runner import ModelRunner
from pcg_engine.models.loader import load_model


class _A(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(width))


def test_distinct_layer_indices_keeps_layer_0_and_the_first_of_each_later_kind():
    layers = nn.ModuleList([_A(4), _A(4), _A(8), _A(4), _A(8), nn.Linear(2, 2)])
    assert precompile.distinct_layer_indices(layers) == [0, 1, 2, 5]
    # layer 0 stands for itself only: it is the one whose norm gets no residual
    assert precompile.distinct_layer_indices(nn.ModuleList([_A(8), _A(4), _A(4)])) == [0, 1]
    assert precompile.distinct_layer_indices(nn.ModuleList([_A(4)])) == [0]
    assert precompile.distinct_layer_indices(nn.ModuleList()) == []


@pytest.mark.parametrize("preset, expect", [("tiny-qwen3", [0, 1]), ("tiny-qwen3-moe", [0, 1])])
def test_distinct_layers_cuts_the_model_and_restores_it(tiny_paths, preset, expect):
    model = load_model(str(tiny_paths[preset]), "cpu", torch.float32)
    layers = model.model.layers
    assert len(layers) > len(expect)
    ran = []
    handles = [layer.register_forward_hook(lambda m, i, o, k=k: ran.append(k)) for k, layer in enumerate(layers)]
    with precompile.distinct_layers(model):
        assert [id(m) for m in model.model.layers] == [id(layers[i]) for i in expect]
    assert model.model.layers is layers
    with pytest.raises(RuntimeError, match="boom"):
        with precompile.distinct_layers(model):
            raise RuntimeError("boom")
    assert model.model.layers is layers
    for h in handles:
        h.remove()
    assert not ran


def test_distinct_layers_leaves_a_model_without_layers_whole():
    model = nn.Linear(2, 2)
    with precompile.distinct_layers(model) as m:
        assert m is model


def _recording_run(monkeypatch):
    """JITFunction.run replaced by a stand-in for Triton's JIT launch that logs its arguments and
    returns the warmup it got: compile_only() wraps whatever run it finds."""
    from triton.runtime.jit import JITFunction
    calls = []

    def recording_run(self, *args, grid, warmup, **kwargs):
        calls.append((self, args, grid, warmup, kwargs))
        return warmup
    monkeypatch.setattr(JITFunction, "run", recording_run)
    return calls


def _launch_is_dry() -> bool:
    """Whether a launch made now, in this thread, compiles only: what kernel[grid](...) calls."""
    from triton.runtime.jit import JITFunction
    return JITFunction.run("fn", grid=(1,), warmup=False)


def test_compile_only_switches_this_threads_launches_and_fast_launch_and_restores_them(monkeypatch):
    from triton.runtime.jit import JITFunction
    from pcg_engine.kernels import fast_launch
    calls = _recording_run(monkeypatch)
    run, fast = JITFunction.run, fast_launch.ENABLED
    assert not fast_launch.jit_only()
    with precompile.compile_only():
        assert JITFunction.run is not run and fast_launch.jit_only()
        assert fast_launch.ENABLED == fast       # the process-wide switch is left alone
        # what kernel[grid](*args, **kwargs) calls: compile (warmup=True), launch nothing
        assert JITFunction.run("fn", 1, 2, grid=(3,), warmup=False, BLOCK=4) is True
        with precompile.compile_only():          # nested: still dry, and still dry after it
            assert _launch_is_dry()
        assert _launch_is_dry() and fast_launch.jit_only()
    assert calls[0] == ("fn", (1, 2), (3,), True, {"BLOCK": 4})
    assert JITFunction.run is run and fast_launch.ENABLED == fast and not fast_launch.jit_only()
    with pytest.raises(ValueError):
        with precompile.compile_only():
            raise ValueError("a step failed")
    assert JITFunction.run is run and fast_launch.ENABLED == fast and not fast_launch.jit_only()
    assert JITFunction.run("fn", grid=(1,), warmup=True) is True     # a real warmup call passes as it came


class _Thread:
    """A thread that runs the callables handed to it one after another, in one context (so a
    compile_only() entered by one call is left by a later one); a call returns its result here."""

    def __init__(self):
        import queue
        import threading
        self.todo, self.done = queue.Queue(), queue.Queue()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while (fn := self.todo.get()) is not None:
            try:
                self.done.put((True, fn()))
            except BaseException as e:  # noqa: BLE001 - raised in the test's thread
                self.done.put((False, e))

    def __call__(self, fn):
        self.todo.put(fn)
        ok, value = self.done.get(timeout=30)
        if not ok:
            raise value
        return value

    def close(self):
        self.todo.put(None)
        self.thread.join(30)


def test_compile_only_leaves_other_threads_launches_and_fast_launches_alone(monkeypatch):
    """One engine's start-up (the dry pass) in one thread while another engine serves in this one:
    the server's launches must launch, and its direct launches stay on (both were process-wide)."""
    from triton.runtime.jit import JITFunction
    from pcg_engine.kernels import fast_launch
    calls = _recording_run(monkeypatch)
    run, fast = JITFunction.run, fast_launch.ENABLED
    starting = _Thread()
    try:
        dry = precompile.compile_only()
        starting(dry.__enter__)
        assert not _launch_is_dry() and calls[-1][3] is False    # this thread launched
        assert starting(_launch_is_dry)                          # the starting one only compiled
        assert fast_launch.ENABLED == fast and not fast_launch.jit_only()
        assert starting(fast_launch.jit_only)
        starting(lambda: dry.__exit__(None, None, None))
    finally:
        starting.close()
    assert JITFunction.run is run and fast_launch.ENABLED == fast and not fast_launch.jit_only()


@pytest.mark.parametrize("first_out", ["first_in", "second_in"])
def test_overlapping_compile_only_in_two_threads_restore_triton_in_either_order(monkeypatch, first_out):
    """Two start-ups overlapping in two threads: each leaves its own thread's launches dry until it
    exits, and when both have, JITFunction.run is Triton's again (the second to enter once put
    the first's dry run back for good when it left last)."""
    from triton.runtime.jit import JITFunction
    from pcg_engine.kernels import fast_launch
    _recording_run(monkeypatch)
    run = JITFunction.run
    a, b = _Thread(), _Thread()
    try:
        ctx_a, ctx_b = precompile.compile_only(), precompile.compile_only()
        a(ctx_a.__enter__)
        b(ctx_b.__enter__)
        assert a(_launch_is_dry) and b(_launch_is_dry) and not _launch_is_dry()
        order = [(a, ctx_a), (b, ctx_b)]
        if first_out == "second_in":
            order.reverse()
        (out, ctx_out), (stays, ctx_stays) = order
        out(lambda: ctx_out.__exit__(None, None, None))
        assert not out(_launch_is_dry) and stays(_launch_is_dry) and not _launch_is_dry()
        assert not out(fast_launch.jit_only) and stays(fast_launch.jit_only)
        stays(lambda: ctx_stays.__exit__(None, None, None))
        assert not a(_launch_is_dry) and not b(_launch_is_dry)
    finally:
        a.close()
        b.close()
    assert JITFunction.run is run


def _fake_compile(fn, key):
    """What Triton passes to jit_post_compile_hook (the keywords counted)."""
    from triton import knobs
    knobs.runtime.jit_post_compile_hook(key=key, repr=f"{fn}[{key}]", fn=SimpleNamespace(jit_function=fn),
                                        compile={"key": key}, is_manual_warmup=False, already_compiled=False)


def test_variant_counters_count_distinct_variants_in_any_order_and_put_the_hook_back():
    from triton import knobs
    seen = []
    previous = knobs.runtime.jit_post_compile_hook

    def user_hook(*args, **kwargs):
        seen.append(kwargs["key"])
    knobs.runtime.jit_post_compile_hook = user_hook
    try:
        kernel_a, kernel_b = object(), object()
        outer = precompile.VariantCounter().__enter__()       # ModelRunner's, entered first
        inner = precompile.VariantCounter().__enter__()       # the background's
        _fake_compile(kernel_a, "k1")
        _fake_compile(kernel_a, "k1")                         # the same variant again (Triton 3.6)
        _fake_compile(kernel_b, "k1")
        inner.__exit__(None, None, None)                      # finished first: not last in
        _fake_compile(kernel_a, "k2")
        assert inner.count == 2 and outer.count == 3
        assert knobs.runtime.jit_post_compile_hook is not user_hook
        outer.__exit__(None, None, None)
        assert knobs.runtime.jit_post_compile_hook is user_hook
        assert seen == ["k1", "k1", "k1", "k2"]              # the hook found installed kept being called
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def test_no_precompile_on_the_cpu(tiny_paths):
    path = str(tiny_paths["tiny-qwen3"])
    config = EngineConfig(model=path, device="cpu", mode="eager", max_num_seqs=4, max_num_batched_tokens=16,
                          max_model_len=64, num_kv_blocks=8)
    runner = ModelRunner(config, path, torch.device("cpu"))
    assert "precompile_s" not in runner.timings and not getattr(runner, "precompiled", False)


# ---- on a GPU: capture and warm-up compile nothing after the pass ---------------------------------

_CHILD = """
import json, sys
import triton
from triton.runtime.jit import JITFunction
hook, run = triton.knobs.runtime.jit_post_compile_hook, JITFunction.run
from pcg_engine.llm import LLM
from pcg_engine.sampling_params import SamplingParams
sizing = json.loads(sys.argv[3])    # the KV sizing forward runs (inside the background compiles) unless blocks are given
llm = LLM(sys.argv[1], device="cuda", dtype="bfloat16", mode=sys.argv[2], max_num_batched_tokens=256,
          max_num_seqs=16, max_model_len=2048, max_capture_tokens=64, compile_cache=False,
          **({"gpu_memory_utilization": 0.3} if sizing else {"num_kv_blocks": 2048}))
restored = triton.knobs.runtime.jit_post_compile_hook is hook and JITFunction.run is run
out = llm.generate([[5, 6, 7, 8, 9, 10, 11]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
print("PCG_RESULT " + json.dumps({"timings": llm.engine.runner.timings, "tokens": list(out[0].token_ids),
                                  "restored": restored}))
"""


def _start(path, mode, tmp_path, precompile_on: bool, sizing: bool) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / f"triton-{mode}-{precompile_on}"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{mode}-{precompile_on}"),
               PCG_PRECOMPILE="1" if precompile_on else "0")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path), mode, json.dumps(sizing)], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PCG_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("PCG_RESULT "):])


@pytest.mark.gpu
@pytest.mark.parametrize("mode, sizing", [("full_and_piecewise", True), ("eager", False)])
def test_precompile_leaves_nothing_to_compile_gpu(mode, sizing, tiny_paths, tmp_path):
    path = tiny_paths["tiny-qwen3"]
    on = _start(path, mode, tmp_path, True, sizing)
    t = on["timings"]
    assert "precompile_failed" not in t and "warmup_failed" not in t
    assert t["precompile_variants"] > 0 and on["restored"]
    assert t["late_variants"] == 0, f"capture and warm-up compiled {t['late_variants']:.0f} variants after the pass"
    off = _start(path, mode, tmp_path, False, sizing)
    assert "precompile_s" not in off["timings"] and off["restored"]
    assert on["tokens"] == off["tokens"]


# ---- the pass itself, on the CPU (a stand-in for Triton's async compile mode) ---------------------

class _FakeAsyncMode:
    """Stands in for Triton's AsyncCompileMode: records that the pass entered and left it."""
    entered = exited = 0

    def __init__(self, executor):
        self.executor = executor

    def __enter__(self):
        from triton.runtime import _async_compile
        if _async_compile.active_mode.get() is not None:
            raise RuntimeError("Another AsyncCompileMode is already active")    # as Triton's does
        _async_compile.active_mode.set(self)
        type(self).entered += 1
        return self

    def __exit__(self, *exc):
        from triton.runtime import _async_compile
        _async_compile.active_mode.set(None)
        type(self).exited += 1


def _cpu_runner(tiny_paths, kernel_warmup=True):
    """kernel_warmup=True: the pass plans the warm-up's steps (on the CPU warm_up itself finds nothing
    to compile and does not run)."""
    path = str(tiny_paths["tiny-qwen3"])
    config = EngineConfig(model=path, device="cpu", mode="eager", max_num_seqs=4, max_num_batched_tokens=16,
                          max_model_len=64, num_kv_blocks=8, kernel_warmup=kernel_warmup)
    return ModelRunner(config, path, torch.device("cpu"))


@pytest.fixture
def fake_triton(monkeypatch):
    _FakeAsyncMode.entered = _FakeAsyncMode.exited = 0
    monkeypatch.setattr(precompile, "available", lambda runner: True)
    monkeypatch.setattr(precompile, "_async_compile_mode", lambda: _FakeAsyncMode)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return _FakeAsyncMode


def test_the_pass_runs_every_planned_step_on_the_distinct_layers_and_undoes_everything(tiny_paths, fake_triton):
    from triton.runtime.jit import JITFunction
    from pcg_engine.engine import warmup
    from pcg_engine.compile.cuda_graph import PIECE_PDL
    from pcg_engine.kernels import fast_launch, pdl
    runner = _cpu_runner(tiny_paths)
    layers = runner.model.model.layers
    ran = []
    for k, layer in enumerate(layers):
        layer.register_forward_hook(lambda m, i, o, k=k: ran.append((k, pdl._depth)))
    run, fast = JITFunction.run, fast_launch.ENABLED
    precompile.precompile(runner, piecewise_buckets=(4, 8))
    plan = warmup.plan(runner)
    # every planned step plus the two buckets, each a forward of layers 0 and 1 only; with PDL in
    # the piece graphs each bucket runs once more, inside pdl.scope() (its kernels' PDL variants)
    per_bucket = 2 if PIECE_PDL else 1
    assert runner.warmup_plan == plan and len(plan) >= 1
    assert len(ran) == 2 * (len(plan) + 2 * per_bucket) and {k for k, _ in ran} == {0, 1}
    assert sum(1 for _, depth in ran if depth) == (2 * 2 if PIECE_PDL else 0) and pdl._depth == 0
    assert fake_triton.entered == fake_triton.exited == 1
    assert runner.model.model.layers is layers and JITFunction.run is run and fast_launch.ENABLED == fast
    from triton.runtime import _async_compile
    assert _async_compile.active_mode.get() is None
    t = runner.timings
    assert t["precompile_s"] >= t["precompile_wait_s"] >= 0 and "precompile_failed" not in t
    assert runner.precompiled
    precompile.precompile(runner)           # once per runner
    assert fake_triton.entered == 1


def test_a_failing_pass_warns_and_leaves_the_runner_as_it_was(tiny_paths, fake_triton, monkeypatch):
    from triton import knobs
    from triton.runtime.jit import JITFunction
    from pcg_engine.kernels import fast_launch
    runner = _cpu_runner(tiny_paths)
    layers, run, hook = runner.model.model.layers, JITFunction.run, knobs.runtime.jit_post_compile_hook
    fast = fast_launch.ENABLED

    def broken(*args, **kwargs):
        raise RuntimeError("a dry step failed")
    monkeypatch.setattr(runner.model, "forward", broken)
    with pytest.warns(UserWarning, match="pre-compile failed"):
        precompile.precompile(runner)
    from triton.runtime import _async_compile
    assert runner.timings["precompile_failed"] == 1.0 and runner.timings["precompile_s"] > 0
    assert fake_triton.entered == fake_triton.exited == 1
    assert runner.model.model.layers is layers and JITFunction.run is run and fast_launch.ENABLED == fast
    assert knobs.runtime.jit_post_compile_hook is hook and _async_compile.active_mode.get() is None


def test_without_warm_up_the_pass_runs_only_what_capture_will(tiny_paths, fake_triton):
    runner = _cpu_runner(tiny_paths, kernel_warmup=False)
    ran = []
    runner.model.model.layers[0].register_forward_hook(lambda m, i, o: ran.append(1))
    precompile.precompile(runner, piecewise_buckets=(4, 8, 16))
    from pcg_engine.compile.cuda_graph import PIECE_PDL
    assert runner.warmup_plan == [] and len(ran) == 3 * (2 if PIECE_PDL else 1)   # (see the test above)


def test_one_background_from_the_kv_sizing_to_finish(tiny_paths, fake_triton):
    runner = _cpu_runner(tiny_paths)
    first = precompile.begin(runner)
    assert first is not None and precompile.begin(runner) is first      # the pass takes it over
    with first.compiling():
        pass                                                          # the KV sizing's forward
    assert precompile.start(runner) is first
    precompile.finish(runner, first)
    assert runner.precompile_background is None and precompile.begin(runner) is None   # once per runner
    assert fake_triton.entered == 2 and fake_triton.exited == 1      # entered per use, waited once


def test_a_failed_start_up_ends_the_background_compiles(tiny_paths, fake_triton, monkeypatch):
    import threading
    from triton import knobs
    hook = knobs.runtime.jit_post_compile_hook

    def failing_setup(runner, progress=None):      # compiles begun (as by the KV sizing), then a failure
        assert precompile.begin(runner) is not None
        raise RuntimeError("no room for the KV cache")
    monkeypatch.setattr(ModelRunner, "_setup_mode", failing_setup)
    path = str(tiny_paths["tiny-qwen3"])
    config = EngineConfig(model=path, device="cpu", mode="eager", max_num_seqs=4, max_num_batched_tokens=16,
                          max_model_len=64, num_kv_blocks=8)
    with pytest.raises(RuntimeError, match="no room"):
        ModelRunner(config, path, torch.device("cpu"))
    assert fake_triton.exited == 1 and knobs.runtime.jit_post_compile_hook is hook
    assert not [t for t in threading.enumerate() if t.name.startswith("pcg-precompile")]
