"""Why a process's second engine decodes slower than its first (H200, Qwen3-8B batch 1, PDL on:
+0.07 to +0.14 ms a token; docs/PERF.md, session 19). Builds one engine per mode of --modes in
this process, one after another, and for each prints its batch-1 TPOT and what the previous
engines left behind after LLM.close(): engine objects still alive (any of them would keep its CUDA
graphs), reserved memory, threads.

    python scripts/second_engine_probe.py --model /tmp/models/qwen3-8b --modes full_decode,full_decode
    python scripts/second_engine_probe.py ... --keep-cache     # close() without torch.cuda.empty_cache()
    python scripts/second_engine_probe.py ... --clear-cublas   # drop torch's cuBLAS workspaces after a close

The engine objects are counted, not torch.cuda.CUDAGraph itself: a pybind object is not gc-tracked,
so gc never lists one (session 19's --reset-leaked, which reset the graphs gc listed, found none).
--keep-cache lets the next engine reuse the closed one's memory segments instead of the
driver mapping new ones; --clear-cublas drops the cuBLAS workspaces torch keeps per handle and
stream (the capture stream's among them), which outlive the engine.
"""

import argparse
import gc
import json
import os
import threading
import time

import torch

from pcg_engine.bench import common
from pcg_engine.llm import LLM


def live_holders() -> dict:
    """Engine objects still alive: any of them keeps its CUDA graphs (and their pool) alive."""
    from pcg_engine.compile.cuda_graph import GraphPool
    from pcg_engine.compile.full_graph import FullDecodeGraphs
    from pcg_engine.engine.llm_engine import LLMEngine
    from pcg_engine.engine.model_runner import ModelRunner
    kinds = (LLMEngine, ModelRunner, FullDecodeGraphs, GraphPool)
    return {k.__name__: sum(isinstance(o, k) for o in gc.get_objects()) for k in kinds}


def tpot_ms(llm, tokens: int) -> float:
    prompt = list(range(1000, 1128))
    params = dict(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params)   # warm
    times = []

    def on_output(out):
        times.append(time.perf_counter())

    llm.generate([list(range(2000, 2128))], params, on_output=on_output)
    return 1000 * (times[-1] - times[0]) / max(len(times) - 1, 1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--modes", default="full_decode,full_decode")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--keep-cache", action="store_true")
    p.add_argument("--clear-cublas", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    for i, mode in enumerate(m.strip() for m in args.modes.split(",")):
        llm = LLM(args.model, mode=mode)
        # (nothing is counted while the engine runs: it gc.freeze()s its objects, which hides them
        # from gc.get_objects(); close() unfreezes them)
        row = {"engine": i, "mode": mode, "tpot_ms": round(tpot_ms(llm, args.tokens), 4)}
        empty_cache = torch.cuda.empty_cache
        if args.keep_cache:
            torch.cuda.empty_cache = lambda: None
        try:
            llm.close()
        finally:
            torch.cuda.empty_cache = empty_cache
        del llm
        gc.collect()
        row.update(reserved_mib_after_close=torch.cuda.memory_reserved() >> 20,
                   threads_after_close=threading.active_count(), alive_after_close=live_holders())
        if args.clear_cublas:
            torch.cuda.synchronize()
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
            row["reserved_mib_after_clear_cublas"] = torch.cuda.memory_reserved() >> 20
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        common.write_json(args.json, {"rows": rows, "keep_cache": args.keep_cache,
                                    "clear_cublas": args.clear_cublas,
                                    "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), **common.env_record(args.model, "cuda")})


if __name__ == "__main__":
    main()
