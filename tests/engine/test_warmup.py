"""The start-up kernel warm-up (engine/warmup.py).

Three claims, each checked on the CPU:
  * the plan covers every variant a legal step can select: random steps within the engine's limits
    (at Qwen3-0.6B / 30B-A3B shapes, H200's 132 SMs, every mode's padding) meet no attention or
    token variant the plan lacks;
  * the variants are what Triton compiles: with Triton's own specialisation rules applied to the
    launches the tiny models really make (recorded, not run), serving random requests after the
    warm-up launches nothing the warm-up did not;
  * the dummy steps are harmless: run for real (Triton's interpreter), they change no KV block but
    the scratch block 0, and greedy output is the same as without them.
The gpu-marked test counts Triton compiles while serving after a real start-up: there must be none.
"""

import inspect
import random
import types
from types import SimpleNamespace

import pytest
import torch

from engine_helpers import make_llm, random_prompts
from pcg_engine.attention import launch_config, triton_attention
from pcg_engine.attention.triton_backend import TritonAttentionBackend
from pcg_engine.compile.full_graph import FullDecodeGraphs, default_decode_buckets
from pcg_engine.compile.setup import token_buckets_for
from pcg_engine.config import EngineConfig
from pcg_engine.engine import warmup
from pcg_engine.engine.model_runner import ModelRunner
from pcg_engine.sampling_params import SamplingParams

H200_SMS = 132


# ---- the plan covers random legal steps (pure: no model, no kernel) ------------------------------

def fake_runner(mode, Hq, Hk, D, max_tokens=2048, max_seqs=256, max_len=4096):
    """What plan() reads of a runner, with the real padding logic of each mode."""
    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens, max_model_len=max_len,
                          mode=mode)
    model = SimpleNamespace(forward=object())
    r = SimpleNamespace(config=config, mode=mode, max_num_tokens=max(max_tokens, max_seqs), max_model_len=max_len,
                        model=model, forward_fn=model.forward, token_buckets=[], full_graphs=None,
                        backend=TritonAttentionBackend(num_heads=Hq, num_kv_heads=Hk, head_dim=D, block_size=16,
                                                       cos_sin=torch.zeros(1, D)))
    r.pick_padding = types.MethodType(ModelRunner.pick_padding, r)
    if mode != "eager" and mode != "full_decode":
        r.forward_fn = object()  # compiled
        r.token_buckets = token_buckets_for(r) if mode != "compile" else []
    if mode in ("full_decode", "full_and_piecewise"):
        g = SimpleNamespace(runner=r, buckets=default_decode_buckets(min(max_seqs, max_tokens)))
        g.bucket_for = types.MethodType(FullDecodeGraphs.bucket_for, g)
        g.metadata = types.MethodType(FullDecodeGraphs.metadata, g)
        r.batch = SimpleNamespace(query_start_loc=torch.zeros(1), seq_lens=torch.zeros(1),
                                  step_block_table=torch.zeros(1, 1), slot_mapping=torch.zeros(1))
        r.full_graphs = g
    return r


def log_uniform(rng, lo, hi):
    """Mostly small values (where split-KV and the small tile classes live), some large."""
    if lo >= hi:
        return lo
    return min(hi, max(lo, int(round(lo * (hi / lo) ** rng.random()))))


def random_step(rng, runner):
    max_tokens, max_reqs, max_len = runner.max_num_tokens, runner.config.max_num_seqs, runner.max_model_len
    while True:
        R = log_uniform(rng, 1, min(max_reqs, max_tokens))
        T = log_uniform(rng, R, max_tokens)
        lo, hi = -(-T // R), min(T - R + 1, max_len)
        if lo > hi:
            continue
        q = rng.choice([lo, hi, rng.randint(lo, hi), log_uniform(rng, lo, hi)])
        s = rng.choice([q, max_len, rng.randint(q, max_len), log_uniform(rng, q, max_len)])
        return warmup.launch(runner, T, R, q, s)


DENSE_06B = (("norm", 1, 1024), ("norm", 8, 128), ("norm", 16, 128), ("silu", 1, 3072))
MOE_30B = (("norm", 1, 2048), ("norm", 4, 128), ("norm", 32, 128), ("moe", 1, (8, 128, 768, 2048)))


@pytest.mark.parametrize("mode", ["full_and_piecewise", "piecewise", "compile", "full_decode", "eager"])
@pytest.mark.parametrize("shapes", ["qwen3-0.6b", "qwen3-30b-a3b"])
def test_plan_covers_random_legal_steps(mode, shapes, monkeypatch):
    monkeypatch.setattr(launch_config, "_num_sms", lambda device: H200_SMS)
    Hq, Hk, sites = (16, 8, DENSE_06B) if shapes == "qwen3-0.6b" else (32, 4, MOE_30B)
    runner = fake_runner(mode, Hq, Hk, 128)
    steps = warmup.plan(runner, sites)
    cache = {}
    planned = [warmup.step_key(runner, sites, s, cache) for s in steps]
    attn = {a for a, _, _ in planned}
    tokens = {(p, t) for _, p, t in planned}
    assert len(steps) < 100, f"{len(steps)} warm-up steps"
    assert any(a.split for a in attn) and any(a.decode for a in attn)
    if runner.full_graphs is not None:   # small decode buckets split inside the graphs
        from pcg_engine.attention.launch_config import GRAPH_SPLIT_DECODE_TUNING
        full = {a for s, (a, _, _) in zip(steps, planned) if s.path == "full"}
        assert any(a.split and a.fused_merge == GRAPH_SPLIT_DECODE_TUNING.fused_merge for a in full)
        assert any(not a.split for a in full)
    rng = random.Random(0)
    for _ in range(3000):
        step = random_step(rng, runner)
        a, p, t = warmup.step_key(runner, sites, step, cache)
        assert a in attn, f"{step} selects attention variant {a}, which the warm-up does not run"
        assert (p, t) in tokens, f"{step} selects kernel variant {t} on the {p} path, which the warm-up does not run"
    for T in range(1, runner.max_num_tokens + 1):  # every token count, for the fused kernels
        step = warmup.launch(runner, T, 1, T, runner.max_model_len)
        assert warmup.step_key(runner, sites, step, cache)[1:] in tokens, f"{T} tokens"


def test_ladder_and_query_lens():
    assert warmup.ladder(1, 40) == list(range(1, 18)) + [31, 32, 33, 39, 40]
    assert warmup.ladder(3, 3) == [3]
    step = warmup.WarmupStep("eager", 16, 4, 14, 4, 5, 9)
    assert warmup._query_lens(step) == [5, 3, 3, 3]
    assert warmup.int_class(1) == "1" and warmup.int_class(32) == "16" and warmup.int_class(33) == ""


# ---- the variants are what Triton compiles (recorded launches, tiny models) ----------------------

def _interpreting() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(triton_attention._unified_attention_kernel, InterpretedFunction)


def launch_key(kernel, args, kwargs) -> tuple:
    """What Triton would look up its compiled binary by: constexpr values, the specialisation of
    every other argument (its own rule: dtype and 16-byte alignment of pointers, ints equal to 1 or
    divisible by 16, unless do_not_specialize), and the launch options."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    params = inspect.signature(kernel.fn).parameters
    bound = dict(zip(params, args))
    bound.update({k: v for k, v in kwargs.items() if k in params})
    no_spec = set(kernel.kwargs.get("do_not_specialize") or ())
    spec = []
    for name, p in params.items():
        value = bound[name] if name in bound else p.default     # a constexpr left at its default
        if "constexpr" in str(p.annotation):
            spec.append((name, "constexpr", value))
        else:
            spec.append((name,) + tuple(native_specialize_impl(BaseBackend, value, False, name not in no_spec, True)))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in params))
    return kernel.fn.__name__, tuple(spec), options


@pytest.fixture
def record_launches(monkeypatch):
    """Replace every Triton launch by a record of its key (nothing runs: outputs stay garbage)."""
    if not _interpreting():
        pytest.skip("records launches through Triton's CPU interpreter")
    from triton.runtime.interpreter import InterpretedFunction
    keys = set()

    def run(self, *args, grid, warmup, **kwargs):
        keys.add(launch_key(self, args, kwargs))
    monkeypatch.setattr(InterpretedFunction, "run", run)
    return keys


@pytest.mark.parametrize("mode", ["eager", "full_decode"])
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_serving_after_warmup_launches_nothing_new(preset, mode, tiny_paths, record_launches, monkeypatch):
    # H200's SM count makes small steps split the KV (the CPU default, 4, hardly ever does).
    monkeypatch.setattr(launch_config, "_num_sms", lambda device: H200_SMS)
    llm = make_llm(tiny_paths[preset], mode=mode, attention_backend="triton", kernels=True, kernel_warmup=False,
                   max_num_batched_tokens=64, max_num_seqs=8, max_model_len=1024, enable_prefix_caching=False)
    steps = warmup.warm_up(llm.engine.runner)
    assert llm.engine.runner.timings["warmup_steps"] == len(steps) > 0
    warmed = set(record_launches)
    names = {k[0] for k in warmed}
    assert {"_rope_kv_kernel", "_unified_attention_kernel", "_merge_splits_kernel", "_rms_norm_kernel"} <= names
    # decode steps of the full graphs fuse the RoPE + KV write into attention only when switched on
    from pcg_engine.attention import triton_backend
    if mode == "full_decode" and triton_backend.FUSED_ROPE_ATTENTION:
        assert "_rope_decode_attention_kernel" in names
    record_launches.clear()
    rng = random.Random(1)
    lengths = [rng.choice([1, 2, 3, 7, 9, 16, 17, 33, 64, 65, 130, 300, 700]) for _ in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.choice([1, 2, 5, 40]), ignore_eos=True,
                             detokenize=False) for _ in lengths]
    llm.generate(random_prompts(lengths, seed=1), params)
    new = record_launches - warmed
    assert record_launches and not new, f"served steps launched {len(new)} variants the warm-up did not, " \
        f"e.g. {sorted(new, key=repr)[:2]}"
    # Every token count, as one prefill and as a decode batch: token_variant is faithful to the
    # fused kernels' launchers.
    runner = llm.engine.runner
    for T in range(1, runner.max_num_tokens + 1):
        warmup.run_step(runner, warmup.launch(runner, T, 1, T, T))
        if T <= runner.config.max_num_seqs:
            warmup.run_step(runner, warmup.launch(runner, T, T, 1, 100))
    new = record_launches - warmed
    assert not new, f"{len(new)} variants the warm-up did not launch, e.g. {sorted(new, key=repr)[:2]}"


# ---- the dummy steps are harmless (run for real, in Triton's interpreter) ------------------------

def test_warmup_touches_only_the_scratch_block(tiny_paths):
    if not _interpreting() and not torch.cuda.is_available():
        pytest.skip("needs Triton (interpreter or CUDA)")
    llm = make_llm(tiny_paths["tiny-qwen3"], mode="eager", attention_backend="triton", kernel_warmup=False,
                   max_num_batched_tokens=8, max_num_seqs=4, max_model_len=512, num_kv_blocks=24,
                   enable_prefix_caching=False)
    prompts = random_prompts([3, 10], seed=2)   # with 8 tokens a step: prefill, mixed, decode steps
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, detokenize=False)
    before = [o.token_ids for o in llm.generate(prompts, greedy)]
    runner = llm.engine.runner
    kv = [c.clone() for c in runner.kv_caches]
    assert any(c[:, 1:].abs().sum() > 0 for c in kv), "the first run should have written KV blocks"
    steps = warmup.warm_up(runner)
    assert any(runner.backend.kernel_variant(warmup._host_metadata(s)).split for s in steps)
    assert runner.timings["warmup_s"] > 0
    for layer, (old, new) in enumerate(zip(kv, runner.kv_caches)):
        assert torch.equal(old[:, 1:], new[:, 1:]), f"layer {layer}: the warm-up wrote outside the scratch block"
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == before


@pytest.mark.parametrize("setting, backend, runs", [
    (None, "triton", False),     # default: on CUDA only (this is the CPU)
    (True, "triton", True),
    (False, "triton", False),
    (True, "torch", False),      # nothing to compile: torch attention, no fused kernels
])
def test_when_the_warmup_runs(setting, backend, runs, tiny_paths, monkeypatch):
    calls = []
    monkeypatch.setattr(warmup, "warm_up", lambda runner, progress=None: calls.append(runner))
    config = EngineConfig(model=str(tiny_paths["tiny-qwen3"]), device="cpu", mode="eager", attention_backend=backend,
                          kernel_warmup=setting, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                          num_kv_blocks=8)
    ModelRunner(config, str(tiny_paths["tiny-qwen3"]), torch.device("cpu"))
    assert len(calls) == int(runs)


def test_kernel_warmup_asked_for_where_nothing_compiles_is_named(tiny_paths):
    """kernel_warmup=True on an engine with no Triton kernel (torch attention on the CPU) was skipped
    without a word; the default (None) says nothing."""
    import warnings
    def runner(setting):
        config = EngineConfig(model=str(tiny_paths["tiny-qwen3"]), device="cpu", mode="eager",
                              attention_backend="torch", kernel_warmup=setting, max_num_seqs=4,
                              max_num_batched_tokens=16, max_model_len=64, num_kv_blocks=8)
        ModelRunner(config, str(tiny_paths["tiny-qwen3"]), torch.device("cpu"))
    with pytest.warns(UserWarning, match="EngineConfig: kernel_warmup=True has no effect here: this engine "
                                         "compiles no kernels \\(attention backend 'torch', no fused Triton "
                                         "kernels on cpu\\)"):
        runner(True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="EngineConfig")
        runner(None)
        runner(False)


def test_kernel_warmup_is_validated():
    from pcg_engine.errors import ConfigError
    with pytest.raises(ConfigError, match="kernel_warmup"):
        EngineConfig(kernel_warmup="yes")


# ---- on a GPU: after start-up, serving compiles nothing ------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["full_and_piecewise", "eager"])
def test_no_triton_compile_while_serving_gpu(mode, tiny_paths):
    import triton

    llm = make_llm(tiny_paths["tiny-qwen3"], device="cuda", dtype="bfloat16", mode=mode,
                   max_num_batched_tokens=256, max_num_seqs=16, max_model_len=2048, max_capture_tokens=64,
                   compile_cache=False, enable_prefix_caching=False,
                   # A GPU-sized cache would make the per-step invariant check (engine_helpers) scan
                   # hundreds of thousands of blocks a step: the first GPU run timed out on it.
                   num_kv_blocks=2048)
    runner = llm.engine.runner
    assert runner.timings["warmup_steps"] > 0 and "warmup_failed" not in runner.timings
    compiled = []

    def hook(*args, **kwargs):
        compiled.append(kwargs.get("repr") or kwargs.get("key"))
        return None
    previous = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        rng = random.Random(3)
        lengths = [rng.choice([1, 3, 17, 100, 300, 700, 1500]) for _ in range(24)]
        params = [SamplingParams(temperature=0.0, max_tokens=rng.choice([1, 4, 64]), ignore_eos=True)
                  for _ in lengths]
        llm.generate(random_prompts(lengths, seed=3), params)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous
    assert not compiled, f"{len(compiled)} Triton compiles while serving, first: {compiled[:3]}"
