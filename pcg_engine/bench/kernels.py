"""`pcg bench kernels`: runs scripts/bench_kernels.py (kernel micro-benchmarks, kept with the scripts).

The script lives outside the package, so it is loaded from the repository's scripts/ directory by
path; its main() receives the arguments (or finds them in sys.argv if it takes none).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys

from pcg_engine.bench.common import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "bench_kernels.py"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not SCRIPT.exists():
        print(f"pcg bench kernels: {SCRIPT} is not there (it comes with the kernels work); nothing to run",
              file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("pcg_bench_kernels_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    entry = getattr(module, "main", None)
    if entry is None:
        print(f"pcg bench kernels: {SCRIPT} has no main()", file=sys.stderr)
        return 2
    params = inspect.signature(entry).parameters
    if "prog" in params:     # its usage line then names this command, not the script
        return entry(argv, prog="pcg bench kernels") or 0
    if params:
        return entry(argv) or 0
    saved = sys.argv
    sys.argv = [str(SCRIPT)] + argv
    try:
        return entry() or 0
    finally:
        sys.argv = saved
