"""Where batch-1 x 8192 decode attention's time goes (issue 4: 48% of the copy ceiling against 70%).

    python scripts/attention_b1_probe.py [--json PATH]

For Qwen3-0.6B's and 8B's heads (Hq 16 / 32, Hk 8, D 128) at one request of 8192 keys, with the
engine's split count, times the call as bench_kernels.py does (rotating input sets in one CUDA
graph) without PDL and inside pdl.scope(), the way the full decode graphs launch it; splits the
time into the main kernel and the merge with the profiler over the same graph's replays; and times
device-to-device copies that move the same bytes, one buffer pair per call, rotating like the
attention inputs: the nearest thing to this size's own ceiling. Also a read-only Triton kernel
decomposed like the attention (PROGRAMS programs, each summing its share of the same 33.5 MB), and
the attention at other split counts.

--diag (session 37): where the main kernel's ~3.8 µs over a plain read of its bytes goes. The
attention at 8192 keys with other decode tunings (no pipelining; 128-key tiles, up to one tile a
program: one K and one V load, no loop; a deeper pipeline), against `_paged_read_kernel`, which
reads the same K and V bytes in the attention's decomposition (one program a kv head and split,
TILE_N keys at a time) and only sums them: with the block ids read from the table (the
attention's dependent loads) or made up from the tile index (no table read), and with seq_len
read from memory or given. What separates the paged read from the plain read is the gather and
its dependent loads; what separates the attention from the paged read is its math, its partial
stores and the merge, and how its loads travel: compiled for sm_90, the attention's K/V loads are
asynchronous copies into shared memory (pipelined), the two reads' plain loads into registers.
"""

import argparse
import contextlib
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import COPY_GBPS, AttentionShape, median_replay_ms  # noqa: E402

from pcg_engine.bench.common import graph_of_calls  # noqa: E402

from pcg_engine.attention.triton_attention import choose_num_splits  # noqa: E402
from pcg_engine.kernels import pdl  # noqa: E402


def kernel_split(graph, calls):
    """Mean µs a call of each kernel name, from the profiler over 5 replays."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    total = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time
    return {name[:60]: round(us / (5 * calls), 2) for name, us in total.items()}


def attention(batch, ctx, hq, hk, use_pdl):
    shape = AttentionShape(batch, ctx, 1, hq, hk)
    splits = choose_num_splits(batch, batch, hq, hk, 128, 1, ctx, torch.device("cuda"))
    scope = pdl.scope() if use_pdl else contextlib.nullcontext()
    with scope:
        graph = graph_of_calls(lambda i: shape.call(i, splits), shape.calls)
    us = median_replay_ms(graph, 20) * 1e3 / shape.calls
    nbytes = shape.kv_bytes + 2 * batch * hq * 128 * 2
    parts = kernel_split(graph, shape.calls)
    err = shape.error(splits)
    return {"shape": f"B{batch} ctx{ctx} Hq{hq} Hk{hk}", "pdl": use_pdl, "splits": splits, "us": round(us, 2),
            "of_ceiling": round(nbytes / us / 1e3 / COPY_GBPS, 3), "kernels_us": parts, "rel_error": err}


def copies(nbytes):
    """A copy moving nbytes (reads nbytes / 2, writes nbytes / 2), on rotating buffer pairs."""
    n = nbytes // 4   # bf16 elements of each half
    sets = [(torch.empty(n, dtype=torch.bfloat16, device="cuda"), torch.empty(n, dtype=torch.bfloat16, device="cuda"))
            for _ in range(8)]
    graph = graph_of_calls(lambda i: sets[i % 8][1].copy_(sets[i % 8][0]), 64)
    us = median_replay_ms(graph, 20) * 1e3 / 64
    return {"bytes_moved": nbytes, "us": round(us, 2), "of_ceiling": round(nbytes / us / 1e3 / COPY_GBPS, 3)}


@triton.jit
def _read_kernel(x_ptr, out_ptr, PER_PROGRAM: tl.constexpr, TILE: tl.constexpr):
    """Sums PER_PROGRAM contiguous elements, TILE at a time: a stream with no dependent loads."""
    pid = tl.program_id(0)
    base = x_ptr + pid.to(tl.int64) * PER_PROGRAM
    acc = tl.zeros((TILE,), tl.float32)
    for i in range(0, PER_PROGRAM, TILE):
        acc += tl.load(base + i + tl.arange(0, TILE)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def reads(nbytes, programs, tile, warps):
    n = nbytes // 2
    sets = [torch.randn(n, dtype=torch.bfloat16, device="cuda") for _ in range(8)]
    out = torch.empty(programs, dtype=torch.float32, device="cuda")
    per = n // programs
    graph = graph_of_calls(lambda i: _read_kernel[(programs,)](sets[i % 8], out, PER_PROGRAM=per, TILE=tile,
                                                        num_warps=warps), 64)
    us = median_replay_ms(graph, 20) * 1e3 / 64
    return {"read_bytes": nbytes, "programs": programs, "tile": tile, "warps": warps, "us": round(us, 2),
            "of_ceiling": round(nbytes / us / 1e3 / COPY_GBPS, 3)}


def attention_splits(hq, splits):
    from pcg_engine.attention import launch_config
    launch_config.MAX_SPLITS = max(launch_config.MAX_SPLITS, splits)   # the engine caps at 64: a probe above it
    shape = AttentionShape(1, 8192, 1, hq, 8)
    graph = graph_of_calls(lambda i: shape.call(i, splits), shape.calls)
    us = median_replay_ms(graph, 20) * 1e3 / shape.calls
    nbytes = shape.kv_bytes + 2 * hq * 128 * 2
    return {"shape": f"B1 ctx8192 Hq{hq} Hk8", "splits": splits, "us": round(us, 2),
            "of_ceiling": round(nbytes / us / 1e3 / COPY_GBPS, 3), "rel_error": shape.error(splits)}


@triton.jit
def _paged_read_kernel(cache_ptr, seq_lens_ptr, bt_ptr, out_ptr, num_splits, ctx,
                       stride_kv, stride_blk, stride_tok, stride_h,
                       TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                       TABLE: tl.constexpr, SEQ_FROM_MEMORY: tl.constexpr):
    """The attention's K/V reads for one request (program = kv head, split), summed: no dot, no
    softmax, no partial stores. TABLE=False: block id = tile's own index + 1 (no table read)."""
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr) if SEQ_FROM_MEMORY else ctx
    num_tiles = tl.cdiv(seq_len, TILE_N)
    per = tl.cdiv(num_tiles, num_splits)
    lo = split * per
    hi = tl.minimum(lo + per, num_tiles)
    k_base = cache_ptr + kvh * stride_h
    v_base = k_base + stride_kv
    d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros((HEAD_DIM,), tl.float32)   # summed over the tile's keys: few registers at any TILE_N
    for tile in range(lo, hi):
        n = tile * TILE_N + tl.arange(0, TILE_N)
        if TABLE:
            blk = tl.load(bt_ptr + n // BLOCK_SIZE).to(tl.int64)
        else:
            blk = (n // BLOCK_SIZE + 1).to(tl.int64)
        off = blk * stride_blk + (n % BLOCK_SIZE).to(tl.int64) * stride_tok
        k = tl.load(k_base + off[:, None] + d[None, :])
        v = tl.load(v_base + off[:, None] + d[None, :])
        acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), 0)
    tl.store(out_ptr + kvh * num_splits + split, tl.sum(acc, 0))


def paged_reads(hk, splits, tile_n, warps, table, seq_from_memory):
    shape = AttentionShape(1, 8192, 1, 16, hk)
    out = torch.empty(hk * splits, dtype=torch.float32, device="cuda")

    def call(i):
        q, cache, qsl, lens, bt, _ = shape.sets[i % len(shape.sets)]
        _paged_read_kernel[(hk, splits)](cache, lens, bt, out, splits, 8192, cache.stride(0), cache.stride(1),
                                         cache.stride(2), cache.stride(3), TILE_N=tile_n, BLOCK_SIZE=cache.shape[2],
                                         HEAD_DIM=128, TABLE=table, SEQ_FROM_MEMORY=seq_from_memory, num_warps=warps)
    call(0)      # the sum of everything read = the sum of set 0's K and V in blocks 1.. (the table's set)
    want = shape.sets[0][1][:, 1:, :, :hk].float().sum()
    sum_err = float((out.sum() - want).abs() / want.abs().clamp_min(1.0))
    graph = graph_of_calls(call, shape.calls)
    us = median_replay_ms(graph, 20) * 1e3 / shape.calls
    return {"paged_read": f"B1 ctx8192 Hk{hk}", "splits": splits, "tile_n": tile_n, "warps": warps,
            "table": table, "seq_from_memory": seq_from_memory, "sum_err": sum_err, "us": round(us, 2),
            "of_ceiling": round(shape.kv_bytes / us / 1e3 / COPY_GBPS, 3)}


def attention_tuned(hq, splits, tuning):
    """The attention at 8192 keys with a given DecodeTuning (the main kernel and the merge apart)."""
    shape = AttentionShape(1, 8192, 1, hq, 8)
    graph = graph_of_calls(lambda i: shape.call(i, splits, tuning), shape.calls)
    us = median_replay_ms(graph, 20) * 1e3 / shape.calls
    nbytes = shape.kv_bytes + 2 * hq * 128 * 2
    return {"shape": f"B1 ctx8192 Hq{hq} Hk8", "splits": splits, "tuning": tuning._asdict(), "us": round(us, 2),
            "of_ceiling": round(nbytes / us / 1e3 / COPY_GBPS, 3), "kernels_us": kernel_split(graph, shape.calls),
            "rel_error": shape.error(splits, tuning)}


def diag():
    from pcg_engine.attention.launch_config import DecodeTuning
    rows = []
    for hq in (16, 32):
        # sm_90 resources (ptxas -v, triton 3.9, session 37): the default 128 registers and 39 KB of shared
        # memory, 4 programs an SM, one wave; 128-key tiles take 70-74 KB of shared memory (3 an SM, so
        # 64 splits run in two waves, 32 splits in one); 32-key tiles at 3 stages 72 registers, 22 KB.
        for splits, tuning in ((64, DecodeTuning()), (64, DecodeTuning(num_stages=1)),
                               (32, DecodeTuning(tile_n=128)), (64, DecodeTuning(tile_n=128, num_stages=1)),
                               (64, DecodeTuning(tile_n=32, num_stages=3))):
            rows.append(attention_tuned(hq, splits, tuning))
            print(json.dumps(rows[-1]))
    for tile_n, warps in ((64, 4), (128, 4), (128, 8)):
        for table, seq in ((True, True), (False, True), (False, False)):
            rows.append(paged_reads(8, 64, tile_n, warps, table, seq))
            print(json.dumps(rows[-1]))
    kv = 2 * 8192 * 8 * 128 * 2
    rows.append(reads(kv, 512, 4096, 4))
    print(json.dumps(rows[-1]))
    rows.append(copies(kv))
    print(json.dumps(rows[-1]))
    return rows


def _layout_inputs(ctx, hq, hk, bs, head_major):
    """One rotating input set of a B1 decode: the cache as [2, NB, BS, Hk, D] either stored so
    (token-major: a head's key rows are 256 B pieces Hk x 256 B apart) or stored [2, NB, Hk, BS, D]
    and viewed permuted (head-major: a head's BS rows of a block are one contiguous run)."""
    nblk = -(-ctx // bs)
    if head_major:
        cache = torch.randn(2, nblk + 1, hk, bs, 128, device="cuda", dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
    else:
        cache = torch.randn(2, nblk + 1, bs, hk, 128, device="cuda", dtype=torch.bfloat16)
    table = (torch.randperm(nblk, device="cuda") + 1).view(1, -1).to(torch.int32)
    qsl = torch.tensor([0, 1], device="cuda", dtype=torch.int32)
    lens = torch.full((1,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(1, hq, 128, device="cuda", dtype=torch.bfloat16)
    return q, cache, qsl, lens, table, torch.empty_like(q)


def layouts(ctx, hq, hk, bs, head_major):
    """Issue 4's B1 decode with the KV cache token-major (the engine's) or head-major, at block size bs."""
    from pcg_engine.attention.torch_backend import paged_attention_reference
    from pcg_engine.attention.triton_attention import unified_attention
    splits = choose_num_splits(1, 1, hq, hk, 128, 1, ctx, torch.device("cuda"))
    sets = [_layout_inputs(ctx, hq, hk, bs, head_major) for _ in range(8)]

    def call(i):
        q, cache, qsl, lens, table, out = sets[i % 8]
        unified_attention(q, cache, out, qsl, lens, table, 1, 1, 128 ** -0.5, splits)
    graph = graph_of_calls(call, 64)
    us = median_replay_ms(graph, 20) * 1e3 / 64
    parts = kernel_split(graph, 64)
    q, cache, qsl, lens, table, out = sets[0]
    ref = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    paged_attention_reference(q, cache, qsl.cpu(), lens.cpu(), table, 128 ** -0.5, ref)
    out.fill_(float("nan"))
    call(0)
    err = float((out.float() - ref).norm() / ref.norm()) if torch.isfinite(out).all() else float("inf")
    nbytes = 2 * ctx * hk * 128 * 2 + 2 * hq * 128 * 2
    return {"shape": f"B1 ctx{ctx} Hq{hq} Hk{hk}", "block_size": bs, "layout": "head" if head_major else "token",
            "splits": splits, "us": round(us, 2), "of_ceiling": round(nbytes / us / 1e3 / COPY_GBPS, 3),
            "kernels_us": parts, "rel_error": err}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--contexts", default="",
                        help="comma-separated key counts: only the attention (engine split count, no PDL) and a "
                             "copy of its bytes at each, Hq 16 / 32; e.g. 8192,16384,32768,65536 (is 70%% of the "
                             "ceiling bound by the launch at 8192 and reached at longer contexts?)")
    parser.add_argument("--layouts", action="store_true",
                        help="only the attention at 8192 keys, token-major against head-major KV cache, "
                             "block size 16 / 64 / 128, Hq 16 / 32")
    parser.add_argument("--diag", action="store_true",
                        help="only the decomposition of the main kernel's time: the attention at other decode "
                             "tunings against a paged read of the same bytes (see the module docstring)")
    args = parser.parse_args()
    rows = []
    if args.diag:
        rows = diag()
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "torch": torch.__version__,
                                                   "device": torch.cuda.get_device_name()}, indent=1))
        return
    if args.layouts:
        for bs in (16, 64, 128):
            for head_major in (False, True):
                for hq in (16, 32):
                    r = layouts(8192, hq, 8, bs, head_major)
                    rows.append(r)
                    print(json.dumps(r))
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "torch": torch.__version__,
                                                   "device": torch.cuda.get_device_name()}, indent=1))
        return
    if args.contexts:
        for ctx in (int(c) for c in args.contexts.split(",")):
            for hq in (16, 32):
                r = attention(1, ctx, hq, 8, False)
                rows.append(r)
                print(json.dumps(r))
            r = copies(2 * ctx * 8 * 128 * 2)
            rows.append({"copy_of_ctx": ctx, **r})
            print(json.dumps(rows[-1]))
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "torch": torch.__version__,
                                                   "device": torch.cuda.get_device_name()}, indent=1))
        return
    for hq in (16, 32):
        for use_pdl in (False, True):
            r = attention(1, 8192, hq, 8, use_pdl)
            rows.append(r)
            print(json.dumps(r))
    kv = 2 * 8192 * 8 * 128 * 2
    for nbytes in (kv, 4 * kv, 64 * kv):
        r = copies(nbytes)
        rows.append(r)
        print(json.dumps(r))
    for programs, tile, warps in ((512, 8192, 4), (512, 4096, 4), (1024, 4096, 4), (264, 8192, 8), (132, 8192, 8)):
        r = reads(kv, programs, tile, warps)
        rows.append(r)
        print(json.dumps(r))
    for splits in (48, 80, 96, 128):
        r = attention_splits(16, splits)
        rows.append(r)
        print(json.dumps(r))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "torch": torch.__version__,
                                               "device": torch.cuda.get_device_name()}, indent=1))


if __name__ == "__main__":
    main()
