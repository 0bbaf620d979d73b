"""Kernel warm-up: at start-up, compile every Triton kernel variant the engine's steps can select.

Triton compiles a kernel the first time it is launched with a new variant: new constexprs (tile
sizes picked from max_query_len, split-KV or not) or a new specialisation class of an integer
argument (equal to 1, divisible by 16, other). A compile takes 0.1-1 s, and without this the first
steps that meet a variant stall the whole batch: on an H200 the TTFT load test (8 concurrent
512-token prompts) had an ITL p99 of 765 ms from exactly that. Graph capture compiles only what
it runs (the pieces at each bucket, with the RoPE + KV write inside them, decode attention at the
decode buckets); prefill attention runs eagerly between the pieces and the steps above the largest
bucket run ungraphed, so their variants would be met while serving. (The RoPE + KV write kernel
has one variant per model: T sets only its grid.)

What runs: dummy steps through the runner's own path (`pick_padding`: full decode graph,
piecewise, compiled or eager) and the real attention backend, one step per new pair of
  * attention variant: `backend.kernel_variant(meta, graphed=...)`, the tuple the Triton backend
    launches from (launch_config.kernel_variant), so the enumeration cannot drift from it; a step
    on the full-graph path gets the graphs' split policy (the bucket's split count, fused merge);
  * token variant: `token_variant(sites, T)`, what the fused kernels of kernels/ choose from the
    row counts the model gives them (their own launch-config functions, plus Triton's class of
    each size argument).
The step shapes are walked over the engine's limits: every token count for the token variants
(cheap), and for attention, ladders of (T, num_reqs, max_query_len, max_seq_len) dense where the
choice functions change (every value up to 16, both sides of each power of two, each tile
class's first and last query length). tests/engine/test_warmup.py checks, with Triton's own
specialisation rules on the launches really made, that random legal steps meet nothing new.

Safety: a dummy step's tokens carry slot -1, which the KV write sends to the scratch block 0 that
the block manager never hands out; its block table is all zeros, so it reads block 0 only. No
block is allocated, no request or input-batch row exists, and the static buffers it fills are
rewritten by every real step.
"""

import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from pcg_engine.attention.context import ForwardContext, set_forward_context
from pcg_engine.attention.launch_config import host_cdiv
from pcg_engine.attention.metadata import AttentionMetadata
from pcg_engine.kernels import activation, argmax, fused_moe, moe_gemv, norm, scatter


@dataclass(frozen=True)
class WarmupStep:
    path: str            # what pick_padding chose: "full", "piecewise", "compiled" or "eager"
    num_tokens: int      # flat rows of the forward (padded)
    num_reqs: int        # requests attention sees (padded on the full-graph path)
    real_tokens: int
    real_reqs: int
    max_query_len: int
    max_seq_len: int


# ---- what a step compiles ----------------------------------------------------------------------

def int_class(x: int) -> str:
    """Triton's specialisation of an integer argument: 1 and multiples of 16 get variants of their own."""
    return "1" if x == 1 else "16" if x % 16 == 0 else ""


def kernel_sites(model) -> tuple:
    """Where the model launches the fused kernels of kernels/, as (kind, row multiplier, sizes):
    the row count each launch sees is the step's token count times the multiplier."""
    from pcg_engine.models.layers import RMSNorm
    from pcg_engine.models.moe import SparseMoE
    from pcg_engine.models.qwen3 import MLP, Attention

    sites = set()
    per_head = set()
    for module in model.modules():
        if isinstance(module, Attention) and module.q_norm.use_kernels:
            # q/k norms run per head: [T * heads, head_dim] rows
            sites.add(("norm", module.num_heads, module.head_dim))
            sites.add(("norm", module.num_kv_heads, module.head_dim))
            per_head.update((id(module.q_norm), id(module.k_norm)))
        elif isinstance(module, RMSNorm) and module.use_kernels and id(module) not in per_head:
            sites.add(("norm", 1, module.weight.numel()))
        elif isinstance(module, MLP) and module.use_kernels:
            sites.add(("silu", 1, module.intermediate))
        elif isinstance(module, SparseMoE) and module.use_kernels:
            sites.add(("moe", 1, (module.top_k, module.num_experts, module.intermediate, module.w13.shape[2])))
    return tuple(sorted(sites, key=repr))


def _moe_variant(T: int, top_k: int, experts: int, inter: int, hidden: int) -> tuple:
    # Mirrors fused_moe.fused_moe / moe_align: the few-token GEMV path (its tiles come from the
    # shapes; T sets only its grids), else block configs from the token count, the alignment's
    # tiling (or its torch fallback) and the sizes passed to the kernels.
    if moe_gemv.takes_gemv(T, top_k):
        return ("gemv", *moe_gemv.gemv_configs(inter, hidden))
    up = fused_moe.moe_config(T, top_k, experts, inter, hidden, gated=True)
    down = fused_moe.moe_config(T, top_k, experts, hidden, inter, gated=False)
    total = T * top_k
    e_pad, chunk, c_pad = fused_moe._align_tiling(total, experts)
    if c_pad * e_pad > fused_moe._ALIGN_KERNEL_MAX_HIST:
        align = "torch"
    else:
        chunks = host_cdiv(total, chunk)
        align = (e_pad, chunk, c_pad, chunks == 1, int_class(chunks),
                 int_class(fused_moe._align_shapes(total, experts, up.block_m)))
    return up, down, int_class(total), align


def token_variant(sites: tuple, num_tokens: int) -> tuple:
    """What the fused kernels of one forward over num_tokens rows compile (the same for every T
    with the same tuple)."""
    key = []
    for kind, mult, sizes in sites:
        n = num_tokens * mult
        if kind == "norm":
            key.append((norm._launch_config(n, sizes), int_class(n)))
        elif kind == "silu":
            key.append((activation._launch_config(n, sizes), int_class(n)))
        else:
            key.append(_moe_variant(n, *sizes))
    return tuple(key)


# ---- which steps to run ------------------------------------------------------------------------

def ladder(lo: int, hi: int) -> list[int]:
    """lo..hi at the values where power-of-two choices and Triton's classes change: every value up
    to 16, then p - 1, p, p + 1 for each power of two p, and the ends."""
    values = set(range(lo, min(hi, 16) + 1)) | {lo, hi, max(lo, hi - 1)}
    p = 16
    while p <= 2 * hi:
        values.update(v for v in (p - 1, p, p + 1) if lo <= v <= hi)
        p *= 2
    return sorted(values)


def _scheduled(T: int, R: int) -> list:
    # pick_padding reads only the request count and the token counts
    return [(None, 1)] * (R - 1) + [(None, T - R + 1)]


def launch(runner, T: int, R: int, max_query_len: int, max_seq_len: int, padding=None) -> WarmupStep:
    """The step the runner would launch for R requests and T tokens (execute()'s padding)."""
    pad_t, pad_r, path = padding or runner.pick_padding(_scheduled(T, R))
    if path == "full":  # the graph's bucket metadata: one token a request, padding requests
        return WarmupStep(path, pad_t, pad_r, T, R, 1, max_seq_len)
    return WarmupStep(path, max(pad_t or T, T), max(pad_r or R, R), T, R, max_query_len, max_seq_len)


def _host_metadata(step: WarmupStep, tensors=None) -> AttentionMetadata:
    t = tensors or {}
    return AttentionMetadata(
        query_start_loc=t.get("query_start_loc"), seq_lens=t.get("seq_lens"), block_table=t.get("block_table"),
        slot_mapping=t.get("slot_mapping"), num_reqs=step.num_reqs, num_tokens=step.num_tokens,
        max_query_len=step.max_query_len, max_seq_len=step.max_seq_len,
        query_start_loc_cpu=t.get("query_start_loc_cpu"), seq_lens_cpu=t.get("seq_lens_cpu"))


def step_key(runner, sites: tuple, step: WarmupStep, cache: dict | None = None) -> tuple:
    """(attention variant, path, token variant) of a step: what it compiles."""
    cache = {} if cache is None else cache
    if step.path == "full":
        akey = ("full", step.num_reqs)
    else:
        akey = (step.path, step.num_tokens, step.num_reqs, step.max_query_len, step.max_seq_len)
    if akey not in cache:
        if step.path == "full":  # the bucket's metadata, and the graphs' split policy
            meta, graphed = runner.full_graphs.metadata(step.num_reqs), True
        else:
            meta, graphed = _host_metadata(step), False
        cache[akey] = runner.backend.kernel_variant(meta, graphed=graphed)
    tkey = ("tokens", step.num_tokens)
    if tkey not in cache:
        cache[tkey] = token_variant(sites, step.num_tokens)
    return cache[akey], step.path, cache[tkey]


def _query_len_classes(runner, max_tokens: int) -> list[tuple[int, int]]:
    """[(first, last)] max_query_len of each run of equal attention variant (no split)."""
    classes, start, prev = [], 1, None
    for q in range(1, max_tokens + 1):
        meta = _host_metadata(WarmupStep("eager", max_tokens, 1, max_tokens, 1, q, q))
        key = runner.backend.kernel_variant(meta, split_kv=False)
        if prev is not None and key != prev:
            classes.append((start, q - 1))
            start = q
        prev = key
    classes.append((start, max_tokens))
    return classes


def candidate_steps(runner, sites: tuple, cache: dict | None = None):
    """Legal step shapes within the runner's limits, as the runner would launch them."""
    cache = {} if cache is None else cache
    max_tokens, max_reqs, max_len = runner.max_num_tokens, runner.config.max_num_seqs, runner.max_model_len
    # Token variants: every token count, in as few requests as max_model_len allows (and one
    # token a request: decode batches).
    for T in range(1, max_tokens + 1):
        R = host_cdiv(T, max_len)
        if R <= max_reqs:
            q = host_cdiv(T, R)
            yield launch(runner, T, R, q, q)
        if T <= max_reqs:
            yield launch(runner, T, T, 1, 1)
    # Attention variants: tile class from max_query_len, split count from (T, R, max_seq_len).
    classes = _query_len_classes(runner, max_tokens)
    lens = [2 ** k for k in range(max_len.bit_length()) if 2 ** k <= max_len] + [max_len]
    for T in ladder(1, max_tokens):
        for R in ladder(1, min(max_reqs, T)):
            padding = runner.pick_padding(_scheduled(T, R))
            lo, hi = host_cdiv(T, R), T - R + 1    # max_query_len of R requests holding T tokens
            for first, last in classes:
                for q in {max(first, lo), min(last, hi)}:
                    if not (lo <= q <= hi and first <= q <= last and q <= max_len):
                        continue
                    shortest, longest = launch(runner, T, R, q, q, padding), launch(runner, T, R, q, max_len, padding)
                    yield shortest
                    yield longest
                    # max_seq_len moves only the split count, and monotonically (a min with the
                    # tile count): equal ends, nothing in between to find.
                    if step_key(runner, sites, shortest, cache)[0] != step_key(runner, sites, longest, cache)[0]:
                        for s in lens:
                            if q < s < max_len:
                                yield launch(runner, T, R, q, s, padding)


def plan(runner, sites: tuple | None = None) -> list[WarmupStep]:
    """One step per new attention or token variant, in the order found."""
    sites = kernel_sites(runner.model) if sites is None else sites
    seen_attn, seen_tok, seen_steps, steps, cache = set(), set(), set(), [], {}
    for step in candidate_steps(runner, sites, cache):
        if step in seen_steps:
            continue
        seen_steps.add(step)
        attn, path, tok = step_key(runner, sites, step, cache)
        if attn not in seen_attn or (path, tok) not in seen_tok:
            seen_attn.add(attn)
            seen_tok.add((path, tok))
            steps.append(step)
    return steps


# ---- running them ------------------------------------------------------------------------------

def _query_lens(step: WarmupStep) -> list[int]:
    """Request 0 takes max_query_len tokens, the others share the rest (each 1..max_query_len)."""
    R, rest = step.real_reqs, step.real_tokens - step.max_query_len
    if R == 1:
        return [step.real_tokens]
    base, extra = divmod(rest, R - 1)
    return [step.max_query_len] + [base + (1 if i < extra else 0) for i in range(R - 1)]


def _fill(runner, step: WarmupStep) -> dict:
    """Write the dummy step into the static buffers; returns the metadata's tensors."""
    b = runner.batch
    T, R, Rp = step.num_tokens, step.real_reqs, step.num_reqs
    qlens = _query_lens(step)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    qsl += [min(step.real_tokens + i, T) for i in range(1, Rp - R + 1)]  # padding requests, as prepare() does
    # Request 0 attends to max_seq_len keys, the others to their own chunk; padding requests to none.
    seq_lens = [max(step.max_seq_len, qlens[0])] + qlens[1:] + [0] * (Rp - R)
    qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
    lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    b.input_ids[:T].zero_()
    b.positions[:T].zero_()
    b.slot_mapping[:T].fill_(-1)              # every KV write goes to the scratch block 0
    b.query_start_loc[:Rp + 1].copy_(qsl_cpu)
    b.seq_lens[:Rp].copy_(lens_cpu)
    b.step_block_table[:Rp].zero_()           # every KV read comes from the scratch block 0
    return {"query_start_loc": b.query_start_loc[:Rp + 1], "seq_lens": b.seq_lens[:Rp],
            "block_table": b.step_block_table[:Rp], "slot_mapping": b.slot_mapping[:T],
            "query_start_loc_cpu": qsl_cpu, "seq_lens_cpu": lens_cpu}


@torch.inference_mode()
def run_step(runner, step: WarmupStep, forward=None) -> None:
    """One dummy step on the runner's path (forward: another forward for the non-full paths, as the
    pre-compile's dry pass runs the eager model)."""
    tensors = _fill(runner, step)
    b = runner.batch
    if step.path == "full":
        runner.full_graphs.run(SimpleNamespace(input_ids=b.input_ids[:step.num_tokens],
                                               metadata=SimpleNamespace(num_reqs=step.num_reqs)))
        return
    context = ForwardContext(_host_metadata(step, tensors), runner.kv_caches, runner.backend)
    with set_forward_context(context):
        (forward or runner.forward_fn)(b.input_ids[:step.num_tokens], b.positions[:step.num_tokens])


def has_jit_kernels(runner) -> bool:
    """Whether any step compiles something: a Triton attention backend or fused kernels."""
    return getattr(runner.backend, "jit_compiled", False) or bool(kernel_sites(runner.model))


def warm_up(runner, progress=None) -> list[WarmupStep]:
    """Run the planned steps; records warmup_s (planning included), warmup_plan_s, warmup_steps."""
    t0 = time.perf_counter()
    steps = getattr(runner, "warmup_plan", None) or plan(runner)   # precompile.py's, where it ran
    runner.timings["warmup_plan_s"] = time.perf_counter() - t0
    task = progress.add_task("kernel warm-up", total=len(steps)) if progress is not None else None
    for step in steps:
        run_step(runner, step)
        if task is not None:
            progress.advance(task)
    lm_head = runner.model.lm_head_weight
    argmax.warm_up(lm_head.shape[0], lm_head.dtype, runner.device)   # greedy sampling's kernel
    scatter.warm_up(runner.device)      # the block-table appends' kernel
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    runner.timings["warmup_s"] = time.perf_counter() - t0
    runner.timings["warmup_steps"] = float(len(steps))
    return steps


__all__ = ["WarmupStep", "warm_up", "plan", "run_step", "candidate_steps", "launch", "step_key",
           "token_variant", "kernel_sites", "int_class", "ladder", "has_jit_kernels"]
