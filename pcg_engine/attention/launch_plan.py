"""Cached launch plans of unified_attention: a repeated call re-issues its recorded launches.

In piecewise mode every layer of every decode step calls unified_attention with the same host
values (the bucket's T and num_reqs, the step's split count) on buffers at the same addresses (q
and out are graph-owned memory of the bucket, the metadata views of the runner's static buffers,
one KV cache per layer). The first call of such an argument set launches through the JIT
(triton_attention._launch) and records each launch (kernels/fast_launch.py); the plan is those
records plus the partial buffer's size, and later calls compute only the key and the pointers.

The key is everything the launch derives from its arguments except the six tensors' addresses:
shapes, strides and dtypes, the host ints, the tuning, the PDL state, the search block, the current
device. The addresses are the launch's leading pointer arguments, passed per call; the JIT
specialises a pointer on its dtype (in the key) and on its 16-byte alignment, so plans serve
only calls whose six pointers are all aligned (anything else goes to the JIT every time). Hence
eager mode, whose q and out are fresh allocations per layer, hits too.

Partial results of a split launch: one fresh torch.empty per call, as without plans (inside a
graph capture it must come from the graph's pool), its address passed like the others; the
caching allocator's blocks are 512-byte aligned and part_lse starts a multiple of 64 bytes after
part_out, so both keep the class the record was made with (checked per call anyway). The fused
merge's arrival counters are a persistent buffer that is never freed (triton_attention's
_split_counters retires outgrown ones), so a plan may keep its address.

Replay programs (compile/replay_program.py) call the same layers step after step: `for_layers`
binds a plan to all of them at once (LayerCalls: each layer's launcher calls with every argument
ready), with one partial buffer a step that the layers overwrite in turn, and the program passes
its last binding back to be served again while nothing in it changed. The addresses' alignment
is then checked when binding, not per call. Plans are shared by the engines of a process; a
binding and its buffer belong to the one program that asked.
"""

from __future__ import annotations

import torch

from pcg_engine.kernels import fast_launch, pdl

# Entries hold ints and CompiledKernels only. 28 layers x a handful of live (T, split) pairs.
PLANS = fast_launch.LaunchCache(512)


def plan_key(q, kv_cache, out, query_start_loc, seq_lens, block_table, num_reqs: int, max_query_len: int,
             scale: float, num_splits: int, tuning, search: int):
    """Everything but the tensors' addresses that unified_attention's launches depend on. One
    tuple per call, strides as whole tuples (one call each, not one per dim)."""
    return (fast_launch.current_device(), q.shape, q.stride(), q.dtype, out.shape, out.stride(), out.dtype,
            kv_cache.shape, kv_cache.stride(), kv_cache.dtype, block_table.stride(), block_table.dtype,
            query_start_loc.dtype, seq_lens.dtype, num_reqs, max_query_len, scale, num_splits, tuning, search,
            pdl.active())


class AttentionPlan:
    """The recorded launches of one unified_attention argument set (module docstring)."""

    __slots__ = ("main", "merge", "part_numel", "lse_offset", "device", "counters", "stream_device")

    def __init__(self, main, merge, part_numel: int, lse_offset: int, device: torch.device,
                 counters: int | None):
        self.main = main                # RecordedLaunch, 9 pointer slots
        self.merge = merge              # RecordedLaunch, 3 pointer slots, or None
        self.part_numel = part_numel    # fp32 elements of the partial buffer (0: no split)
        self.lse_offset = lse_offset    # bytes from part_out to part_lse in it
        self.device = device            # of the partial buffer
        self.counters = counters        # fused merge's counter address; None: `out` stands in
        self.stream_device = fast_launch.current_device()  # the JIT launched on its stream (in the key)

    def __call__(self, q_p: int, cache_p: int, out_p: int, qsl_p: int, lens_p: int, table_p: int) -> bool:
        """Launch with these addresses; False (nothing launched) where the JIT must do it."""
        if fast_launch.jit_only():
            return False
        stream = fast_launch.current_stream(self.stream_device)
        if self.part_numel:
            part = torch.empty(self.part_numel, dtype=torch.float32, device=self.device)
            po = part.data_ptr()
            if po & 15:
                return False
            pl = po + self.lse_offset
        else:
            po = pl = out_p  # unused by the kernel (see triton_attention._launch)
        ctr = out_p if self.counters is None else self.counters
        self.main(stream, (q_p, cache_p, out_p, qsl_p, lens_p, table_p, po, pl, ctr))
        if self.merge is not None:
            self.merge(stream, (po, pl, out_p))
        return True  # `part` is freed on return: stream order protects it, as for a JIT launch

    def for_layers(self, layers: tuple, qsl_p: int, lens_p: int, table_p: int,
                   last: LayerCalls | None = None) -> LayerCalls | None:
        """This plan's launches for each of `layers` ((q, cache, out) addresses, in order) with these
        metadata addresses, on the current stream; None where the JIT must launch (jit_only, an
        address the plan does not serve). For a replay program (compile/replay_program.py), which
        asks every step for the same layers and passes its previous result as `last`: that is
        served again while the plan, the stream, the layers (the same tuple) and the addresses stay.
        The plan itself keeps nothing: plans are shared by the engines of a process, which may step
        in threads of their own, while each program's binding and partial buffer are its own."""
        if fast_launch.jit_only():
            return None
        stream = fast_launch.current_stream(self.stream_device)
        part = None
        if self.part_numel:
            # As __call__ does once a layer, once a step: the layers overwrite it in turn, in stream
            # order, and the caller lets it go after the step's launches. Torch's allocator hands
            # the same block back step after step, so `last` serves again.
            part = torch.empty(self.part_numel, dtype=torch.float32, device=self.device)
        po = part.data_ptr() if part is not None else 0
        key = (stream, qsl_p, lens_p, table_p, po)
        if last is not None and last.plan is self and last.layers is layers and last.key == key:
            last.part = part
            return last
        if (qsl_p | lens_p | table_p | po) & 15 or any((q | c | o) & 15 for q, c, o in layers):
            return None
        pl = po + self.lse_offset       # (po and pl serve a split plan only: its merge, its main kernel)
        calls = []
        for q_p, cache_p, out_p in layers:
            p_out, p_lse = (po, pl) if part is not None else (out_p, out_p)   # unused without a split
            ctr = out_p if self.counters is None else self.counters
            main = ((self.main.launch, self.main.args(stream, (q_p, cache_p, out_p, qsl_p, lens_p, table_p,
                                                              p_out, p_lse, ctr))),)
            merge = (((self.merge.launch, self.merge.args(stream, (po, pl, out_p))),) if self.merge is not None else ())
            calls.append(main + merge)
        return LayerCalls(self, layers, key, calls, part)


class LayerCalls:
    """An AttentionPlan's launches bound to a replay program's layers: `calls[i]` holds layer i's
    (launch, args) pairs (the main kernel, then the merge where the plan splits without a fused merge),
    to call as launch(*args) (fast_launch.RecordedLaunch.launch), which is what the plan's __call__
    does for that layer without working any argument out again. `part` holds this step's partial
    buffer (a split plan) until the caller lets it go after the step's launches. Owned by one caller
    (a replay program), never shared."""

    __slots__ = ("plan", "layers", "key", "calls", "part")

    def __init__(self, plan: AttentionPlan, layers: tuple, key: tuple, calls: list, part):
        self.plan, self.layers, self.key, self.calls, self.part = plan, layers, key, calls, part
