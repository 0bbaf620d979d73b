"""Wall-clock split of a start's compile phase (Qwen3-0.6B piecewise on the CPU): Dynamo's trace,
the backend, and inside it split_graph / submodule_inputs / piece_key (names the backend module
imports, patched there). Usage: python this.py COMPILE_CACHE_DIR (run it three times: cold, warm)."""
import sys, time
t0 = time.perf_counter()
from pcg_engine.compile import backend as B
orig_call = B.PcgBackend.__call__
marks = {}
def timed_call(self, gm, ex):
    marks["backend_start"] = time.perf_counter()
    try:
        return orig_call(self, gm, ex)
    finally:
        marks["backend_end"] = time.perf_counter()
B.PcgBackend.__call__ = timed_call
for name in ("split_graph", "submodule_inputs", "piece_key"):
    f = getattr(B, name)
    def wrap(f=f, name=name):
        def g(*a, **k):
            s = time.perf_counter()
            try: return f(*a, **k)
            finally: marks[name] = marks.get(name, 0) + time.perf_counter() - s
        return g
    setattr(B, name, wrap())
from pcg_engine.compile import piecewise as P
orig_fc = P.CompiledForward.__call__
def fc(self, *a):
    if self.first_call_s is None:
        marks["first_call_start"] = time.perf_counter()
    return orig_fc(self, *a)
P.CompiledForward.__call__ = fc
from pcg_engine.llm import LLM
from pcg_engine.bench import common
path = common.resolve_model("qwen3-0.6b", 0)
llm = LLM(path, device="cpu", mode="piecewise", max_num_seqs=8, max_capture_tokens=16, max_num_batched_tokens=64,
          compile_cache_dir=sys.argv[1])
t = llm.engine.runner.timings
print("dynamo_s", round(t["dynamo_s"], 2), "inductor_s", round(t["inductor_s"], 2),
      "first call -> backend (Dynamo trace incl. import)", round(marks["backend_start"] - marks["first_call_start"], 2),
      "backend wall", round(marks["backend_end"] - marks["backend_start"], 2),
      {k: round(v, 3) for k, v in marks.items() if not k.endswith(("start", "end"))})
