"""Diagnostic (session 7 call 6): is piecewise slower after an eager engine in the same process?"""
import sys, time
import torch
from pcg_engine.bench import common

def run(mode, steps=120):
    llm = common.build_llm(sys.argv[1], mode=mode, max_num_seqs=1)
    eng = llm.engine
    eng.add_request(list(range(1000, 1128)), common.bench_params(steps + 40))
    for _ in range(20):
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter(); h0 = eng.stats.host_s
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - t0) / steps
    host = 1e3 * (eng.stats.host_s - h0) / steps
    r = eng.runner
    info = {}
    if hasattr(r.forward_fn, "stats"):
        pool = r.graph_pool
        info = dict(traces=r.forward_fn.stats.dynamo_traces, eager_calls=r.forward_fn.eager_calls,
                    programs={T: p.runs for T, p in pool.programs.items()},
                    attention={T: p.attention is not None for T, p in pool.programs.items()},
                    paths=r.last_path, buckets=r.token_buckets[:4])
    print(f"{mode}: {ms:.3f} ms/step, host {host:.3f}", info, flush=True)
    llm.close()

for mode in sys.argv[2].split(","):
    run(mode)
