"""Kernel tests run the real Triton kernels: compiled on a GPU, interpreted on a CPU-only machine.

Triton decides between compiling and interpreting when it decorates a function (its own
tl.sum / tl.cumsum included), reading TRITON_INTERPRET then. This file sets the variable at
import time, which covers everything decorated afterwards. But a whole-suite run imports triton
earlier (torch._dynamo does, while collecting other directories), so every jit function already
decorated for a GPU, in triton.language and in pcg_engine, is swapped for an interpreted copy in
its module; kernels and launchers look them up as module globals when they run.
"""

import math
import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()


def _interpret_already_decorated_kernels():
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if module is None or not (name.startswith("triton.language") or name.startswith("pcg_engine")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                setattr(module, attr, InterpretedFunction(value.fn))


if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.sum, InterpretedFunction):
        _interpret_already_decorated_kernels()


def _interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run the kernels here, or None. Triton 3.6's interpreter turns
    a loop bound built from a scalar argument (range(0, n + 1, step)) into a Python int with
    int() of a one-element array, which numpy 2.4 refuses: every attention test would then fail
    with an obscure TypeError deep inside triton."""
    if ON_GPU:
        return None
    import numpy as np
    try:
        int(np.array([1]))
    except TypeError:
        import triton
        from triton.runtime import interpreter
        import inspect
        if "int(self.handle.data)" in inspect.getsource(interpreter):
            return (f"triton {triton.__version__}'s CPU interpreter does not work with numpy {np.__version__} "
                    "(it converts one-element arrays with int()): pip install 'numpy<2.4', or a newer triton")
    return None


_PROBLEM = _interpreter_problem()


@pytest.fixture(autouse=True)
def _interpreter_usable():
    if _PROBLEM:
        pytest.fail(_PROBLEM, pytrace=False)


@pytest.fixture
def device() -> str:
    """Where the small-shape correctness tests run: the GPU when there is one."""
    return "cuda" if ON_GPU else "cpu"


@pytest.fixture
def poison_empty(monkeypatch):
    """Make torch.empty return NaN-filled float tensors, so an output element the kernel forgot
    to write shows up as NaN instead of as whatever the allocator left there."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture
def rel_err():
    """Norm-wise relative error, the measure for bf16 results at real shapes."""
    def err(out: torch.Tensor, ref: torch.Tensor) -> float:
        return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
    return err
