"""Compile Triton kernels for sm_90 on a machine without a GPU, as the JIT would on the H200.

Why: the CPU tests run the kernels in Triton's interpreter, which executes the Python body and never
type-checks it the way the compiler does (a variable redefined with another shape inside a runtime
`if` runs fine there and fails to compile on the GPU). Triton's NVIDIA backend compiles for a
GPUTarget without a GPU (the wheel bundles ptxas), so the same check can run on the CPU machine.

How: `capture` runs the engine's own launchers (on CPU tensors) with `JITFunction.run` replaced by a
recorder, so the kernel, arguments and launch options are exactly what a GPU launch would hand the
JIT. `bind` then specialises those arguments with the JIT's own binder and the CUDA backend (pointer
dtypes and 16-byte alignment, integer classes 1 / multiple of 16 / other, constexprs), which is the
key the GPU would compile under; `compile_task` compiles it with triton.compile for sm_90.

Must run in a process where TRITON_INTERPRET is 0 when triton is first imported (the kernel tests'
conftest makes every kernel an interpreted function); sm90_compile_cases.py, run as a script, is
that process.
"""

from __future__ import annotations

import importlib
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

TARGET = GPUTarget("cuda", 90, 32)   # the H200: sm_90, warp size 32


def unavailable() -> str | None:
    """Why sm_90 compiles cannot run with this Triton, or None when they can."""
    if "nvidia" not in triton.backends.backends:
        return "the installed triton has no NVIDIA backend"
    try:
        if not ptxas_path():
            return "triton finds no ptxas"
    except Exception as e:  # noqa: BLE001 - any failure to locate ptxas means: cannot compile here
        return f"triton finds no ptxas ({type(e).__name__}: {e})"
    return None


def ptxas_path() -> str | None:
    """The ptxas bundled with the installed triton, for TARGET."""
    from triton.backends.nvidia.compiler import get_ptxas
    try:
        return get_ptxas(TARGET.arch).path
    except TypeError:   # older Triton: get_ptxas() takes no arch
        return get_ptxas().path


@contextmanager
def capture(launches: list, label: str):
    """Record every JIT launch made inside as (label, kernel, args, kwargs) instead of running it.
    The launchers' outputs stay uninitialised, which is fine: only shapes flow on."""
    real_run = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((label, self, args, kwargs))
        return None   # what a launch returns is read only by fast_launch.record, which then skips

    JITFunction.run = record
    try:
        yield
    finally:
        JITFunction.run = real_run


_BACKEND = None


def bind(kernel: JITFunction, args: tuple, kwargs: dict) -> dict:
    """The compile task the JIT would make of kernel[grid](*args, **kwargs) on an sm_90 device."""
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, _BACKEND)
    _, specialization, options = binder(*args, **kwargs)
    names = kernel.arg_names
    signature = {n: spec[0] for n, spec in zip(names, specialization)}
    constexprs = {(i,): spec[1] for i, spec in enumerate(specialization) if spec[0] == "constexpr"}
    attrs = {(i,): _BACKEND.parse_attr(spec[1]) for i, spec in enumerate(specialization)
             if spec[0] != "constexpr" and isinstance(spec[1], str)}
    return dict(module=kernel.fn.__module__, name=kernel.fn.__name__, signature=signature,
                constexprs=constexprs, attrs=attrs, options=dict(options))


def task_key(task: dict) -> str:
    """Equal keys compile the same binary (the launches of one variant at other shapes)."""
    return repr((task["module"], task["name"], sorted(task["signature"].items()), sorted(task["constexprs"].items()),
                 sorted(task["attrs"].items()), sorted(task["options"].items())))


def describe(task: dict) -> str:
    """kernel(constexprs; launch options): what distinguishes one compile from another."""
    names = list(task["signature"])
    consts = ", ".join(f"{names[i[0]]}={v}" for i, v in sorted(task["constexprs"].items()))
    opts = ", ".join(f"{k}={v}" for k, v in sorted(task["options"].items()))
    return f"{task['name']}({consts}; {opts})"


def defined_kernels(package) -> set[tuple[str, str]]:
    """(module, name) of each @triton.jit function named *_kernel in the package's sources: what
    launchers launch (the helpers kernels call, like _attend_tiles, compile inside those), so a
    kernel no case launches is found when it is added."""
    root = Path(list(package.__path__)[0])   # __path__: pcg_engine is a namespace package
    found = set()
    for path in sorted(root.rglob("*.py")):
        if not re.search(r"^\s*@triton\.jit", path.read_text(), re.M):
            continue
        name = ".".join((package.__name__, *path.relative_to(root).with_suffix("").parts))
        for value in vars(importlib.import_module(name)).values():
            if isinstance(value, JITFunction) and value.fn.__module__ == name and value.fn.__name__.endswith("_kernel"):
                found.add((name, value.fn.__name__))
    return found


def compile_task(task: dict) -> tuple[str | None, float, float, int]:
    """(None or the compiler's error message, wall seconds, CPU seconds incl. ptxas, the number of
    asynchronous global-to-shared copies in the TTGIR: > 0 where the software pipeliner
    multi-buffered a loop's loads). Runs in a worker process; CPU time is what a compile costs
    whatever else the machine is running."""
    kernel = getattr(importlib.import_module(task["module"]), task["name"])
    start, cpu = time.perf_counter(), _cpu()
    error, async_copies = None, 0
    try:
        src = ASTSource(kernel, task["signature"], constexprs=task["constexprs"], attrs=task["attrs"])
        compiled = triton.compile(src, target=TARGET, options=task["options"])
        async_copies = compiled.asm.get("ttgir", "").count("async_copy_global_to_local")
    except Exception as e:  # noqa: BLE001 - every compiler failure is the finding to report
        error = f"{type(e).__name__}: {e}"
    return error, time.perf_counter() - start, _cpu() - cpu, async_copies


def constexpr(task: dict, name: str):
    """The value of the task's constexpr `name` (None if it is not one)."""
    names = list(task["signature"])
    return next((v for (i,), v in task["constexprs"].items() if names[i] == name), None)


def must_pipeline(task: dict) -> bool:
    """Decode attention with num_stages >= 2 streams K/V tiles in a loop: its loads must be
    multi-buffered (session 15 found Triton 3.6 does it at the engine's real specialisation; a
    change that lost it, e.g. an argument that stops being divisible by 16, would cost the long
    contexts their bandwidth with no test failing)."""
    return (task["name"] == "_unified_attention_kernel" and constexpr(task, "DECODE") is True
            and task["options"].get("num_stages", 1) >= 2)


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


# ---- self-test: a kernel the interpreter runs and the compiler refuses ------------------------

@triton.jit
def _shape_redefined_kernel(ptr, n, WIDE: tl.constexpr):
    # The bug this check exists for: `src` is [WIDE] pointers, and a runtime branch rebinds it to
    # [WIDE // 2]; the interpreter takes one branch and never notices, the compiler must merge both.
    src = ptr + tl.arange(0, WIDE)
    if n > 0:
        src = ptr + tl.arange(0, WIDE // 2)
    tl.store(src, 1.0)


SELF_TEST = "self-test (must FAIL)"


def self_test_launch(launches: list) -> None:
    """Record a launch of the bad kernel, as a launcher would make it."""
    import torch
    with capture(launches, SELF_TEST):
        _shape_redefined_kernel[(1,)](torch.empty(64), 3, WIDE=64)
