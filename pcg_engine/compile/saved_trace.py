"""A saved trace: a warm start loads the traced, split and compiled forward instead of tracing it.

Why: with Inductor's code served from the compile cache, Dynamo's trace of the whole model is the
largest item of a warm start (4.4 of 11.6 s for Qwen3-0.6B on the H200, session 11; 7.3 s on the
CPU dev machine, session 8), and it repeats the same work every start. torch (2.10 and later)
can trace a function ahead of time and save the result: `torch.compile(...).aot_compile` keeps
the FX graph's compiled form, its guards and the bytecode that feeds the graph from the module's
parameters, provided the backend returns a serializable callable.

  cold start (compile-cache miss)  Dynamo traces through `aot_compile`; the backend compiles each
                                   distinct piece with `standalone_compile(aot=True)` (Inductor's
                                   code and its kernels in one blob) and returns a `SavedSplit`:
                                   the split module, before the runtime wrappers, and those blobs.
                                   The whole is written to the cache entry (`file_name`) before
                                   the manifest, so the manifest's checksums cover it.
  warm start (hit)                 The file is loaded: no Dynamo trace, no AOTAutograd, no Inductor
                                   cache lookup. The backend puts the same wrappers (CUDA graph
                                   pieces, recording ops) around the loaded pieces
                                   (`PcgBackend.rebuild`).

One file per KV-cache shape: the KV caches are graph inputs of fixed shape, and on CUDA their size
follows the free memory, which can differ between two starts; the block size (block_size, not in
the cache key) is part of the shape too. A hit without the file for this
start's size traces and adds it to the entry.

Nothing here can stop a start: a save that fails (no disk space, an Inductor with its caches
disabled) leaves no file and the start goes on with what it traced; a load that fails (a guard
refusing this start's tensors: another device; torch's compatibility check) warns, traces, and
saves a fresh file in its place. The reason is kept in `CompiledForward.saved_trace_error`.
PCG_SAVED_TRACE=0 turns the mechanism off (read at each set-up): every start traces, as before;
the compile cache then serves Inductor's code only.

What the cache key must cover, because a loaded trace keeps every decision made while tracing:
model config, sources, versions, dtype, buckets, mode, the PCG_* switches and Inductor's
TORCHINDUCTOR_* settings (cache.py). Settings changed in-process (`torch._inductor.config.x = ...`)
are not covered: set them through the environment, or turn the saved trace off.

Guards: the compiled forward keeps Dynamo's tensor guards on its inputs and buffers only
(`guard_filter`), traced or loaded: the model's parameters never change shape, dtype or device
under a runner, and the cache key ties a saved trace to the model. Building, saving and loading the
guards on ~300 parameters cost a warm start ~0.5 s. A loaded forward checks them on its first call;
after that, as after a save, the forward runs Dynamo's bytecode without a guard check (the runner
always passes slices of the same two int64 buffers).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading

import torch

ENV = "PCG_SAVED_TRACE"
FORMAT = 1

# The backend that rebuilds the split module while `load` deserializes in this thread
# (deserialization is a classmethod of the saved callable and gets nothing but the bytes).
_loading = threading.local()


def file_name(num_kv_blocks: int, block_size: int) -> str:
    """The trace's file in its cache entry: one per KV-cache shape (the number of blocks and the
    block size; the cache key covers the rest of the shape, heads and head size, and its dtype)."""
    return f"trace-kv{num_kv_blocks}x{block_size}.bin"


def guard_filter(entries):
    """Dynamo's guard filter for the compiled forward (see the module docstring)."""
    return torch.compiler.keep_tensor_guards_unsafe(entries, keep_parameters=False)


def enabled() -> bool:
    """On unless PCG_SAVED_TRACE=0, on a torch that has it, with Inductor compiling the pieces (the
    saved pieces are Inductor's: PCG_PIECE_COMPILER=eager, an A/B switch, traces every start) and
    its caches allowed (torch refuses an AOT trace under force_disable_caches)."""
    if os.environ.get(ENV, "1") == "0" or os.environ.get("PCG_PIECE_COMPILER", "inductor") != "inductor":
        return False
    if not supported():
        return False
    import torch._inductor.config
    return not torch._inductor.config.force_disable_caches


def supported() -> bool:
    """torch has the AOT trace, its loader and Inductor's standalone compile (2.10 and later)."""
    try:
        import torch._dynamo.aot_compile as aot
        import torch._inductor
    except ImportError:
        return False
    return (hasattr(aot, "aot_compile_fullgraph") and hasattr(torch.compiler, "load_compiled_function")
            and hasattr(torch._inductor, "standalone_compile") and hasattr(torch._dynamo.config, "enable_aot_compile"))


def compile_piece(gm: torch.fx.GraphModule, example_inputs):
    """Inductor on one piece, as a self-contained artifact that can be written out (`artifact_bytes`)."""
    from torch._inductor import standalone_compile
    return standalone_compile(gm, list(example_inputs), dynamic_shapes="from_tracing_context", aot=True)


def artifact_bytes(artifact) -> bytes:
    return artifact.serialize()


def load_artifact(data: bytes, bare_output: bool):
    """A piece's compiled callable from artifact_bytes. A loaded artifact returns its outputs as a
    list even where the piece's graph returns one bare value (the last piece, the final norm's
    output), which the fresh artifact unwraps; bare_output restores that."""
    from torch._inductor.standalone_compile import AOTCompiledArtifact
    artifact = AOTCompiledArtifact.deserialize(data)
    if not bare_output:
        return artifact

    def unwrapped(*args):
        return artifact(*args)[0]
    return unwrapped


class SavedSplit:
    """What the backend returns under `aot_compile`: runs the split module (with its wrappers);
    serializes the state `PcgBackend.rebuild` makes it from again. Dynamo requires a
    SerializableCallable: `serializable()` registers this class as one when it is first needed
    (a base class would import Dynamo with this module; the set-up times that import as compile)."""

    def __init__(self, module, state: dict):
        self.module, self.state = module, state

    def __call__(self, *args):
        return self.module(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn) -> bytes:
        if fn.state is None:
            raise RuntimeError("this forward was loaded or already saved: its pieces' bytes are gone")
        return pickle.dumps({"format": FORMAT, **fn.state})

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes):
        state = pickle.loads(data)
        if state.get("format") != FORMAT:
            raise ValueError(f"saved trace format {state.get('format')!r}, expected {FORMAT}")
        backend = getattr(_loading, "backend", None)
        if backend is None:
            raise RuntimeError("a saved trace is loaded through saved_trace.load(), which names its backend")
        return cls(backend.rebuild(state), None)     # the bytes have served: not kept


def serializable(module, state: dict) -> SavedSplit:
    from torch._dynamo.aot_compile_types import SerializableCallable
    if not issubclass(SavedSplit, SerializableCallable):
        SerializableCallable.register(SavedSplit)
    return SavedSplit(module, state)


def pickle_split(split: torch.fx.GraphModule, pieces) -> bytes:
    """The split module as FX pickles it (its code and its submodules' code, each traced again on
    load), taken before the backend installs the runtime wrappers on it. The pieces (names in
    `pieces`) go as empty modules: the loaded artifacts replace them, and re-tracing their graphs
    was a third of a load's time."""
    saved = {name: split._modules[name] for name in pieces}
    try:
        for name in pieces:
            split._modules[name] = torch.nn.Module()
        return pickle.dumps(split)
    finally:
        split._modules.update(saved)


def trace(compiled, args: tuple):
    """Dynamo's AOT trace of `compiled` (a torch.compile'd function, made under `aot_enabled()`) on
    args, the backend compiling as it goes: an AOTCompiledFunction, called as fn(self, *args)."""
    with aot_enabled():
        return compiled.aot_compile((args, {}))


def save(traced, path) -> None:
    """Write a traced forward to path (atomically: a crash leaves no partial file under that name),
    then drop the serialized pieces its SavedSplit held for this."""
    tmp = f"{path}.tmp"
    try:
        traced.save_compiled_function(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    split = getattr(getattr(traced, "_artifacts", None), "compiled_fn", None)
    if isinstance(split, SavedSplit):
        split.state = None


def remove(path) -> None:
    for name in (path, f"{path}.tmp"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(name)


def load(path, backend):
    """The AOTCompiledFunction saved at path, its pieces rebuilt by `backend`."""
    _loading.backend = backend
    try:
        with aot_enabled(), open(path, "rb") as f:
            return torch.compiler.load_compiled_function(f)
    finally:
        _loading.backend = None


def aot_enabled():
    """torch 2.11 has the AOT trace behind a config flag (on by default from 2.13)."""
    return torch._dynamo.config.patch(enable_aot_compile=True)
