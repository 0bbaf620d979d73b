"""Registers and shared memory of the B1 x 8192 decode attention launch per decode tuning, on the CPU.

    python scripts/attention_resources.py

Compiles `_unified_attention_kernel` for sm_90 with the engine's own launch arguments (batch 1,
8192 keys, 64 splits, no PDL; tests/kernels/sm90_compile.py records the launch and compiles it as
the JIT would on the H200) and runs the bundled ptxas -v on the PTX. Registers and shared memory
decide how many programs an SM holds, and so whether the 512 programs of the launch run in one
wave. The installed triton decides the figures: the H200's triton 3.6 may allocate differently
(docs/PERF.md, session 17: 106 registers for the default where 3.9 takes 128).
"""

import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"    # before triton's first import: compile, do not interpret
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "kernels")]

import sm90_compile as sc  # noqa: E402
import sm90_compile_cases as cc  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pcg_engine.attention import launch_config as lc  # noqa: E402
from pcg_engine.attention.triton_attention import unified_attention  # noqa: E402

TUNINGS = [("64-key tiles, 4 warps, 2 stages (default)", lc.DecodeTuning()),
           ("64-key tiles, 1 stage", lc.DecodeTuning(num_stages=1)),
           ("128-key tiles, 4 warps, 2 stages", lc.DecodeTuning(tile_n=128)),
           ("128-key tiles, 4 warps, 1 stage", lc.DecodeTuning(tile_n=128, num_stages=1)),
           ("128-key tiles, 8 warps, 2 stages", lc.DecodeTuning(tile_n=128, num_warps=8)),
           ("128-key tiles, 8 warps, 1 stage", lc.DecodeTuning(tile_n=128, num_warps=8, num_stages=1)),
           ("256-key tiles, 8 warps, 2 stages", lc.DecodeTuning(tile_n=256, num_warps=8)),
           ("32-key tiles, 4 warps, 3 stages", lc.DecodeTuning(tile_n=32, num_stages=3))]


def ptxas_info(task: dict) -> tuple[str, int]:
    """(ptxas -v's register and spill lines, shared memory bytes) of a recorded launch."""
    kernel = getattr(importlib.import_module(task["module"]), task["name"])
    src = ASTSource(kernel, task["signature"], constexprs=task["constexprs"], attrs=task["attrs"])
    compiled = triton.compile(src, target=sc.TARGET, options=task["options"])
    ptxas = sc.ptxas_path()
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True)
    os.unlink(f.name)
    info = "; ".join(line.split(":", 1)[-1].strip() for line in out.stderr.splitlines()
                     if "registers" in line or "spill" in line)
    return info, compiled.metadata.shared


def main() -> int:
    reason = sc.unavailable()
    if reason:
        print(f"cannot compile for sm_90 here: {reason}")
        return 1
    for hq in (16, 32):
        shape = cc._shape(f"Hq{hq} Hk8 d128", torch.bfloat16, hq, 8, 128)
        for name, tuning in TUNINGS:
            launches = []
            with cc.engine_env(False), sc.capture(launches, name):
                t = cc.step(shape, 1, 1, 1, 8192)
                unified_attention(t.q, t.cache, t.out, t.qsl, t.seq_lens, t.table, 1, 1, 0.1, 64, tuning=tuning)
            for _, kernel, args, kwargs in launches:
                task = sc.bind(kernel, args, kwargs)
                if task["name"] == "_unified_attention_kernel":
                    info, shared = ptxas_info(task)
                    print(f"{shape.name}, {name}: {info}; shared memory {shared} B", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
