"""Where this user's caches live: $XDG_CACHE_HOME/pcg_engine, else ~/.cache/pcg_engine.

The XDG base-directory rules: XDG_CACHE_HOME counts only when it is an absolute path (a relative one
would move with the working directory, so it is ignored, as the spec says). Both caches of the
project (the default tiny checkpoint and the compile cache) live under this one root, so moving
XDG_CACHE_HOME (a container's volume, a shared home with little space) moves them together.
"""

import os
from pathlib import Path


def cache_home() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(xdg) if os.path.isabs(xdg) else Path(os.path.expanduser("~")) / ".cache"
    return root / "pcg_engine"
