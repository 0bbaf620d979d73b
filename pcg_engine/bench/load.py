"""Weight-load benchmark (foundation issue): checkpoint directory -> model ready on the device.

Compares the load time with the time to read the same files from disk (read first, so both see a
warm page cache, and again after loading), and reports the peak host memory above the baseline
against the largest shard's size: a loader that streams shard by shard stays under one shard.

    pcg bench load --model qwen3-8b --device cuda --json load.json
"""

import argparse
import resource
import time
from pathlib import Path

from pcg_engine.bench.common import (HelpFormatter, config_record, env_record, json_path, print_table, resolve_model,
                                     write_json)


def _read_files(files) -> float:
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    return time.perf_counter() - t0


def _rss_mib() -> tuple[float, float]:
    """(resident MiB, anonymous resident MiB). The second excludes pages of mapped files:
    safetensors maps each shard, and the kernel's page cache behind those pages is not a copy
    of the weights made by this process."""
    rss = anon = None
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("RssAnon:"):
                anon = int(line.split()[1]) / 1024
    if rss is None:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return rss, rss if anon is None else anon


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pcg bench load", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="tiny-qwen3")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", default=None, type=json_path)
    return p


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    import torch

    from pcg_engine.models.loader import load_model, weight_files

    from pcg_engine.config import EngineConfig

    # The engine's own checks (a ConfigError naming --device / --dtype, one line from `pcg bench`):
    # torch's RuntimeError for --device tpu and an AttributeError for --dtype bogus were tracebacks.
    config = EngineConfig(device=args.device, dtype=args.dtype)
    device = config.resolved_device()
    path = Path(resolve_model(args.model))
    files = weight_files(path)
    total = sum(f.stat().st_size for f in files)
    largest = max(f.stat().st_size for f in files)
    read_s = _read_files(files)
    if device.startswith("cuda"):
        # Create the CUDA context first: its host memory (driver, modules) is not the loader's.
        torch.zeros(1, device=device)
        torch.cuda.synchronize()
    base = _rss_mib()
    peak = list(base)
    # Sample RSS from a thread while loading: ru_maxrss is the whole process's lifetime peak.
    import threading
    done = threading.Event()

    def sample():
        while not done.is_set():
            now = _rss_mib()
            peak[0], peak[1] = max(peak[0], now[0]), max(peak[1], now[1])
            time.sleep(0.01)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    dtype = config.torch_dtype(torch.device(device).type)
    model = load_model(path, device=device, dtype=dtype)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    done.set()
    sampler.join()
    read_again_s = _read_files(files)
    result = {"load_s": load_s, "read_files_s": read_s, "read_files_again_s": read_again_s,
              "load_over_read": load_s / max(min(read_s, read_again_s), 1e-9),
              "checkpoint_gib": total / 2**30, "largest_shard_gib": largest / 2**30,
              "peak_host_above_baseline_gib": (peak[0] - base[0]) / 1024,
              "peak_anon_host_above_baseline_gib": (peak[1] - base[1]) / 1024,
              "num_files": len(files), "parameters": sum(x.numel() for x in model.parameters()),
              # (the dtype decides the bytes loaded: left out, a bf16 and an fp32 load read alike)
              "dtype": str(dtype).removeprefix("torch."), **env_record(str(path), device),
              "config": config_record(args)}
    print_table("weight load", ["what", "value"], [[k, v] for k, v in result.items()
                                                   if isinstance(v, (int, float))])
    if args.json:
        write_json(args.json, result)
    return 0
