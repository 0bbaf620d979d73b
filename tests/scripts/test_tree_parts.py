"""scripts/gpu_session.sh's tree A/B parts (p1tree, ttfttree, p4tree) run a base tree by PYTHONPATH from this
repository's root. `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH, so the
base runs imported this tree's pcg_engine: sessions 14-16's tree A/Bs compared this tree with itself. The parts
now set PYTHONSAFEPATH=1 (Python >= 3.11), which leaves the working directory out."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imported_from(tmp_path, safe: bool) -> str:
    base = tmp_path / "base"
    (base / "pcg_engine").mkdir(parents=True, exist_ok=True)
    (base / "pcg_engine" / "__init__.py").write_text("")
    (base / "pcg_engine" / "where.py").write_text("import pcg_engine\nprint(pcg_engine.__file__)\n")
    env = {**os.environ, "PYTHONPATH": str(base)}
    env.pop("PYTHONSAFEPATH", None)
    if safe:
        env["PYTHONSAFEPATH"] = "1"
    # where.py exists only in the base tree: run it as the parts run the CLI, `python -m` from the root.
    # Without the switch, the root's pcg_engine package shadows the base's and the module is not found.
    out = subprocess.run([sys.executable, "-m", "pcg_engine.where"], cwd=ROOT, env=env, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else out.stderr


def test_python_m_from_the_root_takes_the_base_tree_only_with_safe_path(tmp_path):
    assert "No module named pcg_engine.where" in _imported_from(tmp_path, safe=False)
    assert _imported_from(tmp_path, safe=True) == str(tmp_path / "base" / "pcg_engine" / "__init__.py")


def test_every_tree_part_sets_safe_path():
    script = (ROOT / "scripts" / "gpu_session.sh").read_text()
    runs = re.findall(r"env [^\n]*PYTHONPATH=\$pp[^\n]*", script)
    assert len(runs) >= 3                      # p1tree, ttfttree, p4tree
    for line in runs:
        assert "PYTHONSAFEPATH=1" in line, line
