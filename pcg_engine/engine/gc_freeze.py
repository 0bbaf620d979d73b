"""Keep the garbage collector's long pauses off the serving path: freeze start-up's objects.

After start-up the process holds hundreds of thousands of objects the collector tracks (torch,
Triton, Dynamo and Inductor with their caches, the model's modules, the engine: 224k in eager mode
and 521k in piecewise mode for the tiny model on the CPU dev machine) that live until the engine
closes. A collection of the oldest generation walks every one of them: 150-330 ms each in eager
mode and 390-450 ms in piecewise mode on that machine (scripts/gc_pauses.py, docs/PERF.md session
8), and the first one can fall early in serving (step 65 of one run), because CPython (3.11-3.13)
sizes its next full collection by the objects its last one saw. One such pause is a few hundred decode
steps' worth of a small model's GPU time spent idle.

`freeze()` (end of the engine's start-up) collects once, then moves every object alive into the
collector's permanent generation (`gc.freeze()`), which no collection walks; such objects are still
freed by reference counting, only reference cycles among them wait. So it first un-freezes: the
cycles an earlier engine of this process left are collected then, not kept frozen for good.
`unfreeze()` (engine close, whatever the setting: an engine built with gc_freeze=False may have
seen another engine freeze its objects) gives everything back to the collector before the
runner's collection that frees the engine's memory. `gc_freeze=False` in EngineConfig leaves the
collector alone at start-up. The tokenizer, loaded on the first text (engine/tokenizer.py) unless
the EOS ids needed it at start-up, is not frozen then: it adds ~7.5k objects, not worth a second
full collection in the middle of serving.
The collector's state is the process's: closing one engine un-freezes the objects of another still
running in the same process too (it then serves as with gc_freeze=False until it is rebuilt).

At exit: a process that ends without closing its engine (a script that builds an LLM, generates and
returns) would leave the frozen objects out of the interpreter's last collections, and their
finalizers never run. With Triton 3.9 that printed ~30 lines of "nanobind: leaked ..." on every such
exit (its import-time IR objects, frozen with the rest). So the first freeze registers an atexit
handler that un-freezes: atexit handlers run before the interpreter's final collections.
"""

import atexit
import gc

_exit_handler_registered = False


def freeze() -> int:
    """Collect, then freeze everything alive; returns the number of objects frozen."""
    global _exit_handler_registered
    if not _exit_handler_registered:
        atexit.register(gc.unfreeze)
        _exit_handler_registered = True
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze() -> None:
    gc.unfreeze()
