"""Cached direct launches (kernels/fast_launch.py, attention/launch_plan.py).

On the CPU no CompiledKernel can exist, so the logic is checked against a stand-in: a real
JITFunction whose `run` does what Triton 3.5-3.9's JITFunction.run does at its end (bind the
arguments, call `compiled.run(grid, stream, function, packed_metadata, None, None, None, *bound)`)
and a fake CompiledKernel that logs its launcher calls. A direct launch must hand the launcher
exactly what the JIT handed it (tensors as their addresses). The gpu tests compare the real thing
with the JIT path bit for bit (tests/kernels/test_fast_launch_gpu.py).
"""

import os

import torch

if not torch.cuda.is_available():  # before triton is imported (also done by tests/kernels/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from pcg_engine.attention import launch_plan, split_merge, triton_attention  # noqa: E402
from pcg_engine.kernels import fast_launch  # noqa: E402

STREAM = 0x5EED


class FakeCompiled:
    function = 0xF0
    packed_metadata = (4, 1, 0)

    def __init__(self):
        self.calls = []

    def run(self, *args):  # the launcher: grid, stream, function, packed, metadata, hooks, args
        self.calls.append(args)


def fake_kernel(fn, log: list) -> JITFunction:
    """A JITFunction of `fn` that runs nothing: its run logs and 'launches' as the real one does."""
    kernel = JITFunction(fn)
    compiled = FakeCompiled()
    names = kernel.signature.parameters

    def run(*args, grid, warmup, **kwargs):
        bound = kernel.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
        bound.apply_defaults()
        g = tuple(grid) + (1,) * (3 - len(grid))
        log.append(("jit", fn.__name__, kwargs))
        compiled.run(*g, STREAM, compiled.function, compiled.packed_metadata, None, None, None,
                     *bound.arguments.values())
        return compiled
    kernel.run = run  # __getitem__ looks `run` up on the instance
    kernel.compiled = compiled
    return kernel


def as_launched(call: tuple) -> tuple:
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in call)


@pytest.fixture
def fake(monkeypatch):
    """fast_launch on, as on a GPU: the current device 0, one stream, fresh caches, CPU tensors
    recorded as pointers (as CUDA tensors are). Returns the real argument recorder."""
    real_as_arg = fast_launch._as_arg
    monkeypatch.setattr(fast_launch, "_as_arg",
                        lambda v: v.data_ptr() if isinstance(v, torch.Tensor) else real_as_arg(v))
    monkeypatch.setattr(fast_launch, "ENABLED", True)
    monkeypatch.setattr(fast_launch, "current_device", lambda: 0)
    monkeypatch.setattr(fast_launch, "current_stream", lambda device=None: STREAM)
    monkeypatch.setattr(fast_launch, "_EXACT", fast_launch.LaunchCache(4))
    monkeypatch.setattr(launch_plan, "PLANS", fast_launch.LaunchCache(4))
    return real_as_arg


def test_off_under_the_interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert not fast_launch.ENABLED
    assert fast_launch._version("3.6.0") == (3, 6) and fast_launch._version("3.10.0+git1") == (3, 10)
    assert fast_launch._version("3.6.0") in fast_launch.VERIFIED
    assert fast_launch._version("4.0.0") not in fast_launch.VERIFIED


def test_interpreter_results_take_the_jit_path():
    """Under the interpreter unified_attention launches through the (interpreted) JIT, no plans."""
    if fast_launch.ENABLED:
        pytest.skip("fast launches are on: the gpu tests cover this process")
    before = launch_plan.PLANS.misses
    from test_triton_attention import CASES, check, make_batch, reference
    specs, pad, bs, Hq, Hk, D, dtype, splits = CASES["split_decode"]
    q, cache, meta = make_batch(specs, len(specs) + pad, bs, Hq, Hk, D, dtype)
    out = torch.full_like(q, float("nan"))
    triton_attention.unified_attention(q, cache, out, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                       meta.num_reqs, 1, D ** -0.5, num_splits=splits)
    check(out, reference(q, cache, meta, D ** -0.5), 1e-4)
    assert launch_plan.PLANS.misses == before and len(launch_plan.PLANS) == 0


def test_jit_only_follows_tritons_hook_chains(monkeypatch):
    from triton import knobs
    hook = lambda metadata: None  # noqa: E731
    assert not fast_launch.jit_only()
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert fast_launch.jit_only()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not fast_launch.jit_only()
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", hook)  # the older spelling: a plain callable
    assert fast_launch.jit_only()
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", None)
    assert not fast_launch.jit_only()


def test_jit_only_inside_off_in_its_own_thread_only():
    import threading
    inside, checked = threading.Event(), threading.Event()
    seen = []

    def other():
        inside.wait(30)
        seen.append(fast_launch.jit_only())
        checked.set()
    t = threading.Thread(target=other, daemon=True)
    t.start()
    with fast_launch.off():
        assert fast_launch.jit_only()
        with fast_launch.off():
            assert fast_launch.jit_only()
        assert fast_launch.jit_only()
        inside.set()
        assert checked.wait(30)
    t.join(30)
    assert seen == [False] and not fast_launch.jit_only()


def _scale_add(x_ptr, y_ptr, n, alpha, BLOCK: int = 64, FLAG: bool = False):
    pass  # never compiled: the fake kernel only binds its signature


def test_exact_key_hits_only_identical_calls(fake):
    log = []
    k = fake_kernel(_scale_add, log)
    x, y = torch.zeros(64), torch.zeros(64)

    def call(*args, grid=(4,), **kwargs):
        n = len(log)
        fast_launch.launch(k, grid, *args, **kwargs)
        return len(log) > n  # True: went through the JIT
    assert call(x, y, 64, 0.5, BLOCK=32)
    assert not call(x, y, 64, 0.5, BLOCK=32)
    # the direct launch passed what the JIT passed (defaults applied, constexprs included)
    jit, direct = k.compiled.calls[-2:]
    assert direct == as_launched(jit) and direct[-1] is False and direct[3] == STREAM
    for changed in [dict(args=(y, x, 64, 0.5)), dict(args=(x, y, 65, 0.5)), dict(args=(x, y, 64, 0.25)),
                    dict(args=(x, y, 64, 0.5), grid=(5,)), dict(args=(x, y, 64, 0.5), kwargs=dict(BLOCK=64)),
                    dict(args=(x, y, 64, 0.5), kwargs=dict(BLOCK=32, num_warps=8)),
                    dict(args=(x, y, True, 0.5)), dict(args=(x, y, 1, 0.5)), dict(args=(x, y, 1.0, 0.5)),
                    dict(args=(x, y, 64, -0.0)), dict(args=(x, y, 64, 0.0)),
                    dict(args=(x.view(torch.int32), y, 64, 0.5))]:
        kw = changed.get("kwargs", dict(BLOCK=32))
        assert call(*changed["args"], grid=changed.get("grid", (4,)), **kw), f"{changed} must miss"
    assert len(fast_launch._EXACT) == 4  # the LRU bound
    assert not call(x.view(torch.int32), y, 64, 0.5, BLOCK=32)  # the latest: still there
    assert call(x, y, 64, 0.5, BLOCK=32)  # the first: evicted


class CudaLauncher:
    """Triton 3.6's launcher object as its source has it (backends/nvidia/driver.py): __call__ puts
    its scratch buffers (allocated where their size is not 0) and its compile options in and calls
    the C function `launch`, here a logger."""

    def __init__(self, launch, scratch: int = 0):
        self.launch = launch
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        scratch = ("scratch", self.global_scratch_size) if self.global_scratch_size else None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    scratch, None, *args)


class CLaunch:
    """Stands in for the C function (not a Python function: 3.6's tensor-descriptor wrapper is one)."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


@pytest.mark.parametrize("raw", [True, False])
def test_record_calls_the_c_launch_as_the_launcher_would(fake, monkeypatch, raw):
    """With RAW (Triton 3.6), a record of a launcher without scratch or tensor-descriptor wrapper
    calls its C function with exactly what the launcher's __call__ would; otherwise the launcher.
    (On a Triton other than 3.6 the C function takes another layout: RAW alone changes nothing.)"""
    monkeypatch.setattr(fast_launch, "RAW", raw)
    monkeypatch.setattr(fast_launch, "_RAW_LAYOUT", True)
    log = []
    k = fake_kernel(_scale_add, log)
    x, y = torch.zeros(64), torch.zeros(64)
    fast_launch.launch(k, (4,), x, y, 64, 0.5, BLOCK=32)
    jit = k.compiled.calls[-1]
    c = CLaunch()
    via_launcher = CudaLauncher(c)
    via_launcher(*jit)
    want = as_launched(c.calls[-1])
    k.compiled.run = CudaLauncher(c)        # what the JIT's CompiledKernel holds on a 3.6 GPU
    rec = fast_launch.record(k, k.compiled, (4,), (x, y, 64, 0.5), dict(BLOCK=32), slots=1)
    assert rec is not None and (rec.launch is c) == raw and (rec.launch is rec.run) != raw
    rec(STREAM, (x.data_ptr(),))
    assert c.calls[-1] == want and len(c.calls) == 2
    assert rec.launch(*rec.args(STREAM, (x.data_ptr(),))) is None and c.calls[-1] == want
    # A launcher with scratch to allocate, or whose launch is a Python function, keeps its __call__
    # (which hands the C function its scratch buffer); so does any launcher on another Triton.
    profiling = CudaLauncher(c)
    profiling.profile_scratch_size = 64
    for launcher, layout in ((CudaLauncher(c, scratch=64), True), (CudaLauncher(lambda *a: c(*a)), True),
                             (profiling, True), (CudaLauncher(c), False)):
        monkeypatch.setattr(fast_launch, "_RAW_LAYOUT", layout)
        k.compiled.run = launcher
        rec = fast_launch.record(k, k.compiled, (4,), (x, y, 64, 0.5), dict(BLOCK=32))
        assert rec.launch is launcher
        rec(STREAM)
        scratch = ("scratch", 64) if launcher.global_scratch_size else None
        assert c.calls[-1] == want[:7] + (scratch,) + want[8:]


def test_not_recorded(fake, monkeypatch):
    log = []
    k = fake_kernel(_scale_add, log)
    x = torch.zeros(8)

    def twice(*args):
        for _ in range(2):
            fast_launch.launch(k, (1,), *args)
    twice(x, x, 8, (1, 2))               # a tuple argument
    monkeypatch.setattr(fast_launch, "jit_only", lambda: True)  # a profiler's launch hooks
    twice(x, x, 8, 1.0)
    monkeypatch.setattr(fast_launch, "jit_only", lambda: False)
    monkeypatch.setattr(fast_launch, "_as_arg", fake)  # the real one: a CPU tensor is no pointer
    twice(x, x, 8, 1.0)
    assert len(log) == 6 and len(fast_launch._EXACT) == 0
    k.pre_run_hooks.append(lambda *a, **kw: None)
    twice(x, x, 8, 1.0)
    assert len(log) == 8 and len(fast_launch._EXACT) == 0


def test_compile_only_turns_direct_launches_off_in_its_thread_only(fake):
    """While one engine's start-up runs its dry pass (precompile.compile_only) in one thread, an
    engine serving in another re-issues its recorded launches (ENABLED was turned off for all)."""
    import threading
    from pcg_engine.engine import precompile
    log = []
    k = fake_kernel(_scale_add, log)
    x, y = torch.zeros(64), torch.zeros(64)
    fast_launch.launch(k, (4,), x, y, 64, 0.5)                  # recorded
    inside, done, errors = threading.Event(), threading.Event(), []

    def starting():
        try:
            with precompile.compile_only():
                fast_launch.launch(k, (4,), x, y, 64, 0.5)      # the JIT (dry), not the record
                fast_launch.launch(k, (4,), x, y, 32, 0.5)      # the JIT, nothing recorded
                inside.set()
                done.wait(30)
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread
            errors.append(e)
            inside.set()
    t = threading.Thread(target=starting, daemon=True)
    t.start()
    try:
        assert inside.wait(30)
        assert fast_launch.ENABLED
        n = len(log)
        fast_launch.launch(k, (4,), x, y, 64, 0.5)              # this thread: the record
        assert len(log) == n
    finally:
        done.set()
        t.join(30)
    assert not errors and len(log) == 3 and len(fast_launch._EXACT) == 1


# ---- unified_attention's plans ------------------------------------------------------------------

@pytest.fixture
def fake_attention(fake, monkeypatch):
    log = []
    main = fake_kernel(triton_attention._unified_attention_kernel.fn, log)
    merge = fake_kernel(triton_attention._merge_splits_kernel.fn, log)
    merge.compiled.function = 0xF1
    monkeypatch.setattr(triton_attention, "_unified_attention_kernel", main)
    monkeypatch.setattr(triton_attention, "_merge_splits_kernel", merge)
    monkeypatch.setattr(split_merge, "_COUNTERS", {})
    return log, main.compiled, merge.compiled


def batch(R=3, T=5, Hq=4, Hk=2, D=32, bs=16, dtype=torch.bfloat16):
    q = torch.randn(T, Hq, D).to(dtype)
    out = torch.empty(T, Hq, D, dtype=dtype)
    cache = torch.randn(2, 9, bs, Hk, D).to(dtype)
    qsl = torch.arange(R + 1, dtype=torch.int32)
    lens = torch.full((R,), 40, dtype=torch.int32)
    table = torch.arange(R * 4, dtype=torch.int32).view(R, 4)
    return q, cache, out, qsl, lens, table


def attend(b, R=3, max_query_len=1, splits=1, tuning=None):
    q, cache, out, qsl, lens, table = b
    triton_attention.unified_attention(q, cache, out, qsl, lens, table, R, max_query_len, 0.125, splits,
                                       tuning=tuning)


def normalised(call: tuple, part_slots: tuple) -> tuple:
    """A launcher call with the fresh-per-call partial buffer's addresses named, not numbered
    (part_lse must start where the plan says, after part_out); tensors as their addresses."""
    args = list(as_launched(call))
    if part_slots:
        po, pl = (args[9 + i] for i in part_slots)
        args[9 + part_slots[0]], args[9 + part_slots[1]] = "part_out", ("part_out +", pl - po)
    return tuple(args)


@pytest.mark.parametrize("splits,tuning", [(1, None), (3, None), (3, triton_attention.DecodeTuning(fused_merge=True))],
                         ids=["unsplit", "merge_kernel", "fused_merge"])
def test_plan_launches_what_the_jit_launched(fake_attention, splits, tuning):
    log, main, merge = fake_attention
    b = batch()
    attend(b, splits=splits, tuning=tuning)
    with_merge = splits > 1 and tuning is None
    assert len(log) == 1 + with_merge and launch_plan.PLANS.misses == 1
    for _ in range(3):
        attend(b, splits=splits, tuning=tuning)
    assert len(log) == 1 + with_merge and launch_plan.PLANS.misses == 1  # then all direct
    assert len(main.calls) == 4 and len(merge.calls) == (4 if with_merge else 0)
    main_part, merge_part = ((6, 7), (0, 1)) if splits > 1 else ((), ())
    jit = normalised(main.calls[0], main_part)
    assert all(normalised(c, main_part) == jit for c in main.calls[1:])
    if splits > 1:
        assert jit[9 + 7] == ("part_out +", splits * 16 * 4 * 32 * 4)  # t_pad 16, Hq 4, D 32, fp32
    if with_merge:
        jit = normalised(merge.calls[0], merge_part)
        assert all(normalised(c, merge_part) == jit for c in merge.calls[1:])
        for m, c in zip(main.calls, merge.calls):  # the merge reads the partials its main call wrote
            assert as_launched(m)[9 + 6] == as_launched(c)[9]


def test_plan_keys(fake_attention):
    log, main, _ = fake_attention
    b = batch()
    attend(b)
    n = len(log)
    q2 = torch.randn(5, 4, 32).to(torch.bfloat16)  # another address, same layout: a hit
    attend((q2,) + b[1:])
    assert len(log) == n and main.calls[-1][9] == q2.data_ptr() and launch_plan.PLANS.misses == 1
    misses = 1
    for changed in [dict(R=2), dict(max_query_len=2), dict(splits=2),
                    dict(tuning=triton_attention.DecodeTuning(tile_n=32))]:
        attend(b, **changed)
        misses += 1
        assert launch_plan.PLANS.misses == misses and len(log) > n, f"{changed} must miss"
        n = len(log)
    for b2 in [batch(T=6), batch(dtype=torch.float16), batch(Hq=8), batch(D=64),
               (b[0].transpose(0, 1).contiguous().transpose(0, 1),) + b[1:]]:  # strides
        attend(b2)
        misses += 1
        assert launch_plan.PLANS.misses == misses
    assert len(launch_plan.PLANS) == 4  # the LRU bound


def test_misaligned_pointers_always_take_the_jit(fake_attention):
    log, _, _ = fake_attention
    q, cache, out, qsl, lens, table = batch(R=2)
    odd = torch.arange(4, dtype=torch.int32)[1:]  # 4 bytes past an aligned start
    for _ in range(3):
        attend((q, cache, out, odd, lens, table), R=2)
    assert len(log) == 3 and len(launch_plan.PLANS) == 0


def test_hooks_and_switch_take_the_jit(fake_attention, monkeypatch):
    log, _, _ = fake_attention
    b = batch()
    attend(b)
    with fast_launch.off():          # the dry pass (precompile.compile_only), in this thread
        attend(b)
    assert len(log) == 2 and len(launch_plan.PLANS) == 1
    monkeypatch.setattr(fast_launch, "jit_only", lambda: True)
    attend(b)
    assert len(log) == 3
    monkeypatch.setattr(fast_launch, "jit_only", lambda: False)
    monkeypatch.setattr(fast_launch, "ENABLED", False)
    attend(b)
    assert len(log) == 4


@pytest.mark.parametrize("splits,tuning", [(1, None), (3, None), (3, triton_attention.DecodeTuning(fused_merge=True))],
                         ids=["unsplit", "merge_kernel", "fused_merge"])
def test_plan_bound_to_layers_launches_what_each_layer_call_would(fake_attention, monkeypatch, splits, tuning):
    """AttentionPlan.for_layers (replay programs): layer i's bound (run, args) pairs hand the launcher
    what plan(layer i's addresses) does; the binding is served again for the same layers tuple,
    stream and addresses, made anew when the stream changes, and refused (None) under jit_only or
    for a misaligned address."""
    log, main, merge = fake_attention
    b = batch()
    q, cache, out, qsl, lens, table = b
    attend(b, splits=splits, tuning=tuning)
    plan = triton_attention.cached_plan(q, cache, out, qsl, lens, table, 3, 1, 0.125, splits, tuning)
    assert plan is not None
    with_merge = splits > 1 and tuning is None
    main_part, merge_part = ((6, 7), (0, 1)) if splits > 1 else ((), ())
    layer_tensors = [(torch.randn(5, 4, 32).to(torch.bfloat16), torch.randn(2, 9, 16, 2, 32).to(torch.bfloat16),
                      torch.empty(5, 4, 32, dtype=torch.bfloat16)) for _ in range(3)]
    layers = tuple(tuple(t.data_ptr() for t in layer) for layer in layer_tensors)
    metadata = (qsl.data_ptr(), lens.data_ptr(), table.data_ptr())

    # what the per-layer path launches for each layer
    main.calls.clear(), merge.calls.clear()
    for ptrs in layers:
        assert plan(*ptrs, *metadata)
    want_main = [normalised(c, main_part) for c in main.calls]
    want_merge = [normalised(c, merge_part) for c in merge.calls]

    bound = plan.for_layers(layers, *metadata)
    assert bound is not None and len(bound.calls) == 3
    assert [len(c) for c in bound.calls] == [1 + with_merge] * 3
    main.calls.clear(), merge.calls.clear()
    for calls in bound.calls:
        for run, args in calls:
            run(*args)
    assert [normalised(c, main_part) for c in main.calls] == want_main
    assert [normalised(c, merge_part) for c in merge.calls] == want_merge
    if with_merge:      # each merge reads the partials its main call wrote
        for m, c in zip(main.calls, merge.calls):
            assert as_launched(m)[9 + 6] == as_launched(c)[9]
    assert (bound.part is not None) == (splits > 1)

    bound.part = None                  # the program lets the step's partial buffer go
    # The next step passes its last binding: served again, unless the allocator handed the partial
    # buffer out at another address (the CPU's may; torch's CUDA allocator hands the same block
    # back), then bound anew. The plan keeps nothing: without `last`, a new binding.
    key = bound.key
    again = plan.for_layers(layers, *metadata, bound)
    assert (again is bound) == (again.key == key) and (again is bound or splits > 1)
    assert (again.part is not None) == (splits > 1)      # served or not, it holds this step's buffer
    if splits > 1:
        # A partial buffer at another address (the last one still held) is never served the old calls.
        held = again.part
        moved = plan.for_layers(layers, *metadata, again)
        assert moved is not again and moved.key[4] == moved.part.data_ptr() != held.data_ptr()
        assert all(args[9 + 6] == moved.part.data_ptr() for calls in moved.calls for _, args in calls[:1])
        del held
    bound = again
    for i in range(3):        # other metadata buffers: bound anew
        changed = list(metadata)
        changed[i] += 16
        assert plan.for_layers(layers, *changed, bound) is not bound
    assert plan.for_layers(layers, *metadata) is not bound
    assert plan.for_layers(tuple(list(layers)), *metadata, bound) is not bound   # other layers: bound anew
    monkeypatch.setattr(fast_launch, "current_stream", lambda device=None: STREAM + 1)
    rebound = plan.for_layers(layers, *metadata, bound)
    assert rebound is not bound and all(args[3] == STREAM + 1 for calls in rebound.calls for _, args in calls)
    monkeypatch.setattr(fast_launch, "jit_only", lambda: True)
    assert plan.for_layers(layers, *metadata, rebound) is None
    monkeypatch.setattr(fast_launch, "jit_only", lambda: False)
    odd = (layers[0][0] + 4,) + layers[0][1:]
    assert plan.for_layers((odd,) + layers[1:], *metadata) is None
    assert len(log) == 1 + with_merge          # the JIT launched only the first call
    # Plans are shared by the engines of a process (threads may step them side by side): another
    # program binding the same plan leaves this one's binding and partial buffer alone.
    first = plan.for_layers(layers, *metadata)
    second = plan.for_layers(tuple(list(layers)), *metadata)
    assert second is not first and (first.part is not None) == (splits > 1)
    # Another plan never serves this one's binding, even where every address in the key is the
    # same: two requests instead of three (another grid), same split count and buffers.
    attend(b, R=2, splits=splits, tuning=tuning)
    other = triton_attention.cached_plan(q, cache, out, qsl, lens, table, 2, 1, 0.125, splits, tuning)
    assert other is not None and other is not plan
    bound = plan.for_layers(layers, *metadata)
    assert other.for_layers(layers, *metadata, bound).plan is other


def test_launch_cache_get_survives_an_eviction_between_its_two_calls():
    """The caches are module-level, shared by engines stepped in other threads: another thread's
    put() can evict a key between get()'s lookup and its move_to_end (a KeyError before)."""
    from collections import OrderedDict

    class EvictedAfterLookup(OrderedDict):
        def get(self, key, default=None):
            value = super().get(key, default)
            self.pop(key, None)          # another thread's put() evicting it right then
            return value

    cache = fast_launch.LaunchCache(4)
    cache._entries = EvictedAfterLookup()
    cache.put("k", "launch")
    assert cache.get("k") == "launch" and "k" not in cache and cache.get("k") is None
