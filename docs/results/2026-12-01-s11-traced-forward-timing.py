"""Session 11, CPU: host microseconds of one-token forwards through the compiled forward (tiny Qwen3,
piecewise, no graphs). Usage: [PCG_SAVED_TRACE=0] python this.py COMPILE_CACHE_DIR LABEL, run from
the repository root (imports the test helpers)."""
import sys, time, torch
sys.path.insert(0, "tests"); sys.path.insert(0, "tests/compile")
from pathlib import Path
from compile_helpers import make_runner, build_tiny
from pcg_engine.compile.setup import _dummy_forward
path = build_tiny(Path("/tmp/tinyck"), "tiny-qwen3")
r = make_runner(path, "piecewise", compile_cache_dir=sys.argv[1], max_capture_tokens=16)
f = r.forward_fn
for _ in range(20): _dummy_forward(r, f, 1)
t0 = time.perf_counter()
for _ in range(300): _dummy_forward(r, f, 1)
print(sys.argv[2], "loaded", f.saved_trace_loaded, "us/forward", round((time.perf_counter() - t0) / 300 * 1e6, 1))
