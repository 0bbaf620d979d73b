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
    args = parser.parse_args()
    rows = []
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
