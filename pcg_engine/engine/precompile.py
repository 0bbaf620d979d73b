"""Parallel kernel pre-compile: the Triton variants that capture and warm-up will meet, compiled in threads first.

Why: CUDA-graph capture and the kernel warm-up (warmup.py) meet the engine's Triton kernel variants
one after another, and each first meeting stops start-up for a compile (0.1-1 s). On the H200, a
cold start of Qwen3-0.6B in full_and_piecewise spent 12.9 s in capture and 6.1 s in warm-up, against
2.4 s and under 1 s when Triton's cache was warm (docs/PERF.md, session 9). A Triton compile spends
most of its time outside the GIL (MLIR passes, LLVM, ptxas), so threads compile variants side by
side: 8 variants on the 2-core dev VM took 12.3-13.6 s in sequence and 6.9-7.7 s in 2 threads.

How: a dry pass over the steps capture and warm-up will run, before Dynamo and Inductor, in which
  * every launch of a Triton JIT kernel becomes Triton's own `warmup=True` call (compile, do not
    launch), inside Triton's AsyncCompileMode over a thread pool: the call returns at once and the
    compile runs in a worker. The compiles go on while Dynamo and Inductor work (start()); before
    capture, finish() waits for them and puts each kernel into its JIT cache, where the real
    launches of capture and warm-up find it;
  * the model is cut to its distinct layers: layer 0 (its norm has no residual to add) and the
    first later layer of each kind (same module types, parameter shapes and dtypes). Identical layers make
    identical launches, so two layers of 28 meet every variant at a fraction of the host time;
  * kernels/fast_launch.py is off: nothing is launched, so nothing may be recorded for replay.
Both switches (compile_only()) hold in the thread running the pass only: an engine serving in
another thread meanwhile launches its kernels as usual.
The KV cache's sizing forward (ModelRunner, before any of this) already runs inside the same
background compiles: its peak memory is the torch ops', which still run. The steps: the full
decode graphs' buckets, run as their capture runs them (the eager model inside
backend.capturing() and pdl.scope()); the piecewise buckets, with the eager model standing in for
the compiled pieces (their custom ops get the same shapes; a variant this misses still compiles
at capture, as without this pass); and warmup.plan()'s steps, which warm_up() reuses.

Safety: only the torch ops between the skipped kernels run, on whatever the skipped kernels' outputs
held. No torch op of the forward indexes memory with an unchecked value a Triton kernel wrote: the MoE
expert ids come from the routing kernel (kernels/moe_route.py), and the one torch consumer of them,
the alignment's torch path for large batches (fused_moe.moe_align_torch), clamps them first; the
align kernels' outputs feed only the grouped GEMM kernel. So garbage stays garbage and never faults.
The KV writes are Triton kernels, skipped: the pass writes no KV block, only the runner's static
input buffers, which every real step rewrites.

Measured (H200, Qwen3-0.6B, full_and_piecewise, docs/PERF.md session 10): cold start 40.6 -> 30.6 s,
warm 12.3 -> 10.6 s, no late variant. The compiles' GIL-held part (Triton's Python front end) still
costs the main thread about as much wherever it runs: with 4 threads instead of 16 the pass took
half as long and Dynamo and Inductor 5 s longer.

Timings (runner.timings): precompile_s, the pass's host time plus precompile_wait_s, finish()'s
wait for compiles still running when Dynamo and Inductor are done; precompile_variants, the
distinct variants made meanwhile (compiled, or loaded from Triton's on-disk cache on a warm
start); late_variants (ModelRunner's VariantCounter), those made after finish() during start-up:
what the pass missed. A/B switches: PCG_PRECOMPILE=0 (read at import) turns the pass off (the
engine then starts as before); PCG_PRECOMPILE_WORKERS=N (read when a pass begins) sets the number of
compile threads (default: one per core, at most 32).
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar

import torch

ENABLED = os.environ.get("PCG_PRECOMPILE", "1") != "0"


def _async_compile_mode():
    """Triton's AsyncCompileMode, or None where this Triton lacks it (3.6 and 3.9 have the same
    interface) or interprets kernels."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    from pcg_engine.kernels import triton_interpreting
    return None if triton_interpreting() else AsyncCompileMode


def available(runner) -> bool:
    from pcg_engine.engine.warmup import has_jit_kernels
    return ENABLED and runner.device.type == "cuda" and _async_compile_mode() is not None and has_jit_kernels(runner)


# ---- counting the variants a start-up makes ------------------------------------------------------

class VariantCounter:
    """Counts the distinct Triton JIT variants made (compiled, or loaded from the disk cache) while
    active, through Triton's jit_post_compile_hook. Counters may be entered and left in any order:
    one module-level hook serves every active counter and forwards to the hook found installed
    when the first was entered, which is put back when the last leaves (unless someone replaced
    the hook meanwhile). Distinct by (kernel, key): on Triton 3.6 a variant the dry pass submitted
    is compiled again by a real launch made before finish() (the trace forward), and finishing
    calls the hook a second time for it."""

    def __init__(self):
        self.seen: set = set()

    @property
    def count(self) -> int:
        return len(self.seen)

    def add(self, kwargs: dict) -> None:
        fn = kwargs.get("fn")
        self.seen.add((id(getattr(fn, "jit_function", fn)), str(kwargs.get("key"))))

    def __enter__(self):
        _HOOK.activate(self)
        return self

    def __exit__(self, *exc):
        _HOOK.deactivate(self)


class _Hook:
    """The one jit_post_compile_hook of the active VariantCounters."""

    def __init__(self):
        self.counters: list[VariantCounter] = []
        self.previous = None

    def __call__(self, *args, **kwargs):
        for counter in self.counters:
            counter.add(kwargs)
        return self.previous(*args, **kwargs) if self.previous is not None else None

    @staticmethod
    def _runtime():
        try:
            from triton import knobs
        except ImportError:
            return None
        return knobs.runtime if hasattr(knobs.runtime, "jit_post_compile_hook") else None

    def activate(self, counter: VariantCounter) -> None:
        runtime = self._runtime()
        if runtime is None or counter in self.counters:
            return
        if not self.counters:
            self.previous = runtime.jit_post_compile_hook
            runtime.jit_post_compile_hook = self
        self.counters.append(counter)

    def deactivate(self, counter: VariantCounter) -> None:
        if counter not in self.counters:
            return
        self.counters.remove(counter)
        runtime = self._runtime()
        if not self.counters and runtime is not None:
            if runtime.jit_post_compile_hook is self:
                runtime.jit_post_compile_hook = self.previous
            self.previous = None


_HOOK = _Hook()


# ---- the dry pass's two switches ---------------------------------------------------------------

# Inside compile_only(), in the context (thread) that entered it only. JITFunction.run is a class
# attribute and fast_launch.ENABLED a module global: set for the pass, both made every thread's
# launches compile only, and an engine serving in one thread while another started up in a
# second launched nothing (wrong results) and lost its direct launches.
_COMPILE_ONLY: ContextVar[bool] = ContextVar("pcg_compile_only", default=False)


class _CompileOnlyRun:
    """JITFunction.run's replacement while any compile_only() is active, in any thread: a launch
    made inside one becomes warmup=True, any other keeps the warmup it came with. The first
    compile_only() to enter installs it and the last to leave, in whichever order, puts back the
    run found then (unless someone replaced it meanwhile: theirs stays, as with _Hook). Outside
    every compile_only() launches cost what they did; meanwhile each costs a call and a
    ContextVar.get more (~0.25 µs on the dev VM, against the JIT launch's tens of µs), in any thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.active = 0
        self.original = self.installed = None

    def enter(self) -> None:
        from triton.runtime.jit import JITFunction
        with self.lock:
            if not self.active:
                original = JITFunction.run

                def run(kernel, *args, grid, warmup, **kwargs):
                    dry = _COMPILE_ONLY.get()
                    return original(kernel, *args, grid=grid, warmup=True if dry else warmup, **kwargs)
                self.original, self.installed = original, run
                JITFunction.run = run
            self.active += 1

    def leave(self) -> None:
        from triton.runtime.jit import JITFunction
        with self.lock:
            self.active -= 1
            if not self.active:
                if JITFunction.run is self.installed:
                    JITFunction.run = self.original
                self.original = self.installed = None


_RUN = _CompileOnlyRun()


@contextmanager
def compile_only():
    """In this context (this thread) only: launches of Triton JIT kernels compile their variant and
    launch nothing (warmup=True), and the direct launches of kernels/fast_launch.py are off
    (fast_launch.off()), so that nothing is recorded. Other threads launch as usual. The compile
    threads of _Background need neither: Triton hands them the compile alone, never a launch."""
    from pcg_engine.kernels import fast_launch
    _RUN.enter()
    token = _COMPILE_ONLY.set(True)
    try:
        with fast_launch.off():
            yield
    finally:
        _COMPILE_ONLY.reset(token)
        _RUN.leave()


def layer_kind(layer: torch.nn.Module) -> tuple:
    """What makes two decoder layers launch the same kernels: their module types, parameter shapes and dtypes."""
    return tuple((type(m).__name__, tuple((tuple(p.shape), p.dtype) for p in m.parameters(recurse=False)))
                 for m in layer.modules())


def distinct_layer_indices(layers) -> list[int]:
    """Layer 0 (no residual comes into it) and the first later layer of each kind."""
    keep, seen = [0], set()
    for i in range(1, len(layers)):
        kind = layer_kind(layers[i])
        if kind not in seen:
            seen.add(kind)
            keep.append(i)
    return keep if len(layers) else []


@contextmanager
def distinct_layers(model: torch.nn.Module):
    """model.model.layers cut to distinct_layer_indices while inside (a model without that list is
    left whole)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        yield model
        return
    inner.layers = torch.nn.ModuleList(layers[i] for i in distinct_layer_indices(layers))
    try:
        yield model
    finally:
        inner.layers = layers


# ---- the pass ------------------------------------------------------------------------------------

def _dry_steps(runner, piecewise_buckets, plan):
    """The pass's steps, as callables: every one a forward of the (cut) eager model."""
    from pcg_engine.compile.cuda_graph import PIECE_PDL
    from pcg_engine.compile.setup import _dummy_forward
    from pcg_engine.engine import warmup

    graphs, model_forward = runner.full_graphs, runner.model.forward
    if graphs is not None:
        for bucket in sorted(graphs.buckets, reverse=True):
            yield lambda b=bucket: graphs.dummy_forward(b)
    for bucket in sorted(piecewise_buckets, reverse=True):
        yield lambda b=bucket: _dummy_forward(runner, model_forward, b)
        if PIECE_PDL:
            # The piece graphs launch their kernels with PDL (compile/cuda_graph.py), attention
            # between them without: the bucket once each way (a few unused attention variants).
            yield lambda b=bucket: _in_pdl_scope(_dummy_forward, runner, model_forward, b)
    for step in plan:
        if step.path != "full":          # a full-graph step is a bucket above
            yield lambda s=step: warmup.run_step(runner, s, forward=model_forward)


def _in_pdl_scope(fn, *args):
    from pcg_engine.kernels import pdl
    with pdl.scope():
        return fn(*args)


class _Background:
    """The compiles of a start-up: a thread pool, Triton's AsyncCompileMode over it and a
    VariantCounter from creation to finish(). Inside compiling(), Triton launches submit their
    compile and launch nothing; leaving it does not wait; finish() waits and fills the JIT caches."""

    def __init__(self, AsyncCompileMode, workers: int):
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="pcg-precompile")
        self.mode = AsyncCompileMode(self.pool)
        self.counter = VariantCounter().__enter__()

    @contextmanager
    def compiling(self):
        from triton.runtime import _async_compile
        self.mode.__enter__()
        try:
            with compile_only():
                yield
        finally:
            _async_compile.active_mode.set(None)   # what the mode's own exit does, but the wait

    def finish(self) -> int:
        """Wait for the compiles; returns the variants made."""
        try:
            type(self.mode).__exit__(self.mode, None, None, None)   # waits, then puts each kernel in its cache
        finally:
            self.pool.shutdown()
            self.counter.__exit__(None, None, None)
        return self.counter.count


def begin(runner, workers: int | None = None):
    """The runner's background compiles, made on first call (None where there is nothing to
    compile): ModelRunner's KV-sizing forward runs inside its compiling() (the forward's peak
    memory is the torch ops', which still run), then start() adds the dry pass."""
    background = getattr(runner, "precompile_background", None)
    if background is None and not getattr(runner, "precompiled", False) and available(runner):
        background = runner.precompile_background = _Background(_async_compile_mode(), workers or default_workers())
    return background


@torch.inference_mode()
def start(runner, piecewise_buckets=(), workers: int | None = None):
    """Run the dry pass (module docstring); its compiles go on in the background: pass the result
    to finish() before capture. Call once the mode's buckets and runner.full_graphs are set (the
    warm-up plan reads them); leaves warmup.plan()'s steps in runner.warmup_plan. None where there
    is nothing to do. A failure is a warning: kernels then compile where first launched."""
    background = begin(runner, workers)
    if background is None or getattr(runner, "precompiled", False):
        return None
    runner.precompiled = True
    from pcg_engine.engine import warmup
    from pcg_engine.kernels import argmax, scatter
    t0 = time.perf_counter()
    try:
        # Warm-up off (kernel_warmup=False): nothing but what capture will launch.
        plan = runner.warmup_plan = warmup.plan(runner) if runner.warmup_enabled() else []
        with distinct_layers(runner.model), background.compiling():
            for step in _dry_steps(runner, piecewise_buckets, plan):
                step()
            lm_head = runner.model.lm_head_weight
            argmax.warm_up(lm_head.shape[0], lm_head.dtype, runner.device)
            scatter.warm_up(runner.device)
        torch.cuda.synchronize(runner.device)
    except Exception as e:
        runner.timings["precompile_s"] = time.perf_counter() - t0
        _failed(runner, e)
        finish(runner, background)
        return None
    runner.timings["precompile_s"] = time.perf_counter() - t0
    return background


def finish(runner, background) -> None:
    """Wait for the background compiles (None: nothing to wait for)."""
    if background is None:
        return
    runner.precompile_background = None
    t0 = time.perf_counter()
    try:
        runner.timings["precompile_variants"] = float(background.finish())
    except Exception as e:
        _failed(runner, e)
    wait = time.perf_counter() - t0
    runner.timings["precompile_wait_s"] = wait
    runner.timings["precompile_s"] = runner.timings.get("precompile_s", 0.0) + wait
    outer = getattr(runner, "variant_counter", None)
    if outer is not None:                 # ModelRunner's: late_variants counts from here
        runner.variants_after_precompile = outer.count


def precompile(runner, piecewise_buckets=(), workers: int | None = None) -> None:
    """start() and finish() back to back."""
    finish(runner, start(runner, piecewise_buckets, workers))


def default_workers() -> int:
    """Compile threads: one per core (at most 32), or PCG_PRECOMPILE_WORKERS (an A/B switch)."""
    try:
        wanted = int(os.environ.get("PCG_PRECOMPILE_WORKERS", "0"))
    except ValueError:
        wanted = 0        # an A/B switch set wrong must not stop the engine from starting
    return max(1, wanted) if wanted > 0 else min(32, os.cpu_count() or 1)


def _failed(runner, error: Exception) -> None:
    warnings.warn(f"kernel pre-compile failed, kernels will compile where first launched: {error!r}")
    runner.timings["precompile_failed"] = 1.0


__all__ = ["ENABLED", "VariantCounter", "available", "begin", "compile_only", "distinct_layer_indices", "distinct_layers",
           "finish", "layer_kind", "precompile", "start"]
