"""The package's sources as this process imported them, hashed (the compile cache's key: compile/cache.py).

Hashed when the package is imported (~4 ms for ~100 files), not when the first engine starts: the
code that runs is what was imported, and an edit made in between (a notebook's kernel kept alive,
a `git pull` under a running process) would otherwise key the old code's compiled forward under the
new sources' hash, where every later process running the new code would load it.
"""

import hashlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent     # the pcg_engine package


def digest(root: Path = ROOT) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        h.update(str(path.relative_to(root)).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


AT_IMPORT = digest()
