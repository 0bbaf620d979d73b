"""Every Triton kernel of pcg_engine compiles for the H200 (sm_90), checked on the CPU machine.

The other kernel tests run the kernels in Triton's interpreter, which does not type-check them as
the compiler does: a kernel once passed every CPU test and then failed to compile on the GPU (a
variable redefined with another shape inside a runtime `if`). sm90_compile_cases.py compiles each
variant the engine launches with Triton's NVIDIA backend and bundled ptxas, no GPU needed, and
first proves on a bad kernel that such an error is reported.

It runs as a subprocess: this directory's conftest makes every kernel an interpreted function in
the test process, and the compiles need TRITON_INTERPRET unset when triton is imported.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
SKIP_EXIT = 77   # sm90_compile_cases.py: this Triton cannot compile for sm_90


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="on a GPU the kernel tests compile every kernel for the real device")
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent.parent), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(HERE / "sm90_compile_cases.py")], cwd=HERE.parent.parent, env=env,
                          capture_output=True, text=True, timeout=1800)
    print(proc.stdout)   # every variant's line, shown with -s or -rP
    if proc.returncode == SKIP_EXIT:
        pytest.skip(proc.stdout.strip().removeprefix("SKIP: "))
    if proc.returncode != 0:
        # The FAIL lines and the compiler's messages under them; all of stdout when it died early.
        lines = proc.stdout.splitlines()
        report = [line for i, line in enumerate(lines)
                  if line.startswith("FAIL") or (line.startswith("    ") and _under_fail(lines, i))]
        pytest.fail("kernels that do not compile for sm_90:\n" + "\n".join(report or lines[-50:])
                    + ("\n" + proc.stderr[-4000:] if not report else ""), pytrace=False)


def _under_fail(lines, i):
    """Whether indented line i belongs to a FAIL line (not to an OK one: the self-test's expected error)."""
    while i > 0 and lines[i].startswith("    "):
        i -= 1
    return lines[i].startswith("FAIL")
