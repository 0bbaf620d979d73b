"""Cached direct launch of Triton kernels: re-issue a launch the JIT has already bound, without it.

Why: `kernel[grid](*args)` costs ~60 µs of host time on the H200's CPU for the attention kernel
(30-odd arguments): the generated binder, one native specialisation per argument, the compile-key
hash, launch metadata. The launch itself (`CompiledKernel.run`, Triton's C launcher) is a fraction
of that. In piecewise mode the attention launches between the graph pieces are the host-bound part
of a decode step, and a step repeats the same launches layer after layer, step after step.

How: the first call of a given argument set goes through the JIT, which returns the
`CompiledKernel`; `jit_launch` records what the JIT handed to it (grid, the bound arguments in
parameter order, tensors as their data pointers) as a `RecordedLaunch`; a later call whose key is
equal calls `compiled.run` directly, as the JIT would have:

    compiled.run(grid_0, grid_1, grid_2, stream, compiled.function, compiled.packed_metadata,
                 launch_metadata, launch_enter_hook, launch_exit_hook, *bound_args_incl_constexprs)

Verified in the sources of Triton 3.5.0, 3.6.0, 3.7.1, 3.8.0 and 3.9.0 (runtime/jit.py
`JITFunction.run`, compiler/compiler.py `CompiledKernel.run`/`__getitem__`, the nvidia driver's
`CudaLauncher.__call__`): that call is the same in all five; `launch_pdl` and
`launch_cooperative_grid` are compile options, stored in the kernel's metadata and read by the
launcher object itself, so they come with the CompiledKernel; constexpr arguments are passed and
skipped by the launcher; a pointer argument may be a plain int (the C launcher's getPointer /
extractPointer take a PyLong as the address, which also skips a cuPointerGetAttribute per
pointer). The JIT passes knobs.runtime.launch_enter/exit_hook, HookChains that are empty unless a
profiler adds to them, and a LazyDict of launch metadata for them; with both chains empty those
calls do nothing, so a direct launch passes None for all three, and is taken only while both are
empty (checked per call: a profiler's launches keep their hooks); other versions, the CPU
interpreter, a kernel with pre-run hooks, or PCG_FAST_LAUNCH=0 (A/B switch, read at import) keep
the plain JIT call, and so does every launch made inside off() in the context (thread) that
entered it: the dry pass of an engine's start-up (engine/precompile.py), while other threads'
engines keep their direct launches.

The key is the caller's business and must determine every recorded argument. `launch` below keys
on the exact arguments (a tensor by data pointer and dtype: that is all of a tensor the kernel
receives and all the JIT specialises on, pointer alignment being a function of the pointer), so
the JIT could not have chosen another binary. A caller may instead keep the first `slots`
arguments (pointers) out of its key and pass them per call: then its key must hold each slot's
dtype and 16-byte-alignment class (the JIT's whole specialisation of a pointer), as
attention/launch_plan.py's does. Not tracked: Triton knobs that change compiled code at run time
(knobs.runtime.debug, instrumentation); the engine sets none of them.

Below Triton's launcher object: `compiled.run` is a CudaLauncher, whose Python __call__ allocates
the kernel's scratch buffers (none for this project's kernels) and calls the C function `launch`
with the launcher's own compile options put in. In Triton 3.6 (the H200's) that is

    run.launch(grid_0, grid_1, grid_2, stream, function, launch_cooperative_grid, launch_pdl,
               None, None, packed_metadata, launch_metadata, enter_hook, exit_hook, *bound_args)

for a kernel without scratch and without tensor descriptors (whose `launch` is then a Python
wrapper). A record of such a kernel calls `launch` itself: ~1-2 µs less host time a launch, which
in piecewise mode is paid once a layer (docs/PERF.md, session 33). Other versions order those
arguments differently (3.9 passes the bound arguments as one tuple after two more), so they keep
`compiled.run`; PCG_RAW_LAUNCH=0 (read at import) keeps it everywhere (A/B runs).

The stream is read per call (a CUDA-graph capture runs on a side stream). Caches are bounded LRUs;
entries hold ints and the CompiledKernel (kept alive, so its CUfunction stays loaded), never a tensor.
"""

from __future__ import annotations

import os
import types
from collections import OrderedDict
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import triton

from pcg_engine import switches
from pcg_engine.kernels import triton_interpreting

__all__ = ["ENABLED", "LaunchCache", "RecordedLaunch", "current_stream", "jit_launch", "jit_only", "launch",
           "off"]

VERIFIED = {(3, 5), (3, 6), (3, 7), (3, 8), (3, 9)}


def _version(text: str) -> tuple[int, int]:
    try:
        major, minor = text.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or -1)
    except ValueError:
        return (0, 0)


try:
    from triton import knobs as _knobs
    from triton.runtime.jit import JITFunction
    _RUNTIME = _knobs.runtime
except ImportError:  # pragma: no cover - a Triton without knobs predates every verified version
    _RUNTIME, JITFunction = None, ()

ENABLED = (switches.read("PCG_FAST_LAUNCH", "1") != "0"
           and not triton_interpreting()
           and _version(triton.__version__) in VERIFIED and _RUNTIME is not None)


def _hook_set(hook) -> bool:
    # 3.5-3.9 keep a HookChain here, empty unless a profiler adds to it; a plain callable or None
    # may be assigned instead (the older spelling)
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or bool(calls)


# The Triton versions whose launcher object's call of its C function _entry repeats (module
# docstring): 3.9's launcher passes the same attributes _entry checks but another argument order.
_RAW_LAYOUT = _version(triton.__version__) == (3, 6)
RAW = os.environ.get("PCG_RAW_LAUNCH", "1") != "0"    # the A/B switch; with _RAW_LAYOUT only

_CHAINS = ((_RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook) if _RUNTIME is not None else (None, None))


# Inside off(), in the context that entered it only. A context variable, not ENABLED: that is one
# module global, and the dry pass that turned it off in one engine's start-up turned off the
# direct launches of an engine serving in another thread meanwhile. Threads start with an empty
# context, so a thread started inside off() is not inside it.
_OFF: ContextVar[bool] = ContextVar("pcg_fast_launch_off", default=False)


@contextmanager
def off():
    """Inside, this context's launches go through the JIT and none is recorded: the dry pass
    (engine/precompile.compile_only), whose JIT launches compile and launch nothing, where a
    direct launch would run its kernel. Other threads keep their direct launches."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def jit_only() -> bool:
    """This launch must go through the JIT, and is not to be recorded: inside off(), or launch
    hooks want launch_metadata built per call (profilers). Asked per call by every direct launch
    and every record, and by nothing else, so that is where off() is checked rather than beside
    each read of ENABLED (five in three files): one ContextVar.get more per call of a function the
    hot paths already call (~20 ns), no call more. The common case (not off, Triton's own chains,
    both empty) is that read and two identity checks."""
    if _OFF.get():
        return True
    enter, leave = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook
    if enter is _CHAINS[0] and leave is _CHAINS[1] and enter is not None:
        return bool(enter.calls or leave.calls)
    return _hook_set(enter) or _hook_set(leave)


# The JIT reads the current device and its current stream per launch (triton's GPUDriver uses
# torch's raw-stream getter); the same C functions here, without torch.cuda's Python wrappers.
_get_device = getattr(torch._C, "_cuda_getDevice", None)
_get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_device() -> int:
    if _get_device is not None:
        return _get_device()
    return triton.runtime.driver.active.get_current_device()


def current_stream(device: int | None = None) -> int:
    """The raw CUDA stream a launch on `device` (default: the current one) goes to now."""
    if device is None:
        device = current_device()
    if _get_stream is not None:
        return _get_stream(device)
    return triton.runtime.driver.active.get_current_stream(device)


def _entry(run, packed) -> tuple:
    """(fn, mid): a launch is fn(grid_0, grid_1, grid_2, stream, function, *mid, *bound_args).
    Triton 3.6's C launch function where the launcher object would only add its compile options
    (no scratch buffer, no tensor-descriptor wrapper), else the launcher object."""
    launch = getattr(run, "launch", None)
    if (RAW and _RAW_LAYOUT and type(run).__name__ == "CudaLauncher" and callable(launch)
            and not isinstance(launch, types.FunctionType)          # 3.6's tensor-descriptor wrapper is one
            and getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0
            and hasattr(run, "launch_cooperative_grid") and hasattr(run, "launch_pdl")):
        return launch, (run.launch_cooperative_grid, run.launch_pdl, None, None, packed, None, None, None)
    return run, (packed, None, None, None)


class RecordedLaunch:
    """One launch as the JIT made it; calling it re-issues it on `stream`, the first `slots`
    arguments (pointers, as ints) supplied per call."""

    __slots__ = ("kernel", "compiled", "run", "launch", "mid", "function", "grid", "slots", "rest")

    def __init__(self, kernel, compiled, grid, slots: int, rest: tuple):
        self.kernel = kernel              # keys may name it by id(): it must outlive them
        self.compiled = compiled          # holds the module loaded while the record lives
        self.run = compiled.run           # the launcher object (a property: initialised by the JIT call)
        # what a launch calls, and its arguments between the function and the kernel's (_entry)
        self.launch, self.mid = _entry(self.run, compiled.packed_metadata)
        self.function = compiled.function
        self.grid = grid
        self.slots = slots
        self.rest = rest

    def __call__(self, stream: int, ptrs: tuple = ()) -> None:
        g0, g1, g2 = self.grid
        self.launch(g0, g1, g2, stream, self.function, *self.mid, *ptrs, *self.rest)

    def args(self, stream: int, ptrs: tuple = ()) -> tuple:
        """What __call__ passes to `self.launch`: a caller that repeats a launch with the same stream
        and pointers keeps the tuple and calls self.launch(*args) itself (attention/launch_plan.py)."""
        return (*self.grid, stream, self.function, *self.mid, *ptrs, *self.rest)


def _as_arg(value):
    """A bound argument as a recorded launch passes it, or _NO if it cannot be recorded."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() if value.is_cuda else _NO
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return _NO  # tuples, tensor descriptors, jit functions as constexprs: leave them to the JIT


_NO = object()


def record(kernel, compiled, grid, args: tuple, kwargs: dict, slots: int = 0) -> RecordedLaunch | None:
    """The launch `kernel[grid](*args, **kwargs)` just made (it returned `compiled`), or None
    where it cannot be re-issued directly."""
    if not (ENABLED and isinstance(kernel, JITFunction)) or kernel.pre_run_hooks or jit_only():
        return None
    if compiled is None or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        return None  # e.g. an asynchronous compile's future
    if callable(grid) or not 1 <= len(grid) <= 3 or not all(type(g) is int for g in grid):
        return None
    # bind + apply_defaults: what the JIT's binder does; launch options are not parameters
    names = kernel.signature.parameters
    bound = kernel.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
    bound.apply_defaults()
    values = [_as_arg(v) for v in bound.arguments.values()]
    if any(v is _NO for v in values) or not all(type(v) is int for v in values[:slots]):
        return None
    if compiled.function is None:
        return None
    return RecordedLaunch(kernel, compiled, tuple(grid) + (1,) * (3 - len(grid)), slots, tuple(values[slots:]))


def jit_launch(kernel, grid, args: tuple, kwargs: dict, slots: int = 0) -> RecordedLaunch | None:
    """Launch through the JIT; return the record of that launch (None where it cannot be made)."""
    compiled = kernel[grid](*args, **kwargs)
    return record(kernel, compiled, grid, args, kwargs, slots)


class LaunchCache:
    """A bounded LRU of recorded launches (or anything) by key: eager mode's fresh allocations
    give new keys all the time, and must not grow memory."""

    def __init__(self, maxsize: int = 256):
        self.maxsize = maxsize
        self.misses = 0           # entries added (tests and benchmarks read it)
        self._entries: OrderedDict = OrderedDict()

    def get(self, key):
        entry = self._entries.get(key)
        if entry is not None:
            # The caches are module-level, shared by engines in other threads: one's put() may
            # evict the key between the two calls (the entry read is still good). No cost unraised.
            try:
                self._entries.move_to_end(key)
            except KeyError:
                pass
        return entry

    def put(self, key, entry) -> None:
        self.misses += 1
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries


def _key_of(value):
    """An argument's part of an exact key: what reaches the kernel and what the JIT specialises on.
    Types are part of it (1, 1.0 and True are equal in Python, not to the JIT); floats by their
    bits (-0.0 == 0.0 in Python). None where the argument cannot be keyed."""
    if isinstance(value, torch.Tensor):
        return (value.data_ptr(), value.dtype, value.is_cuda)
    if isinstance(value, float):
        return (float, value.hex())
    if value is None or isinstance(value, (bool, int, str)):
        return (type(value), value)
    return None


def exact_key(kernel, grid, args: tuple, kwargs: dict):
    """The key of `launch`: kernel, device, grid, every argument and option; None if not keyable."""
    if callable(grid):
        return None
    # id(): a JITFunction hashes its source hash under a lock (µs); the record keeps it alive
    parts = [id(kernel), current_device(), tuple(grid)]
    for a in args:
        k = _key_of(a)
        if k is None:
            return None
        parts.append(k)
    for name, a in kwargs.items():
        k = _key_of(a)
        if k is None:
            return None
        parts.append((name, k))
    return tuple(parts)


_EXACT = LaunchCache(256)


def launch(kernel, grid, *args, **kwargs):
    """`kernel[grid](*args, **kwargs)`, re-issued directly when the same call was seen before."""
    if not ENABLED:
        return kernel[grid](*args, **kwargs)
    key = exact_key(kernel, grid, args, kwargs)
    if key is not None:
        rec = _EXACT.get(key)
        if rec is not None and not jit_only():
            rec(current_stream(key[1]))
            return rec.compiled
    compiled = kernel[grid](*args, **kwargs)
    if key is not None:
        rec = record(kernel, compiled, grid, args, kwargs)
        if rec is not None:
            _EXACT.put(key, rec)
    return compiled
