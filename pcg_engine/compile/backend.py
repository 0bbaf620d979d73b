"""The torch.compile backend: split at attention, compile each piece with Inductor, share identical pieces.

Dynamo traces the flat model once (token dimension symbolic) and calls this backend with the FX
graph. With `split=True` the graph is cut at the splitting ops (`split.py`); the pieces' example
inputs are the fake values Dynamo left on their placeholders (`submodule_inputs`), and each
piece is compiled by Inductor for the general symbolic shape. Pieces with the same structure and
input metadata share one compiled artifact. `wrap_piece` (CUDA graphs) wraps every compiled piece.
With `split=False` the whole graph goes to Inductor as one piece (mode 'compile'). The splitting-op
submodules run eagerly between the pieces; `eager_call` turns each into a direct call of the op's
Python kernel, the least host work per layer.

What the counters mean: `dynamo_traces` counts backend invocations (one per Dynamo trace; a second
one means a retrace), `loaded_traces` forwards loaded from a saved trace (`rebuild`),
`inductor_compiles` the pieces actually handed to Inductor, `reuses` the pieces that took another
piece's artifact.
"""

import contextlib
import operator
import os
import pickle
import re
import time
from dataclasses import dataclass, field

import torch

from pcg_engine.compile import saved_trace
from pcg_engine.compile.split import Submodule, piece_key, split_graph
from pcg_engine.custom_ops import python_kernel


@dataclass
class CompileStats:
    dynamo_traces: int = 0
    loaded_traces: int = 0     # forwards loaded from a saved trace instead (saved_trace.py)
    submodules: int = 0        # pieces + splitting-op submodules of the last trace
    pieces: int = 0            # compiled (non-attention) pieces of the last trace
    splitting_nodes: int = 0   # attention nodes of the last trace
    inductor_compiles: int = 0  # pieces handed to the piece compiler (Inductor unless PCG_PIECE_COMPILER)
    reuses: int = 0
    inductor_s: float = 0.0    # wall time inside that compiler (the set-up derives dynamo_s from it)
    keys: list = field(default_factory=list)   # piece key of each piece, in order

    @property
    def set_ups(self) -> int:
        """Forwards made, traced or loaded: one per runner; a second one means a retrace."""
        return self.dynamo_traces + self.loaded_traces


def inductor_compile(gm: torch.fx.GraphModule, example_inputs):
    """Inductor on one graph; returns a callable taking the graph's inputs positionally."""
    try:
        from torch._inductor.compile_fx import compile_fx
    except ImportError:  # pragma: no cover - older layouts keep only the public wrapper
        from torch._inductor import compile as compile_fx
    # What compile_fx returns takes the inputs positionally (it may carry a `_boxed_call`
    # attribute copied from an inner function; that does not describe its own convention).
    return compile_fx(gm, list(example_inputs))


def eager_piece(gm: torch.fx.GraphModule, example_inputs):
    """No compiler: the piece runs its FX graph op by op (in CUDA graphs, the kernels it launches are
    captured as they are). An A/B switch (PCG_PIECE_COMPILER=eager) that tells what Inductor's code
    adds or saves against the ops the model calls, most of them this project's fused kernels."""
    return gm.forward


# PCG_PIECE_COMPILER picks the default piece compiler (read when a backend is made).
PIECE_COMPILERS = {"inductor": inductor_compile, "eager": eager_piece}
# dump_graph's file names: traced_graph.py, split_graph.py, and NNN_<submodule>.py per submodule
DUMP_FILE = re.compile(r"(traced_graph|split_graph|\d{3,}_submod_\d+)\.py")


def _default_piece_compiler():
    name = os.environ.get("PCG_PIECE_COMPILER", "inductor")
    if name not in PIECE_COMPILERS:
        raise ValueError(f"PCG_PIECE_COMPILER={name!r}: expected one of {', '.join(PIECE_COMPILERS)}")
    return PIECE_COMPILERS[name]


def _python_dispatcher():
    try:
        from torch._dispatch.python import enable_python_dispatcher
        return enable_python_dispatcher()
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()


class _Recorder(torch.fx.Interpreter):
    """Runs the split module on fake inputs, recording each submodule's arguments."""

    def __init__(self, module):
        super().__init__(module)
        self.args: dict[str, tuple] = {}

    def call_module(self, target, args, kwargs):
        assert not kwargs, "split submodules take positional inputs only"
        self.args[target] = args
        return super().call_module(target, args, kwargs)


def submodule_inputs(split, subs, fake_mode, fakes) -> dict[str, tuple]:
    """Each submodule's example inputs (fake tensors and SymInts), by name.

    Dynamo leaves the fake value of every node in `meta["example_value"]` and split_module copies
    it onto each submodule's placeholders, so they are read from there; running the split module on
    the fake inputs through an FX interpreter (`_Recorder`) gives the same values (the same piece
    keys: tests/compile/test_compile_split.py) and stays as the fallback for a graph without them.
    Reading them saves that fake run, ~1.2 s of a warm start for Qwen3-0.6B's 57 submodules on the
    CPU dev machine."""
    inputs = {}
    for sub in subs:
        values = tuple(n.meta.get("example_value") for n in sub.graph_module.graph.nodes if n.op == "placeholder")
        if any(v is None for v in values):
            break
        inputs[sub.name] = values
    else:
        return inputs
    recorder = _Recorder(split)
    with fake_mode or contextlib.nullcontext(), _python_dispatcher():
        recorder.run(*fakes)
    return recorder.args


def _fake_inputs(gm, example_inputs):
    """Fake values of the graph inputs, in the backend's fake mode, with the symbolic token dim.

    Dynamo records the symbolic context of every input tensor in the tracing context, so
    `from_tensor` on the real example input gives back its symbolic shape; SymInt inputs pass as is.
    """
    from torch._guards import detect_fake_mode
    fake_mode = detect_fake_mode(example_inputs)
    fakes = []
    for value in example_inputs:
        if isinstance(value, torch.Tensor) and fake_mode is not None:
            value = fake_mode.from_tensor(value)
        fakes.append(value)
    return fake_mode, fakes


def _returns_bare_value(gm: torch.fx.GraphModule) -> bool:
    """Does the graph return one value rather than a tuple? (split_module gives a partition with
    one output a bare return; Dynamo's whole graph always returns a tuple.)"""
    return not isinstance(next(iter(reversed(gm.graph.nodes))).args[0], (tuple, list))


class EagerOp:
    """A splitting-op submodule run as a direct call of the op's Python kernel (see eager_call).
    `target` is the op, `kernel` its Python kernel, `pick` orders the submodule's inputs as the
    op's arguments; replay programs (replay_program.py) read them."""

    __slots__ = ("target", "kernel", "pick")

    def __init__(self, target, kernel, pick):
        self.target, self.kernel, self.pick = target, kernel, pick

    def __call__(self, *inputs):
        self.kernel(*self.pick(inputs))
        return ()


def eager_call(gm: torch.fx.GraphModule):
    """What the split module calls for a splitting-op submodule, which runs eagerly once per layer
    per step: the op's Python kernel itself (an EagerOp) when the submodule is one call of a pcg op
    on its inputs that returns nothing (the dispatcher, nn.Module.__call__ and GraphModule's call
    wrapper each cost µs of host time and, outside a trace, only forward to that kernel); else the
    graph's code."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    calls = [n for n in nodes if n.op == "call_function"]
    if len(calls) != 1 or len(nodes) != len(placeholders) + 2:
        return gm.forward
    call, output = calls[0], nodes[-1]
    kernel = python_kernel(call.target)
    if (kernel is None or call.kwargs or len(call.args) < 2 or output.args != ((),)
            or any(a not in placeholders for a in call.args)):
        return gm.forward
    # two or more indices: itemgetter returns a tuple
    return EagerOp(call.target, kernel, operator.itemgetter(*(placeholders.index(a) for a in call.args)))


class PcgBackend:
    def __init__(self, splitting_ops=None, split: bool = True, wrap_piece=None, compile_piece=None,
                 on_split=None, wrap_splitting=None):
        from pcg_engine.attention.op import SPLITTING_OPS
        self.splitting_ops = list(splitting_ops if splitting_ops is not None else SPLITTING_OPS)
        self.split = split
        self.wrap_piece = wrap_piece            # (compiled, piece_index, key) -> callable
        self.wrap_splitting = wrap_splitting    # (eager callable of a splitting op) -> callable
        self.compile_piece = compile_piece or _default_piece_compiler()
        self.on_split = on_split                # (split_module, submodules, fake_inputs) -> None
        self.stats = CompileStats()
        self.artifacts: dict[str, object] = {}  # piece key -> compiled callable
        self.split_module: torch.fx.GraphModule | None = None
        self.submodules: list[Submodule] = []
        self.graph: torch.fx.GraphModule | None = None
        # Set by CompiledForward while saved_trace.trace runs: pieces are compiled as
        # standalone artifacts and the result is serializable (saved_trace.py).
        self.saving = False

    def _compile(self, gm, args, key):
        compiled = self.artifacts.get(key)
        if compiled is not None:
            self.stats.reuses += 1
            return compiled
        t0 = time.perf_counter()
        if self.saving:
            compiled = saved_trace.compile_piece(gm, args)   # callable, and savable
        else:
            compiled = self.compile_piece(gm, args)
        self.stats.inductor_s += time.perf_counter() - t0
        self.stats.inductor_compiles += 1
        self.artifacts[key] = compiled
        return compiled

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.stats.dynamo_traces += 1
        self.graph = gm
        fake_mode, fakes = _fake_inputs(gm, example_inputs)
        if not self.split:
            key = piece_key(gm, fakes)
            compiled = self._compile(gm, fakes, key)
            return self._saved(self._install(None, [], [key], [compiled]), None, [], [key], [False])
        split, subs = split_graph(gm, self.splitting_ops)
        pieces = [s for s in subs if not s.is_splitting_op]
        # Pickled before _install puts the runtime wrappers on it (saved_trace.py).
        split_state = saved_trace.pickle_split(split, [s.name for s in pieces]) if self.saving else None
        inputs = submodule_inputs(split, subs, fake_mode, fakes)
        keys = [piece_key(sub.graph_module, inputs[sub.name]) for sub in pieces]
        compiled = [self._compile(sub.graph_module, inputs[sub.name], key) for sub, key in zip(pieces, keys)]
        self._install(split, subs, keys, compiled)
        if self.on_split is not None:
            self.on_split(split, subs, fakes)
        return self._saved(split, split_state, [(s.name, s.is_splitting_op) for s in subs], keys,
                           [_returns_bare_value(s.graph_module) for s in pieces])

    def _install(self, split, subs, keys, compiled):
        """The split module (split=None: the one whole-graph piece) with each piece's compiled
        callable, wrapped by wrap_piece, and each splitting op's eager call, wrapped by
        wrap_splitting; fills the stats of the trace."""
        self.stats.keys = list(keys)
        self.stats.pieces = len(keys)
        if split is None:
            self.stats.submodules = 1
            return self.wrap_piece(compiled[0], 0, keys[0]) if self.wrap_piece else compiled[0]
        self.split_module, self.submodules = split, subs
        self.stats.submodules = len(subs)
        self.stats.splitting_nodes = sum(s.is_splitting_op for s in subs)
        pieces = iter(zip(keys, compiled))
        i = 0
        for sub in subs:
            if sub.is_splitting_op:
                run = eager_call(sub.graph_module)
                split.__dict__[sub.name] = self.wrap_splitting(run) if self.wrap_splitting else run
                continue
            key, fn = next(pieces)
            # The split module's code calls self.<name>(...): an instance attribute shadows the
            # registered submodule without making the compiled callable an nn.Module.
            split.__dict__[sub.name] = self.wrap_piece(fn, i, key) if self.wrap_piece else fn
            i += 1
        return split

    def _saved(self, module, split_state, subs, keys, bare):
        """While saved_trace.trace traces (self.saving): the module as a serializable callable with
        what `rebuild` needs (the split module's pickle, the submodule order, each distinct piece's
        Inductor artifact and whether its graph returns one bare value); else the module itself."""
        if not self.saving:
            return module
        state = {"split": split_state, "subs": subs, "keys": keys,
                 "artifacts": {key: saved_trace.artifact_bytes(self.artifacts[key]) for key in dict.fromkeys(keys)},
                 "bare_output": dict(zip(keys, bare))}
        return saved_trace.serializable(module, state)

    def rebuild(self, state: dict):
        """The forward's module from a saved trace's state: the loaded pieces, wrapped as __call__
        wraps freshly compiled ones. Counts as no Dynamo trace and no Inductor compile; the
        artifacts' loading time counts as inductor_s."""
        self.stats.loaded_traces += 1
        t0 = time.perf_counter()
        loaded = {key: saved_trace.load_artifact(data, state["bare_output"][key])
                  for key, data in state["artifacts"].items()}
        self.stats.inductor_s += time.perf_counter() - t0
        self.artifacts.update(loaded)
        compiled = [loaded[key] for key in state["keys"]]
        if state["split"] is None:
            return self._install(None, [], state["keys"], compiled)
        split = pickle.loads(state["split"])
        subs = [Submodule(name, i, is_op, getattr(split, name)) for i, (name, is_op) in enumerate(state["subs"])]
        self.graph = None
        return self._install(split, subs, state["keys"], compiled)

    def dump_graph(self, directory) -> list[str]:
        """Write the traced graph, the split graph and every submodule's code; returns the paths.
        An earlier dump's files in the directory go first: a model with fewer layers, or a mode
        without a split, left the other run's pieces beside this one's, read as this model's."""
        os.makedirs(directory, exist_ok=True)
        for name in os.listdir(directory):
            if DUMP_FILE.fullmatch(name) and os.path.isfile(os.path.join(directory, name)):
                os.remove(os.path.join(directory, name))
        written = []

        def write(name, text):
            path = os.path.join(directory, name)
            with open(path, "w") as f:
                f.write(text)
            written.append(path)

        if self.graph is not None:
            write("traced_graph.py", self.graph.code)
        if self.split_module is not None:
            write("split_graph.py", self.split_module.code)
            keys = iter(self.stats.keys)
            for sub in self.submodules:
                kind = "splitting op" if sub.is_splitting_op else f"piece key {next(keys)[:16]}"
                code = getattr(sub.graph_module, "code", "(loaded from a saved trace: Inductor's code only)\n")
                write(f"{sub.index:03d}_{sub.name}.py", f"# {sub.name}: {kind}\n{code}")
        return written
