"""Keep the garbage collector's full collections off the serving path: freeze start-up's objects.

After start-up the process holds a few million objects the collector tracks (torch, Triton, Dynamo
and Inductor with their caches, the model's modules, the engine) that live until the engine closes.
A collection of the oldest generation walks every one of them: 125-150 ms each on the CPU dev
machine (scripts/gc_pauses.py), and the first ones fall early in serving, because the interpreter
sizes its next full collection by the objects its last one saw, and that one ran during the imports.
One such pause is a hundred-odd decode steps' worth of a small model's GPU time spent idle.

`freeze()` (end of the engine's start-up) collects once, then moves every object alive into the
collector's permanent generation (`gc.freeze()`), which collections skip; such objects are still
freed by reference counting, only reference cycles among them wait. So it first un-freezes: the
cycles an earlier engine of this process left are collected then, not kept frozen for good.
`unfreeze()` (engine close) gives everything back to the collector before the runner's collection
that frees the engine's memory. `gc_freeze=False` in EngineConfig leaves the collector alone.
"""

import gc


def freeze() -> int:
    """Collect, then freeze everything alive; returns the number of objects frozen."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze() -> None:
    gc.unfreeze()
