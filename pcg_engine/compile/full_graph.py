"""Full decode graphs: a decode-only step replays one graph of the whole forward per batch bucket.

A decode-only step of R requests has T = R tokens. The runner pads it to the bucket b >= R
(`batch.prepare(pad_tokens_to=b, pad_reqs_to=b)`: padding requests have seq_len 0 and slot -1, so
they write only the scratch block and attend to nothing) and calls `run`, which replays the graph
captured for b. Attention is inside the graph, so the backend must be graph-safe, and the metadata
the graph was captured with carries the bucket's host values (num_reqs = num_tokens = b,
max_query_len = 1, max_seq_len = max_model_len) over views of the runner's static buffers: the
replay launches exactly the captured grid, reading whatever the buffers hold this step. Capture and
the eager stand-in run inside `backend.capturing()`: the Triton backend then takes its split-KV
count from the bucket (launch_config.graph_num_splits: batch 1 splits each head's keys 16 ways on
an H200), never from a step's max_seq_len.

By default the captured forward is the eager model (its kernels are the fused ones on CUDA);
`forward=` may pass another one (e.g. a compiled forward inside `GraphPool.no_graphs()`). With the
eager model, decode attention also does the RoPE + KV write (`capturing(fuse_rope=True)`: one
launch a layer fewer, attention/rope_decode_attention.py); another forward keeps the two launches,
since the Triton backend then holds the raw q, k, v between two ops, which compiled code may not
leave alone.
"""

import contextlib
import time

import torch

from pcg_engine import switches
from pcg_engine.attention.context import ForwardContext, set_forward_context
from pcg_engine.attention.metadata import AttentionMetadata
from pcg_engine.compile.cuda_graph import GraphPool, capture
from pcg_engine.kernels import pdl

# Warm-up forwards before each bucket's capture (compile/cuda_graph.capture). One makes every lazy
# thing happen outside the capture (stream workspaces, module loads, PDL variants; the kernels are
# compiled by then, engine/precompile.py). Session 1 ran two, before the pre-compile pass existed;
# each is a whole eager forward, 14-28 ms of host a bucket on the H200's CPU (scripts/forward_host.py).
# One instead of two: P5 capture -1.05 s warm, -0.86 s cold (docs/PERF.md, session 12).
# A warm-up before the largest bucket only (PCG_FULL_GRAPH_WARMUP_EVERY=0) cut a warm start's
# capture by another 0.8 s and the GPU graph tests passed, but batch-1 decode then took 0.885 ms a
# token against 0.862, alternated on one H200 (session 13): the graphs were the same (199 kernels,
# 708 us a replay either way, scripts/graph_warmup_check.py) and so were the step's kernels; what
# changed was the host, 1.5-1.7x slower in every phase of a step, scheduling included. Not
# understood, so every bucket keeps its warm-up. PCG_FULL_GRAPH_WARMUPS=N and
# PCG_FULL_GRAPH_WARMUP_EVERY=0|1 are read at import, for A/B runs.
def _warmups_switch() -> int:
    try:
        return max(1, int(switches.read("PCG_FULL_GRAPH_WARMUPS", "1")))
    except ValueError:   # an A/B switch set wrong must not stop the engine from starting
        return 1


DEFAULT_WARMUPS = _warmups_switch()


def _warm_every_switch() -> bool:
    return switches.read("PCG_FULL_GRAPH_WARMUP_EVERY", "1") != "0"


WARM_EVERY_BUCKET = _warm_every_switch()


def default_decode_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, max_num_seqs + 1, 8))
    sizes = [s for s in sizes if s <= max_num_seqs]
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class FullDecodeGraphs:
    def __init__(self, runner, buckets=None, pool: GraphPool | None = None, forward=None, warmups: int = DEFAULT_WARMUPS,
                 warm_every_bucket: bool = WARM_EVERY_BUCKET):
        if not getattr(runner.backend, "cuda_graph_safe", False):
            raise ValueError(f"full decode graphs need a graph-safe attention backend; {runner.backend.name!r} "
                             "reads host values per step (use attention_backend='triton' or mode 'piecewise')")
        self.runner = runner
        # a decode costs one token of the step's budget: no decode batch is larger
        limit = min(runner.config.max_num_seqs, runner.config.max_num_batched_tokens)
        wanted = buckets or default_decode_buckets(limit)
        self.buckets = sorted({b for b in wanted if 1 <= b <= limit})
        if not self.buckets:
            raise ValueError(f"decode_buckets: none of {wanted} is within 1..{limit} (min(max_num_seqs, max_num_batched_tokens))")
        self.pool = pool if pool is not None else GraphPool(runner.device)
        self.forward = forward or runner.model.forward
        self.fuse_rope = forward is None
        self.warmups = warmups
        self.warm_every_bucket = warm_every_bucket
        self.warmup_runs = 0     # warm-up forwards run by capture_all
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.captures: dict[int, int] = {}
        self.replays = 0

    def bucket_for(self, num_reqs: int) -> int | None:
        if num_reqs > self.buckets[-1]:
            return None
        return next(b for b in self.buckets if b >= num_reqs)

    def metadata(self, bucket: int) -> AttentionMetadata:
        """Metadata over the static buffers with the bucket's host values (see the module docstring)."""
        b = self.runner.batch
        return AttentionMetadata(
            query_start_loc=b.query_start_loc[:bucket + 1], seq_lens=b.seq_lens[:bucket],
            block_table=b.step_block_table[:bucket], slot_mapping=b.slot_mapping[:bucket],
            num_reqs=bucket, num_tokens=bucket, max_query_len=1, max_seq_len=self.runner.max_model_len)

    def _forward(self, bucket: int) -> torch.Tensor:
        runner, b = self.runner, self.runner.batch
        context = ForwardContext(self.metadata(bucket), runner.kv_caches, runner.backend)
        with set_forward_context(context):
            return self.forward(b.input_ids[:bucket], b.positions[:bucket])

    def _dummy_batch(self, bucket: int) -> None:
        """A decode batch of padding requests: one token each, seq_len 0, slot -1."""
        b = self.runner.batch
        b.input_ids[:bucket].zero_()
        b.positions[:bucket].zero_()
        b.slot_mapping[:bucket].fill_(-1)
        b.query_start_loc[:bucket + 1].copy_(torch.arange(bucket + 1, dtype=b.query_start_loc.dtype))
        b.seq_lens[:bucket].zero_()
        b.step_block_table[:bucket].zero_()

    def capture_context(self):
        """What a capture runs inside: the backend's graph policy and PDL (kernels/pdl.py, in the
        whole-step graphs only: their warm-up runs compile its variants)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.runner.backend.capturing(fuse_rope=self.fuse_rope))
        stack.enter_context(pdl.scope())
        return stack

    def dummy_forward(self, bucket: int) -> torch.Tensor:
        """The forward a bucket's capture records, over its dummy batch, run as it is (the kernel
        pre-compile's dry pass, engine/precompile.py)."""
        with self.capture_context():
            self._dummy_batch(bucket)
            return self._forward(bucket)

    @torch.inference_mode()
    def capture_all(self, progress=None) -> float:
        """Capture every bucket, largest first, into the shared pool; returns seconds spent."""
        if not self.pool.enabled:
            return 0.0
        t0 = time.perf_counter()
        task = progress.add_task("full decode graphs", total=len(self.buckets)) if progress is not None else None
        with self.capture_context():
            for i, bucket in enumerate(sorted(self.buckets, reverse=True)):
                self._dummy_batch(bucket)
                warmups = self.warmups if i == 0 or self.warm_every_bucket else 0
                graph, out = capture(self.pool, self._forward, bucket, warmups=warmups)
                self.warmup_runs += warmups
                self.graphs[bucket], self.outputs[bucket] = graph, out
                self.captures[bucket] = self.captures.get(bucket, 0) + 1
                if task is not None:
                    progress.advance(task)
        if self.pool.device.type == "cuda":
            torch.cuda.synchronize(self.pool.device)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def run(self, inputs, runner=None) -> torch.Tensor:
        """Replay the step's bucket; inputs are already in the static buffers. Returns hidden [bucket, D]."""
        bucket = inputs.metadata.num_reqs
        b = self.runner.batch
        if inputs.input_ids.data_ptr() != b.input_ids.data_ptr() or inputs.input_ids.shape[0] != bucket:
            raise RuntimeError(f"full decode graph for bucket {bucket} needs the step padded to it in the static "
                               f"buffers; got {inputs.input_ids.shape[0]} tokens")
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
            self.replays += 1
            return self.outputs[bucket]
        # No graph (CPU, or capture skipped): the same computation on the same buffers, eagerly.
        with self.runner.backend.capturing(fuse_rope=self.fuse_rope):
            return self._forward(bucket)
