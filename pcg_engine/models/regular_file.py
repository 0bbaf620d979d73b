"""Opening a checkpoint's file only if it is a regular file.

A named pipe (or a device) in a checkpoint's place blocked the load in open() until something
wrote to it, or read without end. The readers of config.json, the index, the tokenizer's files
and the shards open through here; model_config.check_readable refuses such entries in the
directory before the tokenizer library gets to open them.
"""

import os
import stat
from pathlib import Path

from pcg_engine.errors import CheckpointError


def kind_of(mode: int) -> str:
    return ("a directory" if stat.S_ISDIR(mode) else "a named pipe" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "not a regular file")


def open_regular(path: Path, buffering: int = -1):
    """`path` opened for reading if it is a regular file (symlinks followed), else a CheckpointError.
    A named pipe blocked the load in open() until something wrote to it: O_NONBLOCK lets the open
    return, the type is checked on the descriptor itself (not a path that could change in between),
    and a regular file's reads go on blocking as usual."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{path}: is {kind_of(mode)}; a checkpoint's files are regular files")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


__all__ = ["kind_of", "open_regular"]
