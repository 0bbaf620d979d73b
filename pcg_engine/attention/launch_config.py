"""Host-side launch choices of the Triton attention kernels (triton_attention.py): tiles, split-KV.

Everything here is plain Python over host values that are fixed for a bucket (shapes, T, num_reqs,
max_query_len) or, for the split count of an eager step, the step's max_seq_len; a launch that a
CUDA graph holds takes its split count from `graph_num_splits` (bucket values only). The kernels and
their launcher stay in triton_attention.py; `kernel_variant` is the single place that turns these
values into the tuple of choices that selects compiled binaries, so the launcher and the start-up
warm-up (engine/warmup.py) cannot disagree.
"""

import functools
from typing import NamedTuple

import torch

from pcg_engine import switches

MAX_SPLITS = 64


# Host arithmetic in plain Python: triton.cdiv / next_power_of_2 are constexpr functions that cost
# ~5 us a call, and this file's launch path ran about eight of them per layer per eager step.
def host_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def host_next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class DecodeTuning(NamedTuple):
    """Launch choices of a decode step (max_query_len <= 1), one set for steps without split-KV
    and one with it (module defaults below; unified_attention's `tuning` overrides them, which is
    how scripts/bench_kernels.py sweeps them). head_dim 256 halves tile_n (register budget)."""

    tile_n: int = 64          # keys per loop iteration (>= 16; paged blocks are gathered per token)
    num_warps: int = 4
    num_stages: int = 2       # software-pipeline depth of the K/V tile loads
    fused_merge: bool = False  # split-KV: the last program of each (q-block, kv head) merges
    merge_per_thread: int = 16  # fp32 partials a thread loads per step of that merge (see below)


DECODE_TUNING = DecodeTuning()
SPLIT_DECODE_TUNING = DecodeTuning()
SPLIT_PROGRAMS_PER_SM = 4  # choose_num_splits' target (B1 x 8192, Hk 8: 4 -> 64 splits, 2 -> 33)
# Split decode inside a CUDA graph: the merge as a second kernel. Fusing it into the main kernel
# saves that graph node, but its last-arriving program then merges every split alone, serially:
# on the H200, graph replays at batch 1 (`bench_kernels.py --only graph_split`, session 4 call 2),
# fused vs merge kernel, both kernels counted: GQA 2 (Qwen3-0.6B) 11.7 vs 9.6 us at 1,024 keys,
# 28.9 vs 28.2 at 8,192; GQA 4 (Qwen3-8B) 10.5 vs 8.1 at 384, 19.6 vs 9.7 at 1,024, 36.3 vs 26.6
# at 8,192.
GRAPH_SPLIT_DECODE_TUNING = DecodeTuning(fused_merge=False)
# The fused merge's tail grows with the split count (see graph_num_splits). PCG_GRAPH_SPLITS=1
# turns split-KV inside graphs off, another value moves the cap (an A/B switch for benchmarks,
# read at import).
MAX_GRAPH_SPLITS = max(1, min(int(switches.read("PCG_GRAPH_SPLITS", "16")), MAX_SPLITS))
# Waves of programs graph_num_splits aims at. One wave is enough for batch 1's short contexts; P2's
# tail phases (16-128 requests of 1-2k keys, 1.4-2x the KV-read floor) may want more programs to
# even out requests of unequal length: PCG_GRAPH_SPLIT_WAVES is the A/B switch (read at import).
GRAPH_SPLIT_WAVES = max(1, int(switches.read("PCG_GRAPH_SPLIT_WAVES", "1")))


def _tile_config(head_dim: int, group: int, max_query_len: int, tuning: DecodeTuning):
    """(BLOCK_M, BLOCK_Q, TILE_N, num_warps, num_stages) from host values fixed per bucket."""
    group_pad = host_next_pow2(group)
    if max_query_len <= 1:  # decode: the GQA group is the M dim, padded to tl.dot's minimum 16
        block_m = max(16, group_pad)
        tile_n = tuning.tile_n if head_dim <= 128 else max(16, tuning.tile_n // 2)
        return block_m, block_m // group_pad, tile_n, tuning.num_warps, tuning.num_stages
    cap = 128 if head_dim <= 64 else 64 if head_dim <= 128 else 32
    block_m = max(group_pad, min(cap, max(16, host_next_pow2(max_query_len) * group_pad)))
    tile_n = 64 if head_dim <= 128 else 32
    return block_m, block_m // group_pad, tile_n, 4, 2


@functools.lru_cache(maxsize=None)
def _num_sms(device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 4


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:   # asked per layer per eager step: a property lookup is µs
    return torch.cuda.get_device_properties(index).multi_processor_count


# Fewest key tiles (of 64) at which an eager decode step splits. 4 (256 keys) since session 7: P1
# Qwen3-0.6B piecewise (eager attention between the graphs) 1.218 / 1.220 ms a token with 8 against
# 1.179 / 1.172 with 4, alternated in one call on the H200; 8 dated from when the merge's second
# launch cost tens of µs of host a layer. PCG_EAGER_SPLIT_MIN_TILES moves it (A/B switch, read at import).
EAGER_SPLIT_MIN_TILES = max(2, int(switches.read("PCG_EAGER_SPLIT_MIN_TILES", "4")))


def choose_num_splits(num_tokens: int, num_reqs: int, num_heads: int, num_kv_heads: int,
                      head_dim: int, max_query_len: int, max_seq_len: int, device) -> int:
    """Splits so that small batches with long contexts still fill the GPU. Host values only;
    max_seq_len changes per step, so a graph-captured step must not use this (pass 1)."""
    block_m, block_q, _, _, _ = _tile_config(head_dim, num_heads // num_kv_heads, max_query_len,
                                             SPLIT_DECODE_TUNING)
    busy = min(num_reqs + num_tokens // block_q, num_tokens) * num_kv_heads  # programs with work
    sms = _num_sms(device)
    # in units of the default decode tile, whatever tile the tuning picks
    tiles = host_cdiv(max_seq_len, 64 if head_dim <= 128 else 32)
    # Split only when the GPU would be under-filled, and only with EAGER_SPLIT_MIN_TILES+ key
    # tiles: below, one program walking the few tiles beats the merge's second launch.
    if busy >= sms or tiles < EAGER_SPLIT_MIN_TILES:
        return 1
    # Then aim at SPLIT_PROGRAMS_PER_SM, >= 2 tiles a split, or 4 splits of 1-2 tiles for 4-8 tiles
    # (a min and a max of non-decreasing terms: the count never falls as max_seq_len grows, which
    # the warm-up's search relies on). Measured on the H200 at batch 1 x 8192 keys (Hq 16, Hk 8):
    # 8 / 16 / 32 / 64 splits ran 37.7 / 25.1 / 20.7 / 17.1 µs.
    splits = min(host_cdiv(SPLIT_PROGRAMS_PER_SM * sms, max(busy, 1)), max(tiles // 2, min(tiles, 4)), MAX_SPLITS)
    return max(1, splits)


def graph_num_splits(num_reqs: int, num_kv_heads: int, max_query_len: int, device) -> int:
    """Split count of a decode launch that a CUDA graph holds: one program per (request, kv head,
    split), about one wave on the GPU. A function of the bucket's host values (num_reqs, which the
    full decode graphs pad to the bucket, and max_query_len) and of the model and GPU only, never of
    the step's seq_lens, so a replay launches the captured grid whatever the contexts are; the
    kernel cuts each request's own tiles into these shares on the device (empty shares write
    nothing, seq_len 0 gives zeros). Batch 1 with 8 kv heads on 132 SMs: 16 splits, so a 384-token
    context runs as 6 one-tile programs a head instead of one program walking 6 tiles; batch 16: 1.
    Capped at MAX_GRAPH_SPLITS (16): contexts of a few hundred keys have fewer tiles than that
    anyway, and at 8,192 keys 16 splits already run 25-27 us in a graph replay (H200, session 4)."""
    if max_query_len > 1:  # prefill q-blocks fill the GPU by themselves
        return 1
    programs = GRAPH_SPLIT_WAVES * _num_sms(device)
    return max(1, min(programs // max(num_reqs * num_kv_heads, 1), MAX_GRAPH_SPLITS, MAX_SPLITS))


# Decode attention with PDL (the full decode graphs): key tiles of its share a program asks L2 for
# before it waits for the kernel before it (kernels/pdl.py). Predicted on the H200: one DRAM round
# trip (~1-2 us) off each layer's attention, batch-1 full_decode -30 to -50 us a step; measured
# (with the metadata reads before the wait, docs/PERF.md session 23): Qwen3-0.6B -29.5 us, 8B -26 us.
# PCG_PDL_PREFETCH_TILES=0 turns it off (an A/B switch, read at import).
PDL_PREFETCH_TILES = max(0, int(switches.read("PCG_PDL_PREFETCH_TILES", "2")))


class KernelVariant(NamedTuple):
    """The host-side choices of one unified_attention call that select compiled binaries; with the
    model's shapes and dtype fixed, two calls with equal variants run the same binaries."""

    block_m: int
    block_q: int
    tile_n: int
    num_warps: int
    num_stages: int
    decode: bool       # max_query_len <= 1: the search-free grid
    split: bool        # num_splits > 1: partial results, merged by ...
    splits_pad: int    # ... the merge kernel's power-of-two pad of num_splits (else 0)
    fused_merge: bool  # ... the main kernel's last program of each (q-block, kv head), or a kernel
    merge_chunk: int   # splits a load of that fused merge (0 without it)
    # The full decode graphs' launch with the RoPE + KV write fused in (rope_decode_attention.py):
    # set by the Triton backend, never by kernel_variant below.
    rope_fused: bool = False


def kernel_variant(num_heads: int, num_kv_heads: int, head_dim: int, max_query_len: int,
                   num_splits: int, tuning: DecodeTuning | None = None) -> KernelVariant:
    """What unified_attention compiles for these host values (it launches from this very tuple,
    so the warm-up that enumerates it cannot drift from the kernel). `tuning` (decode launches,
    and fused_merge for every split launch) defaults to the module's DecodeTuning for the case."""
    splits = _clamp_splits(num_splits)
    if tuning is None:
        tuning = SPLIT_DECODE_TUNING if splits > 1 else DECODE_TUNING
    block_m, block_q, tile_n, num_warps, num_stages = _tile_config(head_dim, num_heads // num_kv_heads,
                                                                   max_query_len, tuning)
    fused = splits > 1 and tuning.fused_merge
    # Registers: ptxas sizes the whole kernel for its largest part, so a merge chunk larger than
    # ~16 floats a thread raises the main loop's count and lowers its occupancy (sm_90: 2048 at
    # 4 warps keeps 104 registers, 4096 gives 134, 8192 spills).
    per_load = host_next_pow2(tuning.merge_per_thread * 32 * num_warps)
    merge_chunk = max(1, per_load // (host_next_pow2(num_heads // num_kv_heads) * head_dim)) if fused else 0
    return KernelVariant(block_m, block_q, tile_n, num_warps, num_stages, max_query_len <= 1, splits > 1,
                         host_next_pow2(splits) if splits > 1 and not fused else 0, fused, merge_chunk)


def _clamp_splits(num_splits: int) -> int:
    return max(1, min(int(num_splits), MAX_SPLITS))
