"""P5 start-up: process start to ready, cold (empty caches) and warm (caches filled by the cold run).

Each run is a fresh Python process, timed from its spawn to the moment `LLM(...)` returns, so
imports count. Cold runs get empty compile, Inductor and Triton cache directories; the warm run
reuses them. The child reports the engine's own split (weight load, Dynamo, Inductor, capture) and
the graph pool size.

Both runs also share a private, initially empty PYTHONPYCACHEPREFIX (beside those caches): Python
keeps the bytecode of every module it compiles there. A normal `pip install` writes .pyc files at
install time, so a real warm start never compiles torch's or transformers' sources; the GPU
machine's venv is read-only and has none (and PYTHONDONTWRITEBYTECODE=1 is set there and on the
development machine), so every process recompiled them (7 s of the warm run in builtins.compile,
bd3267b's profile). The children run with the prefix and without PYTHONDONTWRITEBYTECODE, so the
warm run sees what an installed package sees. The cold run pays the compiles, as a first start without any bytecode
would (on a machine whose venv does hold .pyc files, the prefix hides them, so the cold figure is
the no-bytecode worst case there too). A third run, "cold, bytecode", has empty compile, Inductor and
Triton caches again but the bytecode the first two left: the first start of an installed package.

    pcg bench startup --model qwen3-0.6b --mode full_and_piecewise --json startup.json

An A/B of a switch read at start-up, on warm starts only (the P5 warm figure moves by seconds
between machines, so both sides must share one): `--warm-ab PCG_SAVED_TRACE=0,1` runs the cold start
with the variable at 0, one start at 1 to fill that value's compile-cache entry (PCG_* switches are
in the cache's key), then warm starts at 0, 1, 0, 1 (`--warm-repeats` rounds) over those caches;
`--no-cold-bytecode` skips the third run.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from pcg_engine.bench.common import (HelpFormatter, directory_path, env_record, int_at_least, json_path, only_with,
                                     print_table, resolve_model, write_json)
from pcg_engine.config import MODES, EngineConfig

_CHILD = """
import json, os, sys, time
t0 = time.perf_counter()
prof_path = os.environ.get("PCG_STARTUP_PROFILE")
if prof_path:  # where the seconds go, by function (cumulative), written as text beside the JSON
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
from pcg_engine.llm import LLM
imports_s = time.perf_counter() - t0
cfg = json.loads(sys.argv[1])
llm = LLM(cfg.pop("model"), **cfg)
runner = llm.engine.runner
if prof_path:
    import io, pstats
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(120)
    with open(prof_path, "w") as f:
        f.write(text.getvalue())
print("PCG_READY " + json.dumps({"timings": {"imports_s": imports_s, **runner.timings}, "mode": runner.mode}), flush=True)
"""


def run_once(model: str, config: dict, cache_root: str, profile_path: str | None = None,
             pycache: str | None = None, extra_env: dict | None = None) -> dict:
    env = dict(os.environ, **(extra_env or {}))
    if profile_path:
        env["PCG_STARTUP_PROFILE"] = profile_path
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_root, "inductor")
    env["TRITON_CACHE_DIR"] = os.path.join(cache_root, "triton")
    env["PYTHONPYCACHEPREFIX"] = pycache or os.path.join(cache_root, "pycache")   # see the module docstring
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    payload = json.dumps({"model": model, "compile_cache_dir": os.path.join(cache_root, "pcg"), **config})
    # The child's stderr goes to a file, not a pipe read only at its end: more than a pipe's 64 KiB
    # of it (TORCH_LOGS=+dynamo, PYTHONVERBOSE=1) blocked the child in its write while this process
    # waited for its ready line, for ever (found by a review).
    with tempfile.TemporaryFile(mode="w+") as err_file:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, payload], stdout=subprocess.PIPE, stderr=err_file,
                                text=True, env=env)
        ready = None
        for line in proc.stdout:
            if line.startswith("PCG_READY "):
                ready = time.perf_counter() - t0
                info = json.loads(line[len("PCG_READY "):])
                break
        proc.communicate()
        if ready is None:
            err_file.seek(0)
            raise SystemExit(f"start-up run failed (exit {proc.returncode}):\n{err_file.read()[-3000:]}")
    return {"ready_s": ready, **info}


def _ab_switch(text: str) -> tuple[str, list[str]]:
    """--warm-ab's VAR=A,B[,C...]: an environment variable and the values to alternate."""
    var, sep, values = text.partition("=")
    items = values.split(",")
    if not sep or not var or not var.replace("_", "").isalnum() or len(items) < 2:
        raise argparse.ArgumentTypeError(f"must be VAR=A,B (an environment variable and two or more values), got {text!r}")
    return var, items


def _warm_ab(model: str, config: dict, root: str, prof, var: str, values: list[str], repeats: int):
    """--warm-ab: a cold start with var at the first value; one start at each other value, which
    fills that value's compile-cache entry (PCG_* switches are part of the key, compile/cache.py);
    then `repeats` rounds of warm starts over the values, all on this machine and these caches.
    Returns (cold, primes, warm, runs), runs being the (label, result) rows of the table."""
    cold = run_once(model, config, root, prof("cold"), extra_env={var: values[0]})
    runs = [(f"cold {var}={values[0]}", cold)]
    primes, warm = [], []
    for value in values[1:]:
        r = run_once(model, config, root, prof(f"prime_{var}_{value}"), extra_env={var: value})
        primes.append({"env": {var: value}, **r})
        runs.append((f"prime {var}={value}", r))
    for i in range(repeats):
        for value in values:
            r = run_once(model, config, root, prof(f"warm_{var}_{value}_{i + 1}"), extra_env={var: value})
            warm.append({"env": {var: value}, "round": i + 1, **r})
            runs.append((f"warm {var}={value} #{i + 1}", r))
    return cold, primes, warm, runs


def _check_config(config: dict) -> None:
    """The settings ModelRunner checks without weights, checked here: a bad --device or
    --max-num-seqs (or full_decode on the CPU) failed in the child, after its imports, with the
    ConfigError's traceback. A ConfigError reaches `pcg bench`, which names the flag."""
    cfg = EngineConfig(**config)
    device_type = cfg.resolved_device().split(":")[0]
    cfg.check_triton_usable(device_type)
    cfg.check_mode_backend(device_type)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pcg bench startup", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="tiny-qwen3")
    # Checked here: a typo failed in the child process, whose ConfigError traceback was printed.
    p.add_argument("--mode", default="auto", choices=MODES + ("auto",))
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int_at_least(1), default=256)
    p.add_argument("--json", default=None, type=json_path)
    p.add_argument("--profile-dir", default=None, type=directory_path, help="write a cProfile summary of each run (cold.txt, warm.txt) here")
    p.add_argument("--warm-ab", default=None, type=_ab_switch, metavar="VAR=A,B",
                   help="an A/B of warm starts: after the cold run, warm runs with the environment variable VAR "
                        "set to A, B, A, B, ... (--warm-repeats rounds) instead of the one plain warm run")
    p.add_argument("--warm-repeats", type=int_at_least(1), default=None, help="rounds of --warm-ab (default 2)")
    p.add_argument("--no-cold-bytecode", action="store_true", help="skip the third run (cold, bytecode)")
    return p


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    only_with(args, "--warm-ab", {"warm_repeats": 2})
    config = {"mode": args.mode, "device": args.device, "max_num_seqs": args.max_num_seqs}
    _check_config(config)
    model = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="pcg-startup-") as root:
        os.chmod(root, 0o700)
        prof = (lambda name: os.path.join(args.profile_dir, f"{name}.txt")) if args.profile_dir else (lambda name: None)
        if args.profile_dir:
            os.makedirs(args.profile_dir, exist_ok=True)
        if args.warm_ab is None:
            cold = run_once(model, config, root, prof("cold"))
            warm = run_once(model, config, root, prof("warm"))
            primes, runs = [], [("cold", cold), ("warm", warm)]
        else:
            cold, primes, warm, runs = _warm_ab(model, config, root, prof, *args.warm_ab, args.warm_repeats)
        cold_bytecode = None
        if not args.no_cold_bytecode:
            # Empty compile caches again, with the bytecode the two runs left: an installed package's first start.
            fresh = os.path.join(root, "fresh")
            os.makedirs(fresh, mode=0o700)
            cold_bytecode = run_once(model, config, fresh, prof("cold_bytecode"), pycache=os.path.join(root, "pycache"))
            runs.append(("cold, bytecode", cold_bytecode))
    rows = []
    parts = ("imports_s", "device_init_s", "weight_load_s", "kv_cache_s", "dynamo_s", "inductor_s", "precompile_s",
             "capture_s", "warmup_s", "gc_freeze_s")
    for name, r in runs:
        t = r["timings"]
        other = r["ready_s"] - sum(t.get(k) or 0.0 for k in parts)   # interpreter start, engine objects
        rows.append([name, r["ready_s"], *(t.get(k) for k in parts), other, t.get("graph_pool_mib"),
                     t.get("late_variants"), t.get("saved_trace_loaded")])
    print_table(f"start-up ({cold['mode']})", ["run", "ready s", "imports s", "CUDA init s", "weights s", "KV cache s",
                                                "dynamo s", "inductor s", "pre-compile s", "capture s", "warm-up s", "gc freeze s",
                                                "other s", "graph pool MiB", "late variants", "trace loaded"], rows)
    if args.json:
        write_json(args.json, {"cold": cold, "warm": warm, "cold_bytecode": cold_bytecode, "config": config,
                               **({"primes": primes, "warm_ab": args.warm_ab[0]} if args.warm_ab else {}),
                               **env_record(model, args.device)})
    return 0
