"""The `rope_attention` section of scripts/bench_kernels.py: fused RoPE + decode attention vs the two launches.

What a full decode graph runs per layer at batch 1, timed in CUDA-graph replays with PDL on (as
inside those graphs): rope_kv.py's `_rope_kv_kernel` + the split decode attention + its merge
(before) against rope_decode_attention.py's kernel + the same merge (after), at Qwen3-0.6B (Hq 16)
and 8B (Hq 32) head shapes (Hk 8, head_dim 128, bf16, block 16) and 128 / 384 / 1,024 / 8,192
keys, with the bucket's split count (launch_config.graph_num_splits). Two timings a row:
  * cold: one call per replay step with the L2 flushed before it (bench_kernels.time_us: in the
    model a layer's KV is long evicted by the 27 other layers' weights);
  * back-to-back: a graph of calls on rotating input sets, one layer after another as a step issues
    them, where PDL lets each kernel's launch overlap the previous one's tail.
Each row is checked: the fused path must write the same cache and give the same output (relative
error) as the two launches. Ends with the predicted saving of a batch-1 decode step.
"""

from __future__ import annotations

import torch

HK, D, BS, DTYPE = 8, 128, 16, torch.bfloat16
CONTEXTS = (128, 384, 1024, 8192)
MODELS = ((16, "0.6B", 28), (32, "8B", 36))


class DecodeLayer:
    """Rotating input sets of one batch-1 decode layer: raw qkv, position ctx - 1, its slot, a random
    paged cache of ctx keys; the two paths run on the same sets."""

    def __init__(self, Hq: int, ctx: int):
        from pcg_engine.attention.launch_config import GRAPH_SPLIT_DECODE_TUNING, graph_num_splits
        from pcg_engine.attention.rope import rope_cache
        self.Hq, self.ctx = Hq, ctx
        self.splits = graph_num_splits(1, HK, 1, torch.device("cuda"))
        self.tuning = GRAPH_SPLIT_DECODE_TUNING if self.splits > 1 else None
        self.cos_sin = rope_cache(D, 40960, 1e6, device="cuda")
        self.kv_bytes = 2 * ctx * HK * D * 2
        self.sets = [self._inputs() for _ in range(max(1, min(8, 2 + (256 << 20) // self.kv_bytes)))]
        self.calls = 8 * len(self.sets) if len(self.sets) > 1 else 4

    def _inputs(self) -> dict:
        nblk = -(-self.ctx // BS)
        table = (torch.randperm(nblk, device="cuda") + 1).view(1, -1).to(torch.int32)
        p = self.ctx - 1
        qkv = torch.randn(1, (self.Hq + 2 * HK) * D, device="cuda", dtype=DTYPE)
        q, k, v = qkv.split([self.Hq * D, HK * D, HK * D], dim=-1)
        return dict(q=q.view(1, self.Hq, D), k=k.view(1, HK, D), v=v.view(1, HK, D),
                    positions=torch.tensor([p], device="cuda"),
                    slots=(table[0, p // BS].long() * BS + p % BS).view(1),
                    cache=torch.randn(2, nblk + 1, BS, HK, D, device="cuda", dtype=DTYPE),
                    seq_lens=torch.tensor([self.ctx], device="cuda", dtype=torch.int32), block_table=table,
                    qsl=torch.tensor([0, 1], device="cuda", dtype=torch.int32),
                    q_norm=torch.rand(D, device="cuda", dtype=DTYPE) + 0.5,
                    k_norm=torch.rand(D, device="cuda", dtype=DTYPE) + 0.5,
                    out=torch.empty(1, self.Hq, D, device="cuda", dtype=DTYPE))

    def two_kernels(self, i: int) -> None:
        from pcg_engine.attention.rope_kv import rope_and_write_kv
        from pcg_engine.attention.triton_attention import unified_attention
        s = self.sets[i % len(self.sets)]
        q_rot = rope_and_write_kv(s["q"], s["k"], s["v"], s["positions"], self.cos_sin, s["cache"], s["slots"],
                                  q_norm=s["q_norm"], k_norm=s["k_norm"], eps=1e-6)
        unified_attention(q_rot, s["cache"], s["out"], s["qsl"], s["seq_lens"], s["block_table"], 1, 1, D ** -0.5,
                          self.splits, tuning=self.tuning)

    def fused(self, i: int) -> None:
        from pcg_engine.attention.rope_decode_attention import rope_decode_attention
        s = self.sets[i % len(self.sets)]
        rope_decode_attention(s["q"], s["k"], s["v"], s["positions"], self.cos_sin, s["cache"], s["slots"], s["out"],
                              s["seq_lens"], s["block_table"], 1, D ** -0.5, self.splits, s["q_norm"], s["k_norm"],
                              1e-6, tuning=self.tuning)

    def back_to_back_us(self, fn) -> float:
        from pcg_engine.bench.common import graph_of_calls
        from pcg_engine.kernels import pdl
        with pdl.scope():
            graph = graph_of_calls(fn, self.calls)
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2] * 1e3 / self.calls

    def mismatch(self) -> str:
        """'' when the fused path writes what the two launches write (set 0, fresh copies)."""
        s = self.sets[0]
        cache0 = s["cache"].clone()
        self.two_kernels(0)
        ref_cache, ref_out = s["cache"].clone(), s["out"].float().clone()
        s["cache"].copy_(cache0)
        s["out"].fill_(float("nan"))
        self.fused(0)
        torch.cuda.synchronize()
        err = float((s["out"].float() - ref_out).norm() / ref_out.norm())
        problems = []
        if not torch.isfinite(s["out"]).all() or err > 1e-2:
            problems.append(f"out rel. error {err:.1e}")
        if not torch.equal(s["cache"], ref_cache):
            problems.append(f"cache differs in {int((s['cache'] != ref_cache).sum())} elements")
        return "; ".join(problems)


def rope_attention_rows(time_us, row) -> list:
    """bench_kernels.py's section: its time_us (cold, flushed L2) and row (table row) are passed in."""
    from pcg_engine.kernels import pdl
    rows, saving = [], {}
    for Hq, model, layers in MODELS:
        for ctx in CONTEXTS:
            layer = DecodeLayer(Hq, ctx)
            with pdl.scope():
                before = time_us(lambda: layer.two_kernels(0), reps=20)
                after = time_us(lambda: layer.fused(0), reps=20)
            warm_before, warm_after = layer.back_to_back_us(layer.two_kernels), layer.back_to_back_us(layer.fused)
            wrong = layer.mismatch()
            shape = f"B1 ctx{ctx} Hq{Hq} Hk{HK} D{D} ({model})"
            nbytes = layer.kv_bytes + 2 * Hq * D * 2
            common = f"splits={layer.splits}"
            rows.append(row("rope_kv + attention + merge", shape, before, nbytes, "GB/s",
                            f"{common}; back-to-back {warm_before:.1f} us"))
            note = (f"{common}; back-to-back {warm_after:.1f} us; saves {before - after:.1f} us cold, "
                    f"{warm_before - warm_after:.1f} back-to-back")
            rows.append(row("fused rope + attention + merge", shape, after, nbytes, "GB/s",
                            f"WRONG ({wrong}) {note}" if wrong else note))
            if ctx <= 384:
                saving.setdefault(model, []).append((before - after, warm_before - warm_after, layers))
    for model, found in saving.items():
        layers = found[0][2]
        cold = sum(f[0] for f in found) / len(found)
        warm = sum(f[1] for f in found) / len(found)
        print(f"fused rope + attention, Qwen3-{model}: {cold:.1f} us a layer cold, {warm:.1f} back-to-back at "
              f"128-384 keys -> ~{layers * cold:.0f}-{layers * warm:.0f} us a batch-1 decode step ({layers} layers)")
    return rows
