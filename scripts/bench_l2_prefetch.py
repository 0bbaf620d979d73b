"""Does an L2 prefetch of the next weight, issued before the small kernels of a decode layer, shorten
Qwen3-8B's batch-1 layer? A stand-in layer in one CUDA graph: the four projections at 8B's shapes
(o and down as kernels/split_k.py's partials, as in the model) with `torch.cuda._sleep` in place of
the small kernels between them (12 µs of RoPE + attention + merge, 3 µs of norm, 1.6 µs of SiLU),
36 layers of distinct weights, with and without kernels/l2_prefetch.py's requests.

    python scripts/bench_l2_prefetch.py [--json PATH] [--rounds 2]

Prints µs a layer per variant and the change against no prefetch, alternated `--rounds` times.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pcg_engine.bench.common import graph_of_calls, replay_us  # noqa: E402
from pcg_engine.kernels import l2_prefetch, split_k  # noqa: E402

LAYERS = 36
HIDDEN, INTER, QKV = 4096, 12288, 6144
GAPS_US = {"attn": 12.0, "norm": 3.0, "silu": 1.6}
BW = 4.0e12   # bytes a second the bus could move during a gap


def sleep_cycles_per_us() -> float:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(50):
            torch.cuda._sleep(20000)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return 20000 * 50 / (start.elapsed_time(end) * 1e3)


def make_layers(dev, dt):
    layers = []
    for _ in range(LAYERS):
        layers.append({
            "qkv": torch.randn(QKV, HIDDEN, device=dev, dtype=dt),
            "o": torch.randn(HIDDEN, HIDDEN, device=dev, dtype=dt).t().contiguous().t(),   # store_transposed
            "gu": torch.randn(2 * INTER, HIDDEN, device=dev, dtype=dt),
            "down": torch.randn(HIDDEN, INTER, device=dev, dtype=dt).t().contiguous().t(),
        })
    return layers


def run_layers(layers, xs, variant, cycles_per_us, side):
    """One token's 36 layers. variant: "mode"; "o": bytes of o's weight to prefetch before the
    attention gap (None: all); "frac": of each other gap's bus bytes to prefetch of the next weight;
    "side": prefetch on a second stream, joined before the GEMM; "chunk": a bulk request's bytes."""
    mode, frac = variant.get("mode"), variant.get("frac", 0.0)
    sleep = variant.get("sleep", 1.0)
    main = torch.cuda.current_stream()

    def ask(t, nbytes):
        size = t.numel() * t.element_size()
        nbytes = size if nbytes is None else min(size, int(nbytes))
        if variant.get("side"):
            side.wait_stream(main)
            with torch.cuda.stream(side):
                l2_prefetch.prefetch(t, nbytes, mode=mode, chunk=variant.get("chunk", l2_prefetch.CHUNK))
        else:
            l2_prefetch.prefetch(t, nbytes, mode=mode, chunk=variant.get("chunk", l2_prefetch.CHUNK))

    def gap(name, nxt):
        asked = False
        if mode:
            if name == "attn" and "o" in variant:
                ask(nxt, variant["o"])
                asked = True
            elif name != "attn" and frac:
                ask(nxt, frac * GAPS_US[name] * 1e-6 * BW)
                asked = True
        if sleep:
            torch.cuda._sleep(int(GAPS_US[name] * sleep * cycles_per_us))
        if asked and variant.get("side"):
            main.wait_stream(side)

    for i, w in enumerate(layers):
        F.linear(xs[HIDDEN], w["qkv"])
        gap("attn", w["o"])
        split_k.partials(xs[HIDDEN], w["o"], 4)
        gap("norm", w["gu"])
        F.linear(xs[HIDDEN], w["gu"])
        gap("silu", w["down"])
        split_k.partials(xs[INTER], w["down"], 4)
        gap("norm", layers[(i + 1) % len(layers)]["qkv"])


def time_variant(layers, xs, variant, cycles_per_us, reps=20) -> float:
    side = torch.cuda.Stream()
    graph = graph_of_calls(lambda _: run_layers(layers, xs, variant, cycles_per_us, side), 1)
    return replay_us(graph, reps) / len(layers)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    cycles = sleep_cycles_per_us()
    layers = make_layers(dev, dt)
    xs = {HIDDEN: torch.randn(1, HIDDEN, device=dev, dtype=dt), INTER: torch.randn(1, INTER, device=dev, dtype=dt)}
    mb = 1 << 20
    variants = {   # session 20, call 1: on the same stream every prefetch cost its own transfer time
        "gemms only": {"sleep": 0},
        "none": {},
        "o line 16MB": {"mode": "line", "o": 16 * mb},
        "o line 16MB side": {"mode": "line", "o": 16 * mb, "side": True},
        "o line 24MB side": {"mode": "line", "o": 24 * mb, "side": True},
        "o line all side": {"mode": "line", "o": None, "side": True},
        "o bulk 4K 16MB side": {"mode": "bulk", "o": 16 * mb, "side": True, "chunk": 4096},
        "o bulk_el 4K 16MB side": {"mode": "bulk_evict_last", "o": 16 * mb, "side": True, "chunk": 4096},
        "all line 16MB side": {"mode": "line", "o": 16 * mb, "frac": 1.0, "side": True},
        "gemms only + o line 16MB side": {"sleep": 0, "mode": "line", "o": 16 * mb, "side": True},
    }
    results = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, v in variants.items():
            results[name].append(time_variant(layers, xs, v, cycles))
    base = min(results["none"])
    print(f"sleep: {cycles:.0f} cycles/us; gaps {GAPS_US} us; {LAYERS} layers of 8B shapes, batch 1")
    print(f"{'variant':26s} {'us/layer (rounds)':>28s} {'vs none':>9s}")
    for name, ts in results.items():
        print(f"{name:26s} {' '.join(f'{t:8.2f}' for t in ts):>28s} {min(ts) - base:+9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cycles_per_us": cycles, "gaps_us": GAPS_US,
                                               "us_per_layer": results}, indent=1))


if __name__ == "__main__":
    main()
