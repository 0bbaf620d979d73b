"""Every Triton kernel of pcg_engine, compiled for sm_90 at the variants the engine launches.

Run by tests/kernels/test_compile_sm90.py, or by hand: `python tests/kernels/sm90_compile_cases.py`
prints one line per compiled variant (OK / FAIL, seconds, the case, the kernel's constexprs) and
the compiler's message for each failure (arguments: compile only the cases whose label or kernel
name contains one of them, e.g. `rope_decode`); exit status 0 when every variant compiles and the
self-test's bad kernel is refused, 1 otherwise, 77 when this Triton cannot compile for sm_90.

The cases call the engine's launchers (norm, activation, skinny GEMM, fused MoE, argmax, RoPE + KV
write, unified and fused-RoPE attention) on uninitialised CPU tensors at the shapes of the model
presets, so the constexprs come from the launchers' own config functions (launch_config,
skinny_gemm.TUNED, fused_moe.moe_config, the norm / activation launch configs) and the argument
types from what the launchers really pass. PDL is switched on and off around the launches the
way the CUDA graphs and eager steps have it. Launches that specialise identically compile once.
Chosen to cover each code path at bf16 and fp32 in about two minutes on two cores, not the product
of every option: add a case here when a launcher grows a new choice.
"""

import os
import sys

# Before triton is imported anywhere in this process (and inherited by the compile workers):
# compile, never interpret; fp fusion on, Triton 3.6's default on the GPU machine.
os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import multiprocessing  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402

import pcg_engine  # noqa: E402
import sm90_compile as sc  # noqa: E402
from pcg_engine.attention import launch_config as lc  # noqa: E402
from pcg_engine.kernels import fast_launch, pdl  # noqa: E402

SKIP_EXIT = 77
H200_SMS = 132   # launch_config's split counts read the SM count; the CPU device would give 4


def preset(name: str, dtype=None) -> SimpleNamespace:
    from pcg_engine.models.presets import PRESETS
    f = PRESETS[name].fields
    return SimpleNamespace(
        name=name, dtype=dtype or getattr(torch, f["torch_dtype"]), hidden=f["hidden_size"],
        hq=f["num_attention_heads"], hk=f["num_key_value_heads"], d=f["head_dim"], inter=f["intermediate_size"],
        vocab=f["vocab_size"], experts=f.get("num_experts"), top_k=f.get("num_experts_per_tok"),
        moe_inter=f.get("moe_intermediate_size"))


@contextmanager
def engine_env(pdl_on: bool):
    """PDL as inside a graph capture (True) or an eager step (False), and the H200's SM count.
    Cached launches (fast_launch) off: they ask the CUDA driver for the device, and make the same
    JIT launch the first time anyway."""
    real = pdl.enabled, lc._num_sms, fast_launch.ENABLED
    pdl.enabled = lambda device: pdl_on
    lc._num_sms = lambda device: H200_SMS
    fast_launch.ENABLED = False
    try:
        yield
    finally:
        pdl.enabled, lc._num_sms, fast_launch.ENABLED = real


def empty(*shape, dtype):
    return torch.empty(shape, dtype=dtype)


# ---- the kernels of pcg_engine/kernels ----------------------------------------------------------

def norm_cases(add):
    from pcg_engine.kernels.norm import add_rms_norm, rms_norm
    for m, rows, pdl_on in ((preset("qwen3-0.6b"), 1, True), (preset("qwen3-0.6b"), 512, False),
                            (preset("qwen3-8b"), 1, True), (preset("tiny-qwen3"), 5, False)):
        x = empty(rows, m.hidden, dtype=m.dtype)
        add(f"add_rms_norm {m.name} T={rows}", pdl_on, add_rms_norm, x, x.clone(), empty(m.hidden, dtype=m.dtype))
    from pcg_engine.kernels.norm import add_rms_norm_partials
    m = preset("qwen3-8b")   # kernels/split_k.py: o / down partials summed by the norm after them
    for rows in (1, 4):
        add(f"add_rms_norm_partials 8b T={rows} S=4", True, add_rms_norm_partials,
            empty(4, rows, m.hidden, dtype=torch.float32), empty(rows, m.hidden, dtype=m.dtype),
            empty(m.hidden, dtype=m.dtype))
    m = preset("qwen3-0.6b")
    add("rms_norm 0.6b T=1 (first layer)", True, rms_norm, empty(1, m.hidden, dtype=m.dtype),
        empty(m.hidden, dtype=m.dtype))
    add("rms_norm 0.6b per-head q T=1", True, rms_norm, empty(m.hq, m.d, dtype=m.dtype), empty(m.d, dtype=m.dtype))
    t = preset("tiny-qwen3")
    add("rms_norm tiny-qwen3 T=1", True, rms_norm, empty(1, t.hidden, dtype=t.dtype), empty(t.hidden, dtype=t.dtype))


def activation_cases(add):
    from pcg_engine.kernels.activation import silu_and_mul
    for m, rows, pdl_on in ((preset("qwen3-0.6b"), 8, True), (preset("qwen3-0.6b"), 700, False),
                            (preset("qwen3-8b"), 1, True), (preset("tiny-qwen3"), 3, False)):
        add(f"silu_and_mul {m.name} T={rows}", pdl_on, silu_and_mul, empty(rows, 2 * m.inter, dtype=m.dtype))


def skinny_cases(add):
    """Every TUNED entry with the prologue the model folds into that projection (qwen3.py: qkv
    plain in the first layer and NORM after, gate_up NORM, down GATED, o plain), PDL on (graphs)
    and, at one row, off (eager decode); plus fp32 and the tensor-core path the benchmark sweeps."""
    from pcg_engine.kernels import skinny_gemm as sg
    roles = {}
    for m in (preset("qwen3-0.6b"), preset("qwen3-8b"), preset("qwen3-30b-a3b")):
        roles[((m.hq + 2 * m.hk) * m.d, m.hidden)] = ("plain", "norm")
        roles[(2 * m.inter, m.hidden)] = ("norm",)
        roles[(m.hidden, m.hq * m.d)] = ("plain",)
        roles[(m.hidden, m.inter)] = ("gated",)
    for (rows, n, k), config in sorted(sg.TUNED.items()):
        for mode in roles.get((n, k), ("plain",)):
            w = empty(n, k, dtype=torch.bfloat16)
            x = empty(rows, 2 * k if mode == "gated" else k, dtype=torch.bfloat16)
            norm = (empty(rows, k, dtype=torch.bfloat16), empty(k, dtype=torch.bfloat16), 1e-6,
                    empty(rows, k, dtype=torch.bfloat16)) if mode == "norm" else None
            for pdl_on in (True, False) if rows == 1 else (True,):
                add(f"skinny_gemm {mode} M={rows} N={n} K={k}", pdl_on, sg.skinny_gemm, x, w, config,
                    gated=mode == "gated", norm=norm)
    add("skinny_gemm fp32 plain M=1 N=1024 K=2048", True, sg.skinny_gemm, empty(1, 2048, dtype=torch.float32),
        empty(1024, 2048, dtype=torch.float32), sg.TUNED[(1, 1024, 2048)])
    add("skinny_gemm plain M=1 N=4096 K=4096, four preloaded slices", True, sg.skinny_gemm,
        empty(1, 4096, dtype=torch.bfloat16), empty(4096, 4096, dtype=torch.bfloat16), sg.SkinnyConfig(2, 1024, False, 4, 3))
    add("skinny_gemm tensor-core M=8 (benchmark sweep)", True, sg.skinny_gemm, empty(8, 4096, dtype=torch.bfloat16),
        empty(4096, 4096, dtype=torch.bfloat16), sg.SkinnyConfig(64, 128, True, 4, 4))


def moe_cases(add):
    """fused_moe at token counts that reach each row of its tuning table, with the alignment's
    one-chunk, histogram and torch-fallback paths, and the few-token GEMV path (1 and 4 tokens of
    30B-A3B, 3 of the tiny MoE), bf16 (30B-A3B) and fp32 (the tiny MoE); the router's top-k + softmax
    beside each."""
    from pcg_engine.kernels.fused_moe import fused_moe
    from pcg_engine.kernels.moe_route import topk_softmax
    for m, tokens, pdl_on in ((preset("qwen3-30b-a3b"), 1, True), (preset("qwen3-30b-a3b"), 4, False),
                              (preset("qwen3-30b-a3b"), 64, True), (preset("qwen3-30b-a3b"), 1024, True),
                              (preset("qwen3-30b-a3b"), 4096, False), (preset("tiny-qwen3-moe"), 3, False),
                              (preset("tiny-qwen3-moe"), 2048, True)):
        w13 = empty(m.experts, 2 * m.moe_inter, m.hidden, dtype=m.dtype)   # never touched: lazy pages
        w2 = empty(m.experts, m.hidden, m.moe_inter, dtype=m.dtype)
        ids = torch.randint(0, m.experts, (tokens, m.top_k))               # torch.topk's int64
        add(f"fused_moe {m.name} T={tokens}", pdl_on, fused_moe, empty(tokens, m.hidden, dtype=m.dtype), w13, w2,
            torch.rand(tokens, m.top_k).to(m.dtype), ids)
        add(f"moe_topk_softmax {m.name} T={tokens}", pdl_on, topk_softmax, empty(tokens, m.experts, dtype=m.dtype),
            m.top_k)


def argmax_cases(add):
    from pcg_engine.kernels.argmax import argmax_rows
    for m, rows in ((preset("qwen3-0.6b"), 1), (preset("tiny-qwen3"), 4)):
        add(f"argmax_rows {m.name} R={rows}", False, argmax_rows, empty(rows, m.vocab, dtype=m.dtype))
        host = empty(rows, dtype=torch.int64)          # the read-back's pinned buffer (engine/readback.py)
        add(f"argmax_rows {m.name} R={rows} host", False, argmax_rows, empty(rows, m.vocab, dtype=m.dtype),
            host_out=host, host_address=host.data_ptr())


def scatter_cases(add):
    """The block-table appends' kernel; scatter_ takes index_copy_ for CPU tensors, so the case
    launches the kernel as scatter_ does on CUDA (int32 table, k not specialised)."""
    from pcg_engine.kernels.scatter import BLOCK, _scatter_kernel
    for k in (1, 16):
        add(f"scatter k={k}", False, lambda k=k: _scatter_kernel[(1,)](
            empty(4 * BLOCK, dtype=torch.int32), empty(BLOCK, dtype=torch.int64), empty(BLOCK, dtype=torch.int32), k,
            BLOCK=BLOCK, num_warps=4))


def l2_prefetch_cases(add):
    """scripts/bench_l2_prefetch.py's requests, every mode; available() says no on the CPU, so it is
    told yes here (the kernel's inline PTX is what ptxas must take)."""
    from pcg_engine.kernels import l2_prefetch
    real = l2_prefetch.available
    l2_prefetch.available = lambda device: True
    try:
        for mode in l2_prefetch.MODES:
            for pdl_on in (True, False):
                add(f"l2_prefetch {mode}", pdl_on, l2_prefetch.prefetch, empty(4096, 4096, dtype=torch.bfloat16),
                    mode=mode)
    finally:
        l2_prefetch.available = real


# ---- attention ----------------------------------------------------------------------------------

def step(s, T, R, mql, seq, bs=16):
    """A step's tensors as the model and runner pass them: q, k, v views of one qkv output (raw,
    for the fused kernels), a contiguous rotated q, int64 positions and slots, int32 metadata."""
    qkv = empty(T, (s.hq + 2 * s.hk) * s.d, dtype=s.dtype)
    q, k, v = qkv.split([s.hq * s.d, s.hk * s.d, s.hk * s.d], dim=-1)
    width = -(-4096 // bs)   # block-table width for a 4096-token model length
    return SimpleNamespace(
        raw_q=q.view(T, s.hq, s.d), k=k.view(T, s.hk, s.d), v=v.view(T, s.hk, s.d),
        q=empty(T, s.hq, s.d, dtype=s.dtype), out=empty(T, s.hq, s.d, dtype=s.dtype),
        cache=empty(2, 64, bs, s.hk, s.d, dtype=s.dtype), positions=torch.zeros(T, dtype=torch.int64),
        slots=torch.zeros(T, dtype=torch.int64), cos_sin=empty(4096, s.d, dtype=torch.float32),
        qsl=torch.zeros(R + 1, dtype=torch.int32), seq_lens=torch.zeros(R, dtype=torch.int32),
        table=torch.zeros(R, width, dtype=torch.int32), T=T, R=R, mql=mql, seq=seq,
        norm=(empty(s.d, dtype=s.dtype), empty(s.d, dtype=s.dtype)))


def unified(s, t, graphed, tuning=None):
    from pcg_engine.attention.triton_attention import unified_attention
    dev = torch.device("cuda")   # read only by the patched SM count
    if graphed:
        splits = lc.graph_num_splits(t.R, s.hk, t.mql, dev)
        tuning = tuning or (lc.GRAPH_SPLIT_DECODE_TUNING if splits > 1 else None)
    else:
        splits = lc.choose_num_splits(t.T, t.R, s.hq, s.hk, s.d, t.mql, t.seq, dev)
    unified_attention(t.q, t.cache, t.out, t.qsl, t.seq_lens, t.table, t.R, t.mql, 0.1, splits, tuning=tuning)


def rope_decode(s, t):
    from pcg_engine.attention.rope_decode_attention import rope_decode_attention
    splits = lc.graph_num_splits(t.R, s.hk, 1, torch.device("cuda"))
    tuning = lc.GRAPH_SPLIT_DECODE_TUNING if splits > 1 else None
    rope_decode_attention(t.raw_q, t.k, t.v, t.positions, t.cos_sin, t.cache, t.slots, t.out, t.seq_lens, t.table,
                          t.R, 0.1, splits, *t.norm, tuning=tuning)


def rope_kv(s, t, norm=True):
    from pcg_engine.attention.rope_kv import rope_and_write_kv
    q_norm, k_norm = t.norm if norm else (None, None)
    rope_and_write_kv(t.raw_q, t.k, t.v, t.positions, t.cos_sin, t.cache, t.slots, q_norm=q_norm, k_norm=k_norm)


# name -> (PDL, what it launches): decode in the full graphs (split at batch 1, unsplit at batch 128),
# eager decode and prefill (split when the context is long), the fused merge (benchmark tuning).
ATTENTION_VARIANTS = {
    "decode graph split B1": (True, lambda s: unified(s, step(s, 1, 1, 1, 8192), True)),
    "decode graph unsplit B128": (True, lambda s: unified(s, step(s, 128, 128, 1, 8192), True)),
    "decode graph block_size 128": (True, lambda s: unified(s, step(s, 128, 128, 1, 8192, bs=128), True)),
    "decode eager split B1 8k": (False, lambda s: unified(s, step(s, 1, 1, 1, 8192), False)),
    "prefill 2 reqs q8": (False, lambda s: unified(s, step(s, 12, 2, 8, 100), False)),
    "prefill q512": (False, lambda s: unified(s, step(s, 512, 1, 512, 512), False)),
    "prefill split q4 8k": (False, lambda s: unified(s, step(s, 4, 1, 4, 8192), False)),
    "decode fused merge": (True, lambda s: unified(s, step(s, 1, 1, 1, 8192), True, lc.DecodeTuning(fused_merge=True))),
    "rope_decode split B1": (True, lambda s: rope_decode(s, step(s, 1, 1, 1, 8192))),
    "rope_decode unsplit B128": (True, lambda s: rope_decode(s, step(s, 128, 128, 1, 8192))),
    "rope_kv": (True, lambda s: rope_kv(s, step(s, 8, 8, 1, 100))),
    "rope_kv eager": (False, lambda s: rope_kv(s, step(s, 300, 2, 150, 150))),
    "rope_kv no norm": (False, lambda s: rope_kv(s, step(s, 3, 1, 3, 3), norm=False)),
}


def _shape(label, dtype, hq, hk, d):
    return SimpleNamespace(name=label, dtype=dtype, hq=hq, hk=hk, d=d)

def attention_cases(add):
    """Qwen3-0.6B (GQA 2) gets every variant; the other shapes (GQA 1/4/8, head_dim 64/32/16, fp16,
    fp32) the ones whose code they change, each attention compile costing 4-9 s."""
    q06, q8, moe = preset("qwen3-0.6b"), preset("qwen3-8b"), preset("qwen3-30b-a3b")
    tiny = preset("tiny-qwen3")
    every = [name for name in ATTENTION_VARIANTS if name != "rope_kv no norm"]
    shapes = [
        (_shape("qwen3-0.6b bf16 GQA2 d128", q06.dtype, q06.hq, q06.hk, q06.d), every),
        (_shape("qwen3-8b bf16 GQA4 d128", q8.dtype, q8.hq, q8.hk, q8.d),
         ["decode graph split B1", "prefill q512", "rope_decode split B1", "rope_kv"]),
        (_shape("qwen3-30b-a3b bf16 GQA8 d128", moe.dtype, moe.hq, moe.hk, moe.d),
         ["decode graph split B1", "prefill 2 reqs q8", "rope_decode unsplit B128", "rope_kv"]),
        (_shape("bf16 GQA1 d64", torch.bfloat16, 8, 8, 64),
         ["decode graph unsplit B128", "prefill 2 reqs q8", "rope_decode split B1", "rope_kv"]),
        (_shape("fp16 GQA2 d128", torch.float16, 16, 8, 128), ["rope_decode split B1"]),
        # fp32 (the tiny test models) takes the IEEE paths: fp32 tl.dot with input_precision="ieee"
        (_shape("tiny-qwen3 fp32 GQA2 d32", tiny.dtype, tiny.hq, tiny.hk, tiny.d),
         ["decode graph split B1", "prefill 2 reqs q8", "rope_decode split B1", "rope_kv", "rope_kv no norm"]),
        (_shape("fp32 GQA2 d16", torch.float32, 2, 1, 16),
         ["prefill split q4 8k", "rope_decode unsplit B128", "rope_kv"]),
    ]
    for s, names in shapes:
        for name in names:
            pdl_on, run = ATTENTION_VARIANTS[name]
            add(f"{name} {s.name}", pdl_on, run, s)


# ---- collect, compile, report -------------------------------------------------------------------

def collect() -> list[tuple[str, dict]]:
    """(case label, compile task) for every distinct variant, the self-test's first."""
    launches: list = []
    sc.self_test_launch(launches)

    def add(label, pdl_on, fn, *args, **kwargs):
        with engine_env(pdl_on), sc.capture(launches, f"{label} PDL={'on' if pdl_on else 'off'}"):
            fn(*args, **kwargs)

    # the slow compiles first, so the last ones to finish are short
    for cases in (attention_cases, moe_cases, skinny_cases, norm_cases, activation_cases, argmax_cases,
                  scatter_cases, l2_prefetch_cases):
        cases(add)
    tasks, seen = [], set()
    for label, kernel, args, kwargs in launches:
        task = sc.bind(kernel, args, kwargs)
        key = sc.task_key(task)
        if key not in seen:
            seen.add(key)
            tasks.append((label, task))
    return tasks


def main(only: list[str]) -> int:
    reason = sc.unavailable()
    if reason:
        print(f"SKIP: {reason}")
        return SKIP_EXIT
    start = time.perf_counter()
    tasks = collect()
    launched = {(task["module"], task["name"]) for _, task in tasks}
    uncovered = [] if only else sorted(sc.defined_kernels(pcg_engine) - launched)
    tasks = [(label, task) for label, task in tasks
             if not only or label == sc.SELF_TEST or any(w in f"{label} {task['name']}" for w in only)]
    jobs = int(os.environ.get("PCG_COMPILE_JOBS", "0")) or min(4, os.cpu_count() or 1)
    print(f"{len(tasks)} variants to compile for sm_90, {jobs} processes", flush=True)
    failures, cpu = len(uncovered), 0.0
    for module, name in uncovered:
        print(f"FAIL  no case launches {module}.{name}: add one to sm90_compile_cases.py", flush=True)
    # spawn: fresh workers that import triton with TRITON_INTERPRET=0 and no torch threads forked
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        results = pool.imap(sc.compile_task, [task for _, task in tasks])
        for (label, task), (error, seconds, task_cpu, async_copies) in zip(tasks, results):
            cpu += task_cpu
            expect_fail = label == sc.SELF_TEST   # the bad kernel: this check must refuse it
            ok = (error is not None) if expect_fail else error is None
            unpipelined = ok and not expect_fail and sc.must_pipeline(task) and async_copies == 0
            ok = ok and not unpipelined
            failures += not ok
            status = "OK  " if ok else "FAIL"
            print(f"{status} {seconds:5.1f}s  {label}: {sc.describe(task)}"
                  + (f" [{async_copies} async copies]" if sc.must_pipeline(task) else ""), flush=True)
            if unpipelined:
                print("    the decode loop's K/V loads are not multi-buffered (no async copy in the TTGIR)", flush=True)
            if error is not None:
                print("    " + error.strip().replace("\n", "\n    "), flush=True)
            elif expect_fail:
                print("    the self-test's kernel compiled: this check would not catch the bug it is for")
    print(f"{len(tasks) - failures}/{len(tasks)} as expected in {time.perf_counter() - start:.0f}s "
          f"({cpu:.0f}s of CPU in the compiles)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
