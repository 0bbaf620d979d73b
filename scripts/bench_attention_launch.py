"""Host cost of the eager attention call that piecewise mode makes between graph pieces, with the
cached direct launches (kernels/fast_launch.py, attention/launch_plan.py) off and on.

    python scripts/bench_attention_launch.py [--calls 2000] [--json PATH] [--configs a,b]

Qwen3-0.6B's attention shapes (16 q heads, 8 kv heads, head_dim 128, block 16, bf16), 28 layers
with a KV cache each, as a decode step of a piecewise bucket calls them. Per config and switch:
`--calls` calls in a row cycling over the layers, then one torch.cuda.synchronize. `issue` is the
host time per call before the synchronize (what a host-bound step pays), `wall` includes the
drain (GPU time when the GPU is the slower side). Paths: `kernel` calls unified_attention,
`op` calls the attention op's Python kernel under a forward context (what compile/backend.py's
eager_call runs: context lookup, backend.forward, unified_attention), `bound` calls the plan bound
to all 28 layers as a replay program runs it (launch_plan.LayerCalls: each layer's launches with
every argument ready, nothing else). --raw-ab: the fast rows with fast_launch.RAW off and on (the
records call Triton's launcher object or its C function), alternated --rounds times in this process,
the plans recorded anew for each. One line per row; --json writes the rows with the environment.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # runs from a checkout

HQ, HK, D, BS, LAYERS = 16, 8, 128, 16, 28
CONFIGS = {  # name -> (requests, context per request, tokens of the bucket, query tokens per request)
    "decode_b1_ctx256": (1, 256, 2, 1),      # piecewise batch 1 runs the 2-token bucket
    "decode_b1_ctx2048": (1, 2048, 2, 1),    # long enough to split the KV: two launches a call
    "decode_b8_ctx512": (8, 512, 8, 1),
    "prefill_b1_512": (1, 512, 512, 512),
}


def make_step(requests: int, ctx: int, tokens: int, qlen: int, device):
    from pcg_engine.attention.metadata import AttentionMetadata
    width = -(-ctx // BS)
    blocks = 1 + requests * width
    caches = [torch.randn(2, blocks, BS, HK, D, device=device).to(torch.bfloat16) for _ in range(LAYERS)]
    table = (1 + torch.arange(requests * width, device=device, dtype=torch.int32)).view(requests, width)
    qsl = torch.arange(requests + 1, device=device, dtype=torch.int32) * qlen
    lens = torch.full((requests,), ctx, device=device, dtype=torch.int32)
    slots = torch.full((tokens,), -1, device=device, dtype=torch.int64)
    meta = AttentionMetadata(qsl, lens, table, slots, num_reqs=requests, num_tokens=tokens,
                             max_query_len=qlen, max_seq_len=ctx)
    q = torch.randn(tokens, HQ, D, device=device).to(torch.bfloat16)
    out = torch.empty_like(q)
    return q, out, caches, meta


def run_config(name: str, path: str, fast: bool, calls: int, device, raw: bool | None = None) -> dict:
    from pcg_engine.attention.context import ForwardContext, set_forward_context
    from pcg_engine.attention.op import attention
    from pcg_engine.attention.rope import rope_cache
    from pcg_engine.attention import triton_attention
    from pcg_engine.attention.triton_attention import unified_attention
    from pcg_engine.attention.triton_backend import TritonAttentionBackend
    from pcg_engine.custom_ops import python_kernel
    from pcg_engine.attention import launch_plan
    from pcg_engine.kernels import fast_launch

    fast_launch.ENABLED = fast
    if raw is not None:           # records made from here on take (or not) the C launch function
        fast_launch.RAW = raw
        launch_plan.PLANS = fast_launch.LaunchCache(512)
    q, out, caches, meta = make_step(*CONFIGS[name], device)
    backend = TritonAttentionBackend(num_heads=HQ, num_kv_heads=HK, head_dim=D, block_size=BS,
                                     cos_sin=rope_cache(D, 4096, 1e6, device=device))
    splits = backend.num_splits(meta)
    op_kernel = python_kernel(attention) if path == "op" else None
    bound = None

    def one(layer: int):
        if bound is not None:
            for fn, args in bound.calls[layer]:
                fn(*args)
            return
        if op_kernel is not None:
            op_kernel(q, caches[layer], out)
        else:
            unified_attention(q, caches[layer], out, meta.query_start_loc, meta.seq_lens, meta.block_table,
                              meta.num_reqs, meta.max_query_len, backend.scale, splits)

    with set_forward_context(ForwardContext(meta, caches, backend)), torch.inference_mode():
        for i in range(2 * LAYERS):   # compile, record a plan per layer
            one(i % LAYERS)
        if path == "bound":
            plan = triton_attention.cached_plan(q, caches[0], out, meta.query_start_loc, meta.seq_lens,
                                                meta.block_table, meta.num_reqs, meta.max_query_len, backend.scale,
                                                splits)
            layers = tuple((q.data_ptr(), c.data_ptr(), out.data_ptr()) for c in caches)
            bound = plan and plan.for_layers(layers, meta.query_start_loc.data_ptr(), meta.seq_lens.data_ptr(),
                                             meta.block_table.data_ptr())
            if bound is None:
                raise RuntimeError(f"{name}: no plan to bind (fast launches off?)")
        torch.cuda.synchronize()
        misses = launch_plan.PLANS.misses
        t0 = time.perf_counter()
        for i in range(calls):
            one(i % LAYERS)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    return {"config": name, "path": path, "fast_launch": fast, "raw": fast_launch.RAW, "calls": calls, "splits": splits,
            "issue_us": (t1 - t0) / calls * 1e6, "wall_us": (t2 - t0) / calls * 1e6,
            "new_plans": launch_plan.PLANS.misses - misses}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--paths", default="kernel,op")
    p.add_argument("--raw-ab", action="store_true", help="fast rows only, fast_launch.RAW off / on alternated")
    p.add_argument("--rounds", type=int, default=3, help="alternations of --raw-ab")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from pcg_engine.bench.common import env_record
    from pcg_engine.kernels import fast_launch
    available, raw0 = fast_launch.ENABLED, fast_launch.RAW
    if not available:
        print("fast launches unavailable here (PCG_FAST_LAUNCH=0, the interpreter, or an unverified "
              "Triton): only the JIT rows are measured", file=sys.stderr)
    device = torch.device("cuda")
    rows = []
    if args.raw_ab:
        if not (available and fast_launch._RAW_LAYOUT):
            print(f"--raw-ab needs fast launches on Triton 3.6 (here {triton.__version__}, fast launches "
                  f"{'on' if available else 'off'}): no other Triton's C launch function is called directly",
                  file=sys.stderr)
            return 2
        # off / on, then on / off: neither side always runs first
        runs = [(name, path, True, raw) for r in range(args.rounds) for name in args.configs.split(",")
                for path in args.paths.split(",") for raw in ((False, True) if r % 2 == 0 else (True, False))]
    else:
        # the bound path needs a recorded plan: fast launches only
        runs = [(name, path, fast, None) for name in args.configs.split(",") for path in args.paths.split(",")
                for fast in ((False, True) if available else (False,)) if fast or path != "bound"]
    for name, path, fast, raw in runs:
        row = run_config(name, path, fast, args.calls, device, raw)
        rows.append(row)
        print(f"{row['config']:20s} {row['path']:6s} fast_launch={'on ' if fast else 'off'} "
              f"{'' if raw is None else 'raw=' + ('on  ' if raw else 'off ')}"
              f"splits={row['splits']:<2d} issue {row['issue_us']:7.1f} us/call  "
              f"wall {row['wall_us']:7.1f} us/call  new plans {row['new_plans']}", flush=True)
    fast_launch.ENABLED, fast_launch.RAW = available, raw0
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env_record("synthetic qwen3-0.6b attention"),
                                               "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
