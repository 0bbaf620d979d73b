"""What every benchmark shares: model and engine flags, the environment record, stats, tables, JSON.

A figure counts only with the command, commit, date and card that produced it (BENCHMARKS.md), so
every JSON a benchmark writes carries `env_record()` and the full configuration next to its numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

import numpy as np

from pcg_engine.config import FLAG_HELP, MODES, EngineConfig, check_kv_sizing_flags, num_kv_blocks_help

REPO_ROOT = Path(__file__).resolve().parents[2]


# ---- model ---------------------------------------------------------------------------------------
def resolve_model(model: str | None, seed: int = 0) -> str:
    """A checkpoint directory, or a preset name built once into the user cache (random weights
    drawn from `seed`, one checkpoint per seed)."""
    from pcg_engine.cache_home import cache_home
    from pcg_engine.models import presets
    from pcg_engine.models.checkpoint_maker import DEFAULT_PRESET, ensure_checkpoint, ensure_default_model

    if model is None or model == DEFAULT_PRESET:
        return str(ensure_default_model())
    if Path(model).is_dir():
        return str(model)
    if model not in presets.PRESETS:
        raise SystemExit(f"--model: {model!r} is neither a checkpoint directory nor a preset; "
                         f"presets: {', '.join(sorted(presets.PRESETS))}")
    import torch
    root = cache_home() / "models"      # (a relative XDG_CACHE_HOME was taken here, not elsewhere)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return str(ensure_checkpoint(model, root / f"{model}-seed{seed}", seed=seed, device=device))


# ---- flags ---------------------------------------------------------------------------------------
def int_at_least(low: int, high: int | None = None):
    """An argparse type: an integer >= low (and <= high when given). A bad value stops the command
    at parse time, naming the flag and its range (`error: argument --num-prompts: must be an
    integer >= 1, got 0`), before an engine is built."""
    allowed = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return value
    parse.__name__ = allowed
    return parse


def max_num_seqs_flag(text: str) -> int:
    """An argparse type for a benchmark flag that sets max_num_seqs (overhead's --slots and
    --batch-sizes, profile's --requests): EngineConfig's range, refused under the flag's own name
    (`--slots 5000` read "max_num_seqs: got 5000", a name the command line does not have)."""
    from pcg_engine.config import MAX_NUM_SEQS
    return int_at_least(1, MAX_NUM_SEQS)(text)


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1) (the benchmarks' --range-ratio)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:      # (NaN fails too)
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {value}")
    return value


def temperature(text: str) -> float:
    """An argparse type: a sampling temperature, a finite number in [0, MAX_TEMPERATURE] (0: greedy).
    SamplingParams refuses the rest too, but only once the engine was built (a minute on a GPU)."""
    from pcg_engine.sampling_params import MAX_TEMPERATURE, TEMPERATURE_RANGE
    allowed = f"must be a finite number {TEMPERATURE_RANGE}"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{allowed}, got {text!r}") from None
    if not 0 <= value <= MAX_TEMPERATURE:      # (NaN fails too)
        raise argparse.ArgumentTypeError(f"{allowed}, got {value}")
    return value


def add_common_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default=None,
                   help="checkpoint directory or preset name (tiny-qwen3, qwen3-0.6b, ...; built on first use; "
                        "default tiny-qwen3)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16, float32 (default auto: bf16 on CUDA, "
                   "fp32 on the CPU)")
    p.add_argument("--json", default=None, type=json_path, metavar="PATH", help="write the results as JSON here")
    # numpy's generator takes seeds >= 0: a negative one failed inside numpy after the engine was built
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the random dataset, and of a preset model's random weights "
                   "(a preset is built once per seed)")
    g = p.add_argument_group("engine")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests run at once (default 256); overhead and profile set it from their own flag")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help=FLAG_HELP["max_num_batched_tokens"])
    g.add_argument("--max-model-len", type=int, default=None, help=FLAG_HELP["max_model_len"])
    g.add_argument("--num-kv-blocks", type=int, default=None, help=num_kv_blocks_help(str(EngineConfig.block_size)))
    g.add_argument("--gpu-memory-utilization", type=float, default=None, help=FLAG_HELP["gpu_memory_utilization"])
    g.add_argument("--attention-backend", default=None, help=FLAG_HELP["attention_backend"])
    return p


class HelpFormatter(argparse.HelpFormatter):
    """The benchmarks' --help: each option with a default names it where its own text does not (most
    had no text, so `--help` did not say what a bare run does: --input-len, --warmup, ...)."""

    def add_argument(self, action):
        default = action.default
        if (action.option_strings and action.help is not argparse.SUPPRESS and "default" not in (action.help or "")
                and default not in (None, argparse.SUPPRESS, [], ()) and not isinstance(default, bool)):
            action = copy.copy(action)
            action.help = f"{action.help} (default %(default)s)" if action.help else "default %(default)s"
        super().add_argument(action)


_ENGINE_FLAGS = ("device", "dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks",
                 "gpu_memory_utilization", "attention_backend")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig fields given on the command line; the rest keep EngineConfig's defaults."""
    given = {k: getattr(args, k) for k in _ENGINE_FLAGS if getattr(args, k, None) is not None}
    check_kv_sizing_flags(given.get("device", "auto"), given.get("num_kv_blocks"), given.get("gpu_memory_utilization"))
    return given


def max_model_len_of(args: argparse.Namespace, model: str) -> int:
    """The max_model_len an engine built from these flags and this checkpoint will have, known
    before building it (config.json alone)."""
    from pcg_engine.models.model_config import read_config
    return EngineConfig(**engine_kwargs(args)).resolved_max_model_len(read_config(model).max_position_embeddings)


def request_token_limit(args: argparse.Namespace, model: str) -> tuple[int, str, str]:
    """The most tokens (prompt + output) one request can hold in an engine built from these flags,
    known before building it: (tokens, what sets them, the flag that raises them). max_model_len,
    or with --num-kv-blocks the KV cache when it holds fewer (block 0 is the scratch block): the
    engine refuses a request that could never fit in it, each one failing alone."""
    limit = max_model_len_of(args, model)
    blocks = getattr(args, "num_kv_blocks", None)
    if blocks is not None:
        held = (blocks - 1) * EngineConfig(**engine_kwargs(args)).block_size
        if held < limit:
            return held, f"the {held} tokens of the KV cache (--num-kv-blocks {blocks})", "--num-kv-blocks"
    return limit, f"max_model_len {limit}", "--max-model-len"


def refuse_too_long(args: argparse.Namespace, model: str, prompt_len: int, output_len: int, flags: str) -> None:
    """Stop before any engine is built when the longest request the flags ask for cannot fit: the
    engine would refuse each request under prompt_token_ids / max_tokens, naming no flag."""
    limit, what, flag = request_token_limit(args, model)
    if prompt_len + output_len > limit:
        raise SystemExit(f"{flags}: the longest request is {prompt_len} prompt + {output_len} output tokens, "
                         f"more than {what}; lower them or raise {flag}")


def only_with(args: argparse.Namespace, switch: str, defaults: dict) -> None:
    """Flags that one run of a benchmark alone reads (parsed with default None), refused when given
    without the switch that asks for that run, naming both; then set to their defaults. Such flags
    were ignored without a word (overhead's --batch-sizes without --host-only, load-test's
    --sweep-start without --sweep-rates, startup's --warm-repeats without --warm-ab)."""
    _refuse_given(args, defaults, not _switch_on(args, switch),
                  "{flag}: only with " + switch + ", the run that reads it; give " + switch + " or leave {flag} out")


def not_with(args: argparse.Namespace, switch: str, defaults: dict) -> None:
    """The other side of only_with: flags that the run without the switch alone reads (parsed with
    default None), refused when given with the switch, naming both; then set to their defaults.
    (`overhead --host-only --slots 8 --configs bogus` ran the host-only run, ignored both and
    recorded them in its JSON as if they had been used.)"""
    _refuse_given(args, defaults, _switch_on(args, switch),
                  "{flag}: not with " + switch + ", which does not read it; leave {flag} out or drop " + switch)


def _switch_on(args: argparse.Namespace, switch: str) -> bool:
    return bool(getattr(args, switch.lstrip("-").replace("-", "_")))


def _refuse_given(args: argparse.Namespace, defaults: dict, refuse: bool, message: str) -> None:
    """only_with / not_with: the first flag of defaults given, refused where `refuse` (message names
    it as {flag}); then every flag left None set to its default."""
    given = [name for name in defaults if getattr(args, name) is not None]
    if given and refuse:
        raise SystemExit(message.format(flag="--" + given[0].replace("_", "-")))
    for name, default in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def refuse_max_num_seqs(args: argparse.Namespace, instead: str) -> None:
    """Benchmarks whose own flag sets max_num_seqs (overhead's --slots, profile's --requests) replaced
    a given --max-num-seqs without a word."""
    if args.max_num_seqs is not None:
        raise SystemExit(f"--max-num-seqs: this benchmark sets max_num_seqs from {instead}; give {instead} "
                         f"instead (got --max-num-seqs {args.max_num_seqs})")


def parse_modes(spec: str) -> list[tuple[str, dict]]:
    """'eager,piecewise+async,full_and_piecewise+sync+unfused' -> [(name, EngineConfig overrides)].

    A mode is an EngineConfig mode (or auto); '+async' / '+sync' pin async scheduling (else the
    device default), '+unfused' loads without fusion or Triton kernels (the chapter's eager config)."""
    out = []
    for name in [s.strip() for s in spec.split(",") if s.strip()]:
        if any(name == seen for seen, _ in out):
            # results are keyed by name: the second run replaced the first, which was run for nothing
            raise SystemExit(f"--modes: {name!r} is given twice; each mode runs once")
        mode, *flags = name.split("+")
        if mode not in MODES + ("auto",):
            raise SystemExit(f"--modes: {mode!r} is not a mode; allowed: {', '.join(MODES)}, auto")
        kw: dict = {"mode": mode}
        if len(set(flags)) < len(flags) or {"async", "sync"} <= set(flags):
            # the last of them won without a word (eager+sync+async ran async)
            raise SystemExit(f"--modes: {name!r} repeats a suffix or gives both +async and +sync; give each once")
        for f in flags:
            if f == "async":
                kw["async_scheduling"] = True
            elif f == "sync":
                kw["async_scheduling"] = False
            elif f == "unfused":
                kw.update(fuse=False, kernels=False)
            else:
                raise SystemExit(f"--modes: unknown suffix '+{f}' in {name!r}; allowed: +async, +sync, +unfused")
        out.append((name, kw))
    if not out:
        raise SystemExit("--modes: give at least one mode")
    return out


def check_modes(args: argparse.Namespace, modes: list[tuple[str, dict]]) -> None:
    """Refuse, before any engine is built, a mode of --modes that this device cannot build: the
    modes ran in turn, so 'eager,full_decode' on the CPU ran the whole eager benchmark, then lost
    its result to the second mode's ConfigError (named 'mode:', not --modes). The checks are
    ModelRunner's that need no weights: the fields, Triton on this device, a graph-safe
    attention backend for the full-graph modes."""
    from pcg_engine.cli import flag_wording
    from pcg_engine.errors import ConfigError
    for name, mode_kw in modes:
        try:
            cfg = EngineConfig(**engine_kwargs(args), **mode_kw)
            device_type = cfg.resolved_device().split(":")[0]
            cfg.check_triton_usable(device_type)
            cfg.check_mode_backend(device_type)
        except ConfigError as e:
            if e.field != "mode":
                raise               # a flag's own value: named by the caller as before
            raise SystemExit(f"--modes: {name!r}: {flag_wording(str(e).removeprefix('mode: '))}") from None


def build_llm(model_path: str, **config):
    from pcg_engine.llm import LLM
    return LLM(model_path, **config)


def add_process_per_mode_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--process-per-mode", choices=("auto", "on", "off"), default="auto",
                   help="run each mode of --modes in a fresh process (auto: on CUDA with several modes). "
                        "In one process a later engine's decode read slower than the same mode run first "
                        "(H200, Qwen3-8B batch 1: +0.07 to +0.14 ms a token; docs/PERF.md, session 19)")
    p.add_argument("--mode-result", default=None, help=argparse.SUPPRESS)   # a child's one result, as JSON


def _fresh_processes(args, n_modes: int) -> bool:
    if args.process_per_mode != "auto":
        return args.process_per_mode == "on"
    if n_modes < 2 or args.device.startswith("cpu"):
        return False
    import torch
    return torch.cuda.is_available()


def run_each_mode(args, model: str, run_mode, describe: str | None, bench: str | None = None,
                  argv: list[str] | None = None) -> dict | None:
    """Build an engine per mode of `--modes`, run `run_mode(llm, args, name)` on it (name: the
    --modes entry), free it; name -> result. `describe` is the spinner's text while it runs (None:
    run_mode shows its own progress, and rich allows one live display at a time).

    Modes run one after another, in this process or (--process-per-mode) each in a fresh one that
    runs `pcg bench <bench> argv --modes <that mode>` and hands its result back as JSON: then no
    engine runs after another in the same process. A child run (--mode-result) writes its one
    result to that file and returns None."""
    from rich.console import Console
    console = Console(stderr=True)
    modes = parse_modes(args.modes)
    check_modes(args, modes)
    if args.mode_result:
        (name, mode_kw), = modes
        result = _run_one_mode(args, model, run_mode, describe, name, mode_kw, console)
        Path(args.mode_result).write_text(json.dumps(result), encoding="utf-8")
        return None
    results = {}
    if _fresh_processes(args, len(modes)):
        import sys
        import tempfile
        if bench is None or argv is None:
            raise ValueError("run_each_mode: a process per mode needs the benchmark's name and its argv")
        with tempfile.TemporaryDirectory(prefix="pcg-modes-") as tmp:
            for i, (name, _) in enumerate(modes):
                out = Path(tmp) / f"mode{i}.json"
                console.print(f"[bold]mode {name}[/bold]: in a fresh process")
                # argparse keeps the last of a repeated flag: these override the user's
                # Through the CLI, as the user's own command: a refusal in the child is one "error:"
                # line and exit 2 (run as `python -m <module>`, it was a bare line or a traceback).
                cmd = [sys.executable, "-m", "pcg_engine.cli", "bench", bench, *argv, "--model", model,
                       "--modes", name, "--process-per-mode", "off", "--mode-result", str(out)]
                from pcg_engine import prompt_files   # what this process read of stdin ("-"), again
                rc = subprocess.run(cmd, input=prompt_files.stdin_bytes).returncode
                if rc != 0 or not out.exists():
                    raise SystemExit(f"mode {name}: its process exited with status {rc} and no result")
                results[name] = json.loads(out.read_text(encoding="utf-8"))
        return results
    for name, mode_kw in modes:
        results[name] = _run_one_mode(args, model, run_mode, describe, name, mode_kw, console)
    return results


def _run_one_mode(args, model: str, run_mode, describe: str, name: str, mode_kw: dict, console) -> dict:
    console.print(f"[bold]mode {name}[/bold]: building the engine")
    llm = build_llm(model, **engine_kwargs(args), **mode_kw)
    with console.status(f"{name}: {describe}") if describe is not None else contextlib.nullcontext():
        result = run_mode(llm, args, name)
    llm.close()   # its KV cache must not count against the next mode's
    del llm
    result["pid"] = os.getpid()   # which process ran it (--process-per-mode)
    return result


def write_mode_results(args, model: str, benchmark: str, results: dict) -> None:
    """The JSON of a --modes benchmark: environment, flags, the first mode's result at the top
    level, and every mode under "modes" when several ran."""
    payload = {"benchmark": benchmark, **env_record(model, args.device), "config": config_record(args),
               **next(iter(results.values()))}
    if len(results) > 1:
        payload["modes"] = results
    write_json(args.json, payload)


def engine_config(llm) -> dict:
    """The engine's resolved configuration, as run (mode and async scheduling after 'auto')."""
    import dataclasses
    cfg = dataclasses.asdict(llm.config)
    cfg.update(resolved_mode=llm.engine.runner.mode, resolved_async_scheduling=llm.engine.async_scheduling,
               resolved_device=str(llm.engine.device), resolved_dtype=str(llm.engine.runner.dtype).removeprefix("torch."))
    return cfg


def reset_stats(llm) -> None:
    llm.engine.stats = type(llm.engine.stats)()


# ---- environment -----------------------------------------------------------------------------------
def git_commit() -> str:
    """PCG_COMMIT from the environment (set it on copies: the GPU machine's copy may carry a stale
    .git), else HEAD's hash, or "unknown" (a copy without .git, or a repository without commits,
    where `git rev-parse HEAD` echoes "HEAD")."""
    if os.environ.get("PCG_COMMIT"):
        return os.environ["PCG_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and len(sha) == 40 and all(c in "0123456789abcdef" for c in sha) else "unknown"


def env_record(model: str | None, device: str = "auto") -> dict:
    """Where a figure came from: model (None for benchmarks of random tensors), commit, versions,
    card and date."""
    import torch
    commit = git_commit()
    try:
        from importlib.metadata import version
        triton = version("triton")
    except Exception:      # not installed (e.g. macOS), or metadata missing
        triton = None
    on_cuda = torch.cuda.is_available() and not str(device).startswith("cpu")
    name = torch.cuda.get_device_name() if on_cuda else f"CPU ({platform.processor() or platform.machine()})"
    return {"model": None if model is None else str(model), "commit": commit, "torch": torch.__version__, "triton": triton,
            "device": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


# ---- numbers -------------------------------------------------------------------------------------
def percentiles(values, scale: float = 1.0) -> dict:
    """{mean, median, p90, p99} of values * scale (linear interpolation); None each when empty (no
    sample: zeros read as a perfect result, e.g. the TPOT of 1-token outputs, the TTFT of a run
    where every request timed out)."""
    if len(values) == 0:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def length_bounds(length: int, ratio: float) -> tuple[int, int]:
    """Integer bounds of lengths uniform in [length * (1 - ratio), length * (1 + ratio)], at least 1."""
    if length < 1 or not 0 <= ratio < 1:
        raise SystemExit(f"length {length} / --range-ratio {ratio}: need length >= 1 and 0 <= ratio < 1")
    lo = max(1, int(round(length * (1 - ratio))))
    return lo, max(lo, int(round(length * (1 + ratio))))


def token_pool(llm) -> np.ndarray:
    """Ids a random prompt may use: inside both the tokenizer's and the model's vocabulary, no specials
    (a random <|im_end|> in a prompt would change what the prompt means to a real model)."""
    tok = llm.tokenizer
    n = min(len(tok), llm.engine.vocab_size)
    special = set(getattr(tok, "all_special_ids", []) or [])
    pool = np.array([i for i in range(n) if i not in special], dtype=np.int64)
    if len(pool) == 0:
        raise SystemExit("the tokenizer has no non-special ids to draw random prompts from")
    return pool


def random_prompts(rng: np.random.Generator, pool: np.ndarray, lengths, prefix_len: int = 0) -> list[list[int]]:
    prefix = rng.choice(pool, size=prefix_len).tolist() if prefix_len else []
    return [prefix + rng.choice(pool, size=int(n)).tolist() for n in lengths]


def bench_params(max_tokens: int, temperature: float = 0.0, detokenize: bool = False):
    """EOS ignored so every request produces exactly max_tokens; no detokenization by default (random
    ids need not decode to text, and the protocols time the engine, not the tokenizer)."""
    from pcg_engine.sampling_params import SamplingParams
    return SamplingParams(max_tokens=int(max_tokens), temperature=temperature, ignore_eos=True,
                          detokenize=detokenize)


def add_random_requests(llm, num: int, prompt_len: int, max_tokens: int, seed: int = 0):
    """`num` random prompts of prompt_len tokens added to llm's engine, each for exactly max_tokens
    tokens (bench_params); returns (request ids, prompts, params)."""
    rng = np.random.default_rng(seed)
    prompts = random_prompts(rng, token_pool(llm), [prompt_len] * num)
    params = bench_params(max_tokens)
    return [llm.engine.add_request(p, params) for p in prompts], prompts, params


def steps_before_decoding(n: int, prompt_len: int, max_num_batched_tokens: int) -> int:
    """At most how many steps n requests of prompt_len tokens take until all of them decode: each
    step's token budget, less a token for every request already decoding, goes to prefill. (Not
    counting the decodes undercounted it, and early requests finished inside a measure of "n
    running" at a small budget: 241.7 tokens a step in the row of 256; found by a review.)"""
    return -(-n * prompt_len // max(1, max_num_batched_tokens - n)) + 2


def refuse_unless_all_running(engine, ids, flags: str) -> None:
    """After a measure of len(ids) running requests: each must still be running (none finished,
    none preempted or waiting), or the figure is not of that many."""
    from pcg_engine.engine.request import RequestStatus
    running = sum(1 for rid in ids if getattr(engine.requests.get(rid), "status", None) is RequestStatus.RUNNING)
    if running < len(ids):
        raise SystemExit(f"{flags}: only {running} of the {len(ids)} requests were still running at the end of the "
                         "measured steps (the others finished, or waited for KV blocks), so the figure is not of "
                         f"{len(ids)} running; give the KV cache more blocks or ask for fewer requests or steps")


def step_until_decoding(engine, ids) -> None:
    """Step the engine until every request of `ids` has its first token, i.e. is decoding."""
    requests = [engine.requests[rid] for rid in ids]
    while any(r.first_token_time is None for r in requests):
        engine.step()


# ---- output --------------------------------------------------------------------------------------
def fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def print_table(title: str, headers: list[str], rows: list[list], console=None) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=title)
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*[fmt(v) for v in row])
    console = console or Console()
    if not console.is_terminal:      # logs and pipes: rich's 80 columns would squeeze the numbers
        console = Console(width=200, file=console.file)
    console.print(table)


def _refuse_a_file_on_the_way(value: str, paths) -> None:
    """The first of `paths` (a path and/or its parents, innermost first) that exists must be a
    directory, or nothing could be written at `value`."""
    blocker = next((q for q in paths if q.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r}: {blocker} is a file, not a directory")


def json_path(value: str) -> str:
    """argparse type of --json: refused before the benchmark runs (not after minutes of it) when it
    names a directory or sits under a file."""
    if not value:      # Path('') is '.', a directory: it said "'' is a directory"
        raise argparse.ArgumentTypeError("an empty path; give a file path")
    device_file = value.startswith("/dev/")     # /dev/stdout and the like: a link, written in place
    if os.path.islink(value) and not device_file:
        # write_json moves a new file over the path: a link was replaced by a plain file (a
        # dangling one left its target created empty), so the link's target is named instead.
        raise argparse.ArgumentTypeError(f"{value!r} is a symbolic link (to {os.readlink(value)!r}); give the file "
                                         "itself")
    if value == "-":   # (it wrote a file named '-'; standard output carries the tables)
        raise argparse.ArgumentTypeError("'-' is not standard output here (the tables are printed there); give "
                                         "a file path")
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r} is a directory; give a file path")
    if os.path.exists(value) and not os.path.isfile(value) and not device_file:
        # a FIFO's open waited for a reader during argument parsing
        raise argparse.ArgumentTypeError(f"{value!r} is not a regular file; give a file path")
    _refuse_a_file_on_the_way(value, path.parents)
    _refuse_unwritable(value, path)
    return value


def _refuse_unwritable(value: str, path: Path) -> None:
    """A file the benchmark could not write (a read-only or virtual directory: --json /proc/x.json)
    failed after the whole run, with a traceback. Where its directory exists, the file is opened for
    appending, as the write would open it, and removed again if this made it; where it does not, the
    nearest existing directory must be writable, for write_json to make the rest."""
    if path.parent.is_dir():
        if not value.startswith("/dev/") and not os.access(path.parent, os.W_OK | os.X_OK):
            # the results are written beside the target and moved over it: a writable file in a
            # read-only directory passed this check and lost the results after the whole run
            raise argparse.ArgumentTypeError(f"{value!r} cannot be written: its directory {path.parent} is not "
                                             "writable (the results are written beside the file, then moved over it)")
        existed = path.exists()
        try:
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as e:
            raise argparse.ArgumentTypeError(f"{value!r} cannot be written: {e.strerror or e}") from None
        if not existed:
            path.unlink(missing_ok=True)
        return
    nearest = next((q for q in path.parents if q.exists()), None)
    if nearest is not None and not os.access(nearest, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{value!r} cannot be written: {nearest} is not writable")


def directory_path(value: str) -> str:
    """argparse type of an output directory (--out-dir, --profile-dir): refused before the benchmark
    runs when it is a file or sits under one (a FileExistsError traceback from makedirs, before)."""
    path = Path(value)
    _refuse_a_file_on_the_way(value, (path, *path.parents))
    return value


def int_list_at_least(low: int, high: int | None = None):
    """An argparse type: comma-separated integers >= low (and <= high) ('16,64,256'), refused at
    parse time naming the bad item (a ValueError traceback from int(), or a size of 0 taken, before)."""
    item = int_at_least(low, high)
    allowed = f"integers >= {low}" if high is None else f"integers in {low}..{high}"

    def parse(text: str) -> list[int]:
        values = [s.strip() for s in text.split(",") if s.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"give comma-separated {allowed}, got {text!r}")
        parsed = [item(s) for s in values]
        repeated = next((v for i, v in enumerate(parsed) if v in parsed[:i]), None)
        if repeated is not None:   # (a size given twice was measured twice, its first figure dropped)
            raise argparse.ArgumentTypeError(f"{repeated} is given twice in {text!r}; give each once")
        return parsed
    parse.__name__ = f"comma-separated {allowed}"
    return parse


def write_json(path: str | None, payload: dict) -> None:
    if not path:
        return
    # Written beside the target and moved over it: a full disk left the previous results cut in
    # the middle (invalid JSON) after a traceback (found by a review). Now the old file stays whole.
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(payload, indent=2, default=str) + "\n"
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        if not target.exists() or target.is_file():
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, target)
        else:                                # /dev/stdout and the like: no file to replace
            with open(target, "w", encoding="utf-8") as f:
                f.write(text)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"--json: cannot write {path}: {e.strerror or e}; the results are lost "
                         "(the file as it was before is left)") from None


def config_record(args: argparse.Namespace) -> dict:
    """The full command-line configuration, JSON-safe (inf rates become the string 'inf')."""
    out = {}
    for k, v in vars(args).items():
        out[k] = "inf" if isinstance(v, float) and v == float("inf") else v
    return out


def graph_of_calls(fn, calls: int):
    """fn(0), ..., fn(calls - 1) captured in one CUDA graph, for the GPU micro-benchmarks
    (scripts/bench_kernels.py, bench/rope_attention.py): run once outside the capture (compiles, and
    the buffers a first call allocates), captured, then replayed three times to warm up."""
    import torch   # (not at module level: the CLI's start-up imports this module)

    def run():
        for i in range(calls):
            fn(i)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(3):
        graph.replay()
    return graph


def replay_us(graph, replays: int, warm: int = 20) -> float:
    """Mean GPU µs of one replay of a captured graph, over `replays` back to back after `warm` ones."""
    import torch
    for _ in range(warm):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / replays
