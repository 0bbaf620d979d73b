"""The PCG_* A/B switches that modules read once, at import.

The compile cache keys an entry by the PCG_* settings (compile/cache.py: several switches decide at
trace time what the graph calls). Read from os.environ when the key is made, a switch a module had
read at import could differ from it: a process that changed its environment in between (a test, a
script alternating A/B runs) stored an entry under the variant it did not run, which a later start
with that setting would load. Each import-time read goes through `read`, which records the value the
module took; the key takes these records over the live environment.
"""

import os

# name -> the value read at import (None: unset, the default was taken)
AT_IMPORT: dict[str, str | None] = {}


def read(name: str, default: str) -> str:
    """os.environ[name] (default if unset), recorded as what this process runs with."""
    value = os.environ.get(name)
    AT_IMPORT[name] = value
    return default if value is None else value


def effective(environ=None) -> dict[str, str]:
    """The PCG_* settings in force: the environment's, with each import-time switch as it was read."""
    settings = {k: v for k, v in (os.environ if environ is None else environ).items() if k.startswith("PCG_")}
    for name, value in AT_IMPORT.items():
        if value is None:
            settings.pop(name, None)
        else:
            settings[name] = value
    return settings


__all__ = ["AT_IMPORT", "effective", "read"]
