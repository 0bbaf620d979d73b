"""Session 11, CPU: cProfile of CompiledForward._first_call (a warm start loads the saved trace) for
Qwen3-0.6B piecewise on the CPU. Usage: python this.py COMPILE_CACHE_DIR (twice: save, then load);
writes /tmp/load.prof."""
import sys, time, cProfile, pstats
from pcg_engine.llm import LLM
from pcg_engine.bench import common
from pcg_engine.compile import piecewise as P
prof = cProfile.Profile()
orig = P.CompiledForward._first_call
def fc(self, *a):
    t0 = time.perf_counter(); prof.enable()
    try: return orig(self, *a)
    finally:
        prof.disable(); print("first call s", time.perf_counter() - t0)
P.CompiledForward._first_call = fc
path = common.resolve_model("qwen3-0.6b", 0)
llm = LLM(path, device="cpu", mode="piecewise", max_num_seqs=8, max_capture_tokens=16, max_num_batched_tokens=64, compile_cache_dir=sys.argv[1])
t = llm.engine.runner.timings
print({k: round(t[k], 3) for k in ("dynamo_s", "inductor_s", "saved_trace_loaded")})
prof.dump_stats("/tmp/load.prof")
