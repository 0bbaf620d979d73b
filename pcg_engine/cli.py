"""The `pcg` command: generate, make-model, bench.

    pcg generate --prompt "Hello"                  # bundled tiny model, built on first use
    pcg generate --model DIR --prompt hi --stream
    pcg make-model --preset qwen3-0.6b --out DIR
    pcg bench {latency,throughput,load-test,overhead,profile,kernels,load,startup} ...
"""

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
import warnings


# generate's EngineConfig fields passed on only when given (the SamplingParams fields are its flags
# of the same name: cmd_generate takes every one there is).
FLAG_NAMES = {"stop_token_ids": "--stop-token-id"}     # fields whose flag is not --field-name
WARNING_FLAGS = {"compile_cache": "--no-compile-cache"}     # a setting a warning names, by its flag
ENGINE_FLAGS = ("max_num_batched_tokens", "block_size", "gpu_memory_utilization", "attention_backend",
                "compile_cache_dir")


def _add_generate(sub):
    from pcg_engine.config import FLAG_HELP, num_kv_blocks_help
    p = sub.add_parser("generate", help="generate text from prompts")
    p.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: bundled tiny model)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", default=None,
                   help="one prompt per line, or JSONL with a 'prompt' field (text or token ids; or "
                        "'prompt_token_ids') and, optionally, sampling fields of that prompt's own (\"max_tokens\", "
                        "\"temperature\", ...: any SamplingParams field; the flags give the rest, and a null their "
                        "value); - reads stdin")
    p.add_argument("--chat", action="store_true", help="wrap each prompt with the tokenizer's chat template "
                   "(--json then gives the template's output as chat_prompt beside the prompt)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens a prompt, at most (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="in [0, 1e6]; default 0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="in (0, 1] (default 1: off)")
    p.add_argument("--top-k", type=int, default=-1, help="-1 or 0 (off; -1 the default) or >= 1")
    p.add_argument("--seed", type=int, default=None, help="sampling seed, in [-2**63, 2**64) (default: none)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS tokens")
    p.add_argument("--truncate-prompt-tokens", type=int, default=None, metavar="N",
                   help="N >= 1: keep only the last N tokens of a longer prompt (one past the context is refused "
                        "otherwise; default: none)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when the output contains TEXT (repeatable; TEXT is left out of the output)")
    p.add_argument("--min-p", type=float, default=0.0, help="in [0, 1] (default 0: off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="in [0.01, 100] (default 1: off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2] (default 0: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2] (default 0: off)")
    p.add_argument("--min-tokens", type=int, default=0,
                   help="0..--max-tokens: no EOS, stop token or stop text before this many tokens (default 0)")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="0..20: each output token's logprob and the N most likely tokens' (in --json's output; "
                        "default: none)")
    p.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append", default=None, metavar="ID",
                   help="stop at this token id, 0..the vocabulary size - 1 (repeatable; kept in token_ids, left out "
                        "of the text)")
    p.add_argument("--keep-special-tokens", dest="skip_special_tokens", action="store_false",
                   help="write special tokens (<|im_end|>, ...) into the output text")
    p.add_argument("--stream", action="store_true",
                   help="print text as it is produced, the prompts one after another; with --json, a line "
                        '{"index": I, "delta": TEXT, "token_ids": [...]} per step that made tokens, then the '
                        "prompt's object")
    p.add_argument("--json", action="store_true", help="machine-readable output, one JSON object per prompt")
    p.add_argument("--mode", default="auto", help="eager, compile, full_decode, piecewise, full_and_piecewise, auto "
                   "(the default: full_and_piecewise on CUDA, eager on the CPU)")
    p.add_argument("--device", default="auto", help="auto (the default: cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (the default: bfloat16 on CUDA, float32 on the CPU), bfloat16, float16, float32")
    p.add_argument("--max-model-len", type=int, default=None, help=FLAG_HELP["max_model_len"])
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests run at once, 1..4096 (default 64; the "
                   "Python API's default is 256)")
    # Engine settings left unset keep EngineConfig's defaults (config.py); their ranges are its checks'.
    p.add_argument("--num-kv-blocks", type=int, default=None, help=num_kv_blocks_help())
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help=FLAG_HELP["max_num_batched_tokens"])
    p.add_argument("--block-size", type=int, default=None, help=FLAG_HELP["block_size"])
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help=FLAG_HELP["gpu_memory_utilization"])
    p.add_argument("--attention-backend", default=None, help=FLAG_HELP["attention_backend"])
    p.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                   help="overlap a step's planning with the previous step's GPU work (auto: on for CUDA)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse the KV blocks of a prompt prefix computed before")
    p.add_argument("--no-compile-cache", dest="compile_cache", action="store_false",
                   help="compiled modes: compile afresh, save nothing")
    p.add_argument("--compile-cache-dir", default=None, metavar="DIR",
                   help="where compiled modes keep their compiled code (default ~/.cache/pcg_engine/compile, "
                        "or $XDG_CACHE_HOME/pcg_engine/compile)")
    p.add_argument("--dump-graph", default=None, metavar="DIR",
                   help="compiled modes: write the traced graph, the split graph and each piece's code to DIR, "
                        "replacing an earlier dump's files there (this start traces afresh, under its own "
                        "compile-cache entry: the first such start compiles)")
    p.set_defaults(func=cmd_generate)


def _read_prompts(args, sources: list | None = None, overrides: list | None = None) -> list[str]:
    """The prompts of --prompt and --prompts-file; where each came from ("--prompt #2",
    "--prompts-file: line 7") is appended to `sources` when given, for the errors that name one,
    and each prompt's own sampling fields (a JSONL line's; None for the others) to `overrides`."""
    from pcg_engine.prompt_files import misspelt_field, other_engines_option, parse_json, read_lines
    from pcg_engine.sampling_params import SamplingParams
    names = SamplingParams.field_names()
    prompts = [_argv_text("--prompt", p) for p in args.prompt]
    for stop in getattr(args, "stop", None) or ():
        _argv_text("--stop", stop)
    if sources is not None:
        sources += ["--prompt" if len(prompts) == 1 else f"--prompt #{i + 1}" for i in range(len(prompts))]
    if overrides is not None:
        overrides += [None] * len(prompts)
    if args.prompts_file:
        for number, line in read_lines(args.prompts_file, "--prompts-file"):
            own = None
            if line.lstrip().startswith("{"):
                obj = parse_json(line, number, "--prompts-file")
                # "prompt_token_ids" (the engine's own name) for token ids: beside "prompt" it was
                # ignored as an unknown key, and the line ran its text alone.
                # (a null prompt key is an absent one, as a null sampling field is)
                obj = {k: v for k, v in obj.items() if not (k in ("prompt", "prompt_token_ids") and v is None)}
                for alias in ("token_ids", "input_ids", "prompt_ids"):    # other tools' names: ignored before
                    if alias in obj:
                        raise SystemExit(f"--prompts-file: line {number}: {alias!r} is not read from a prompt line; "
                                         "give token ids as 'prompt' or 'prompt_token_ids'")
                prompt_key = "prompt_token_ids" if "prompt_token_ids" in obj else "prompt"
                if prompt_key == "prompt_token_ids" and "prompt" in obj:
                    raise SystemExit(f"--prompts-file: line {number}: give either 'prompt' or 'prompt_token_ids', "
                                     "not both")
                if prompt_key not in obj:
                    raise SystemExit(f"--prompts-file: line {number}: JSONL line without a 'prompt' field (or "
                                     f"'prompt_token_ids'): {line[:80]}")
                # A load-test dataset's line ({"prompt": ..., "output_len": 5}): its output length is
                # not a sampling field, and running it with --max-tokens' value dropped it silently.
                if "output_len" in obj:
                    raise SystemExit(f"--prompts-file: line {number}: 'output_len' (a load-test dataset's output "
                                     "length) is not read from a prompt line; give the line \"max_tokens\" "
                                     "(or --max-tokens for all)")
                # The line's sampling fields override the flags for its prompt; other keys (a dataset's
                # "id") are ignored. Checked by SamplingParams when the prompt's parameters are made.
                # But a key that reads as a misspelt field ("temprature", "stop_token_id", "maxTokens")
                # was ignored as well: the prompt ran at the flags' value without a word. Refused.
                for key in obj:
                    unsupported = other_engines_option(key)
                    if unsupported is not None:
                        raise SystemExit(f"--prompts-file: line {number}: {unsupported}")
                    # Sampling fields nested in an object, as other APIs' request bodies hold them
                    # ({"sampling_params": {"max_tokens": 2}}): ignored with the object, before.
                    nested = [k for k in obj[key] if k in names] if isinstance(obj[key], dict) else []
                    if nested and key not in names:
                        raise SystemExit(f"--prompts-file: line {number}: {key!r} holds sampling fields "
                                         f"({', '.join(nested)}); give them at the top level of the line, beside "
                                         "'prompt'")
                    meant = misspelt_field(key, names) if key not in names else None
                    if meant is not None:
                        raise SystemExit(f"--prompts-file: line {number}: {key!r} is not a sampling field; did you "
                                         f"mean {meant!r}? (allowed: {', '.join(names)}; other keys are ignored)")
                # A null field is the flag's value, as an unset one is ("max_tokens": null was refused
                # as "got None"; a file that writes every key, null where unset, kept its --seed).
                own = {k: v for k, v in obj.items() if k in names and v is not None} or None
                prompt = obj[prompt_key]
                # Text, or token ids as a list: a bare number would join its neighbours into one
                # token-id prompt (generate() reads a list of ints as one prompt).
                ids = isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
                if not ids and (prompt_key == "prompt_token_ids" or not isinstance(prompt, str)):
                    allowed = "a non-empty list of token ids" if prompt_key == "prompt_token_ids" else \
                        "a string or a non-empty list of token ids"
                    raise SystemExit(f"--prompts-file: line {number}: {prompt_key!r} must be {allowed}, got "
                                     f"{json.dumps(prompt)[:80]}")
                prompts.append(prompt)
            else:
                prompts.append(line)
            if sources is not None:
                sources.append(f"--prompts-file: line {number}")
            if overrides is not None:
                overrides.append(own)
    if not prompts:
        if args.prompts_file:   # (it said "give --prompt or --prompts-file" to one who had given the file)
            raise SystemExit(f"--prompts-file: {args.prompts_file} holds no prompt (every line is blank); "
                             "give one prompt or JSON object per line")
        raise SystemExit("give --prompt (repeatable) or --prompts-file")
    return prompts


def _argv_text(flag: str, value: str) -> str:
    """A command-line argument that is not UTF-8 (Python keeps each undecodable byte as a lone
    surrogate): refused here, naming the flag. Later it failed in the tokenizer as "surrogates not
    allowed at character N", Python's wording, naming neither the flag nor the bytes."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SystemExit(f"{flag}: not UTF-8 text: an undecodable byte at character {e.start + 1} of "
                         f"{value.encode('utf-8', 'backslashreplace').decode('ascii', 'backslashreplace')[:80]}; "
                         "give the text in UTF-8") from None
    return value


class OutputFailed(Exception):
    """Writing the results to stdout failed (a full disk, an I/O error): not the input's fault, so
    not one of the refusals (exit 2); a traceback told the user nothing they could act on."""


def _emit(text: str, flush: bool = False) -> None:
    """Write results to stdout. A reader that went away (BrokenPipeError) stays main()'s quiet exit."""
    try:
        sys.stdout.write(text)
        if flush:
            sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise OutputFailed(e.strerror or str(e)) from None


def _name_the_flag(error: Exception, has_flag) -> str:
    """An engine error names the EngineConfig or SamplingParams field; on the command line the
    user typed a flag: "--max-tokens (max_tokens): ..." where has_flag(field) says there is one."""
    field = getattr(error, "field", None)
    text = str(error)
    if field and has_flag(field) and text.startswith(f"{field}: "):
        flag = FLAG_NAMES.get(field, f"--{field.replace('_', '-')}")
        return f"{flag} ({field}): {flag_wording(text[len(field) + 2:])}"
    return text


def flag_wording(message: str) -> str:
    """An engine message as a command-line user reads it (pcg generate, the benchmarks' --modes):
    "None" / "null" is the API's "leave it to the engine", for which a flag is left out, not typed;
    another field it suggests is named by its flag."""
    message = message.replace("allowed: None or ", "allowed: ").replace(" or null", "")
    message = message.replace("use stop_token_ids", f"use {FLAG_NAMES['stop_token_ids']}")
    message = message.replace("compile_cache=False", WARNING_FLAGS["compile_cache"])
    return re.sub(r"attention_backend='(\w+)'", r"--attention-backend \1", message)


def _params_per_prompt(base: dict, overrides: list) -> list:
    """Each prompt's SamplingParams: the flags' (`base`), with a JSONL line's own fields over them.
    A refused line field is named by the line (prompt_index), not by the flag of the same name."""
    from pcg_engine.errors import InvalidRequestError
    from pcg_engine.sampling_params import SamplingParams
    shared = SamplingParams(**base)        # the flags' values are checked (and named) even if every line overrides them
    out = []
    for i, own in enumerate(overrides):
        if not own:
            out.append(shared)
            continue
        try:
            out.append(SamplingParams(**{**base, **own}))
        except InvalidRequestError as e:
            e.prompt_index = i
            raise
    return out


def _check_prompts(llm, prompts: list, params: list) -> None:
    """--stream runs the prompts one after another: refuse a bad one before any runs, as
    LLM.generate does for the whole batch. Each request is added (the engine's own checks) and
    dropped at once, before any step: it holds no KV block and leaves no output behind."""
    from pcg_engine.errors import InvalidRequestError
    if len(prompts) < 2:
        return
    for i, prompt in enumerate(prompts):
        try:
            rid = llm.engine.add_request(prompt, params[i])
        except InvalidRequestError as e:
            error = InvalidRequestError(e.field, f"{e.message} (prompt {i} of {len(prompts)}; none of them was run)")
            error.prompt_index = i
            raise error from None
        llm._abandon([rid])


def _dump_graph(llm, directory: str, err) -> None:
    """--dump-graph: the compiled forward's graphs (compile/backend.py's dump_graph), or an error in
    a mode that compiles nothing."""
    from pcg_engine.errors import ConfigError
    runner = llm.engine.runner
    dump = getattr(runner.forward_fn, "dump_graph", None)
    if dump is None:
        raise ConfigError("mode", f"--dump-graph needs a compiled mode (compile, piecewise, full_and_piecewise); "
                                  f"this engine runs {runner.mode!r}")
    try:
        paths = dump(directory)
    except OSError as e:
        raise SystemExit(f"--dump-graph: cannot write to {directory}: {e.strerror or e}")
    err.print(f"graph: {len(paths)} files in {directory}", soft_wrap=True, markup=False)


def _resolved_mode_and_device(config: dict):
    """(mode, device type) that an engine of these settings runs, or (None, None) where the engine's
    own start will refuse them (naming the field)."""
    from pcg_engine.config import EngineConfig
    try:
        engine_config = EngineConfig.from_kwargs(**config)
        device = engine_config.resolved_device().split(":")[0]
    except Exception:
        return None, None
    return engine_config.resolved_mode(device), device


def _start_words(config: dict) -> str:
    """What the start does besides loading, for the spinner: it said "capturing graphs" in any mode
    but eager, also where none are captured (compile; --mode auto or piecewise on the CPU)."""
    from pcg_engine.config import CAPTURING_MODES, COMPILED_MODES
    mode, device = _resolved_mode_and_device(config)
    if mode is None:
        return ""
    graphs = device == "cuda" and mode in CAPTURING_MODES
    if mode in COMPILED_MODES:
        return " and compiling" + (" and capturing graphs" if graphs else "")
    return " and capturing graphs" if graphs else ""


def cmd_generate(args) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from pcg_engine.config import check_kv_sizing_flags
    from pcg_engine.errors import InvalidRequestError, PcgError
    from pcg_engine import chat
    from pcg_engine.llm import LLM
    from pcg_engine.sampling_params import SamplingParams

    err = Console(stderr=True)
    sources: list[str] = []
    overrides: list[dict | None] = []
    prompts = _read_prompts(args, sources, overrides)
    try:
        # Every SamplingParams field with a flag (dest) of its name: the flags' parameters.
        base = {name: getattr(args, name) for name in SamplingParams.field_names() if hasattr(args, name)}
        params = _params_per_prompt(base, overrides)
        config = dict(device=args.device, dtype=args.dtype, mode=args.mode, max_model_len=args.max_model_len,
                      max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks,
                      enable_prefix_caching=args.enable_prefix_caching, compile_cache=args.compile_cache,
                      async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling])
        config.update({name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None})
        check_kv_sizing_flags(args.device, args.num_kv_blocks, args.gpu_memory_utilization)
        if args.dump_graph is not None and not args.dump_graph.strip():
            raise SystemExit(f"--dump-graph: got {args.dump_graph!r}; allowed: a directory to write the graphs to")
        if args.dump_graph:
            # Refused before the model loads, naming how the mode came about: it said "--mode
            # (mode): ..." after loading the weights, also to one who had not given --mode.
            from pcg_engine.config import COMPILED_MODES
            mode = _resolved_mode_and_device(config)[0]
            if mode is not None and mode not in COMPILED_MODES:
                how = f"--mode {args.mode}" if args.mode != "auto" else f"--mode auto, which runs {mode!r} here,"
                raise SystemExit(f"--dump-graph: needs a compiled mode (--mode compile, piecewise or "
                                 f"full_and_piecewise); {how} compiles nothing")
            # A saved trace keeps Inductor's code, not the pieces' FX graphs: trace this start
            # (compile/saved_trace.py). The switch is part of the compile cache's key, so the first
            # start with it compiles its own entry.
            os.environ["PCG_SAVED_TRACE"] = "0"
        t0 = time.perf_counter()
        if args.model is not None and not args.model.strip():
            # (it read the working directory: "--model: config.json: missing")
            raise SystemExit(f"--model: got {args.model!r}; allowed: a checkpoint directory, or leave out --model "
                             "for the bundled tiny model")
        if args.model is not None and not os.path.isdir(args.model):
            # read_config's reason (no such directory, a file, a preset's name), with the flag: it
            # named the path alone.
            from pcg_engine.models.model_config import read_config
            try:
                read_config(args.model)
            except PcgError as e:
                raise SystemExit(f"--model: {e}") from None
        if args.dump_graph:
            # A directory it cannot write was found after loading and compiling (a minute on a GPU).
            # After --model's checks: a refused start left the directory it had made.
            if os.path.exists(args.dump_graph) and not os.path.isdir(args.dump_graph):
                raise SystemExit(f"--dump-graph: {args.dump_graph} is a file; give a directory")
            try:
                os.makedirs(args.dump_graph, exist_ok=True)
                tempfile.TemporaryFile(dir=args.dump_graph).close()
            except OSError as e:
                raise SystemExit(f"--dump-graph: cannot write to {args.dump_graph}: {e.strerror or e}") from None
        # Not on a stderr that is not a terminal (a log, a pipe): the spinner cannot redraw there,
        # and its stop wrote an empty line before the error or the summary.
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=err, transient=True, disable=args.json or not err.is_terminal) as progress:
            task = progress.add_task("loading model" + _start_words(config))
            llm = LLM(args.model, progress=progress, **config)
            progress.update(task, completed=1)
        load_s = time.perf_counter() - t0
        if args.dump_graph:
            _dump_graph(llm, args.dump_graph, err)
        given = prompts          # --chat: the prompts as typed, beside the template's text
        if args.chat:
            bad = next((i for i, p in enumerate(prompts) if not isinstance(p, str)), None)
            if bad is not None:
                # (it said "prompt 1", counting from 0, for the file's line 2)
                raise SystemExit(f"--chat: {sources[bad]}: the prompt is token ids; the chat template needs text "
                                 "prompts")
            problem = chat.missing_template(llm.engine)
            if problem is not None:
                # (without a tokenizer it said "give prompts as token ids", which --chat refuses)
                hint = ("leave out --chat and give the prompts as token ids" if not llm.engine.lazy_tokenizer.available
                        else "leave out --chat to send the prompts as they are")
                raise SystemExit(f"--chat: {problem}; {hint}")
            chats = []
            for source, p in zip(sources, prompts):
                try:
                    chats.append(chat.render(llm.engine, [{"role": "user", "content": p}]))
                except InvalidRequestError as e:
                    raise SystemExit(f"--chat: {source}: {e.message}; leave out --chat to send the prompts as "
                                     "they are") from None
            given, prompts = prompts, chats
        # The tokenizer loads on first use (~0.7 s on the dev VM): before the clock starts where this
        # run uses it (text prompts, outputs to detokenize), so the summary's rates and TTFT time
        # generation alone, whichever comes first to need it.
        tok = llm.engine.lazy_tokenizer
        if tok.available and (any(isinstance(p, str) for p in prompts) or any(p.detokenize for p in params)):
            tok.get()
        t1 = time.perf_counter()
        if args.stream:
            # Every prompt checked before any runs, as generate() does: a bad prompt after the
            # first ran the ones before it (under --json their outputs were never printed).
            _check_prompts(llm, prompts, params)
            outs = []
            line_open = False     # text written on a line not yet ended
            try:
                for i, prompt in enumerate(prompts):
                    final = None
                    try:
                        for delta in llm.stream(prompt, params[i]):
                            if args.json:    # a line per step that made tokens; the prompt's object follows
                                if delta.new_token_ids:
                                    _emit(json.dumps({"index": i, "delta": delta.new_text,
                                                      "token_ids": list(delta.new_token_ids)}) + "\n", flush=True)
                            elif delta.new_text:
                                _emit(delta.new_text, flush=True)
                                line_open = True
                            final = delta
                    except InvalidRequestError as e:
                        e.prompt_index = i      # add_request's refusal of this prompt
                        raise
                    if args.json:
                        _emit(_json_line(args, given[i], prompt, final), flush=True)
                    else:
                        _emit("\n")
                        line_open = False
                    outs.append(final)
            except KeyboardInterrupt:
                if line_open:   # "pcg: interrupted" and the shell's prompt start on a line of their own
                    _emit("\n", flush=True)
                raise
        else:
            outs = llm.generate(prompts, params[0] if all(p is params[0] for p in params) else params)
        gen_s = time.perf_counter() - t1
    except (PcgError, ValueError) as e:
        # A refused prompt among several, or from the file: where it came from, since "prompt 5"
        # or the field 'prompt' (the --prompt flag, before) does not say which line it is.
        index = getattr(e, "prompt_index", None)
        source = sources[index] if index is not None and (len(prompts) > 1 or args.prompts_file) else None
        # A field the prompt's own JSONL line set is the line's, not the flag's of the same name.
        own = (overrides[index] or {}) if index is not None and index < len(overrides) else {}
        text = _name_the_flag(e, lambda field: hasattr(args, field) and field not in own
                              and (source is None or field != "prompt"))
        # The API's names for what the command line spells otherwise: the prompt's tokens are the
        # prompt given (--prompt, a file's line), and the remedy is the flag.
        if text.startswith("prompt_token_ids: "):
            text = text[len("prompt_token_ids: "):]
            if source is None and len(prompts) == 1:
                source = sources[0]
        text = text.replace("set truncate_prompt_tokens", "set --truncate-prompt-tokens")
        if source is not None:
            # generate()'s "(prompt 0 of 2; ...)" counts from 0: beside "--prompt #1" or a file's
            # line it named the same prompt by a second, different number
            text = f"{source}: {text.replace(f'(prompt {index} of {len(prompts)}; ', '(')}"
        # escape: a message quoting a path or stop string with [brackets] is not rich markup;
        # soft_wrap: one line, whatever the terminal's width (logs get grepped)
        err.print(f"[red]error:[/red] {escape(text)}", soft_wrap=True)
        return 2
    if not args.stream:           # --stream wrote each prompt's output as it ended
        for i, (prompt, out) in enumerate(zip(prompts, outs)):
            _emit(_json_line(args, given[i], prompt, out) if args.json else out.text + "\n")
    _emit("", flush=True)   # a write that fails at exit's flush said "Exception ignored" and exit 120
    ntok = sum(len(o.token_ids) for o in outs)
    ttfts = [o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    err.print(f"[dim]{len(outs)} prompts, {ntok} tokens in {gen_s:.2f} s ({ntok / max(gen_s, 1e-9):.1f} tok/s), "
              f"mean TTFT {1000 * sum(ttfts) / max(len(ttfts), 1):.1f} ms, load {load_s:.1f} s, "
              f"mode {llm.engine.runner.mode}, device {llm.engine.device}[/dim]", soft_wrap=True)
    err.print(f"[dim]{_startup_line(llm.engine.runner.timings, llm.config.compile_cache)}[/dim]", soft_wrap=True)
    return 0


def _json_line(args, given, prompt, out) -> str:
    """--json's object for one prompt's output; --chat: the prompt as given, and what the template
    made of it beside it."""
    obj = {"prompt": given if args.chat else prompt, **({"chat_prompt": prompt} if args.chat else {}),
           "text": out.text, "token_ids": out.token_ids,
           "finish_reason": out.finish_reason,
           "ttft_s": out.metrics.ttft,
           "e2e_s": (out.metrics.finish_time or 0) - out.metrics.arrival_time}
    if out.logprobs is not None:       # --logprobs, or the line's "logprobs"
        obj["logprobs"] = _json_logprobs(out.logprobs)
    return json.dumps(obj) + "\n"


def _json_logprobs(entries: list) -> list:
    """Logprobs as strict JSON: a token the logits masked has logprob -inf, which json.dumps wrote as
    -Infinity (not JSON: strict parsers refused the line). It is written as -9999.0, as vLLM's
    server does."""
    def finite(x):
        return x if math.isfinite(x) else (-9999.0 if x < 0 else None)
    return [{**e, "logprob": finite(e["logprob"]), "top": [(t, finite(x)) for t, x in e.get("top", ())]}
            for e in entries]


def _startup_line(timings: dict, compile_cache: bool = True) -> str:
    """Where the load time went (ModelRunner.timings): weights, KV cache, and in the compiled modes
    Dynamo, Inductor (with the compile cache's verdict), capture and the graph pool."""
    parts = [f"weights {timings.get('weight_load_s', 0.0):.1f} s", f"KV cache {timings.get('kv_cache_s', 0.0):.1f} s"]
    if "dynamo_s" in timings:
        cache = " (compile cache off)" if not compile_cache else {
            1.0: " (compile cache hit)", 0.0: " (compiled; cached for the next start)"}.get(timings.get("compile_cache_hit"), "")
        if compile_cache and timings.get("compile_cache_rebuilt"):   # a bad entry: it read as a first start
            cache = " (compile cache entry was bad: rebuilt, cached for the next start)"
        if compile_cache and timings.get("compile_cache_unwritable"):   # compile/setup.py warned why
            cache = " (compile cache directory not writable: not cached)"
        parts += [f"Dynamo {timings['dynamo_s']:.1f} s", f"Inductor {timings.get('inductor_s', 0.0):.1f} s{cache}"]
    if timings.get("capture_s"):
        parts.append(f"capture {timings['capture_s']:.1f} s")
    if timings.get("graph_pool_mib"):
        parts.append(f"graph pool {timings['graph_pool_mib']:.0f} MiB")
    return "start-up: " + ", ".join(parts)


def _add_make_model(sub):
    from pcg_engine.models.checkpoint_maker import add_arguments, run
    p = sub.add_parser("make-model", help="write a Hugging Face checkpoint with random weights at a preset's shapes")
    add_arguments(p)
    p.set_defaults(func=lambda a: (run(a), 0)[1])   # run() prints the path


def _add_bench(sub):
    p = sub.add_parser("bench", help="benchmarks: latency, throughput, load-test, overhead, profile, kernels, load, startup")
    # Optional to argparse, so that `pcg bench` alone lists the benchmarks (it said "the following
    # arguments are required: name, rest", naming the parser's own variables).
    p.add_argument("name", nargs="?", metavar="BENCHMARK", help="which benchmark (`pcg bench NAME --help`)")
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="...", help="the benchmark's flags")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    import importlib
    table = {"latency": "pcg_engine.bench.latency", "throughput": "pcg_engine.bench.throughput",
             "load-test": "pcg_engine.bench.load_test", "overhead": "pcg_engine.bench.overhead",
             "profile": "pcg_engine.bench.profile", "kernels": "pcg_engine.bench.kernels",
             "load": "pcg_engine.bench.load", "startup": "pcg_engine.bench.startup"}
    if args.name is None:
        raise SystemExit(f"pcg bench: name a benchmark: {', '.join(table)} (`pcg bench NAME --help` for its flags)")
    if args.name not in table:
        raise SystemExit(f"pcg bench: unknown benchmark {args.name!r}; choose from {', '.join(table)}")
    from pcg_engine.errors import PcgError
    module = importlib.import_module(table[args.name])
    try:
        return module.main(args.rest) or 0
    except PcgError as e:       # a setting the engine refuses: one line naming it, as `generate` does
        def typed(field):       # the flag, where the user gave it (--flag value or --flag=value)
            flag = f"--{field.replace('_', '-')}"
            return any(a == flag or a.startswith(flag + "=") for a in args.rest)
        print(f"error: {_name_the_flag(e, typed)}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    # Text the terminal's encoding cannot hold (U+FFFD, which models emit often, on an ASCII or
    # Latin-1 stdout) is written escaped, as Python writes stderr: it raised UnicodeEncodeError, a
    # traceback, or under --stream an "error:" line as if the input had been refused.
    if getattr(sys.stdout, "errors", None) == "strict" and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        # Inside the try: building the sub-commands imports torch (a second or more), and a
        # Ctrl-C then gave a traceback.
        parser = argparse.ArgumentParser(prog="pcg", description="pcg-engine: fast LLM inference on one GPU")
        sub = parser.add_subparsers(dest="command", required=True)
        _add_generate(sub)
        _add_make_model(sub)
        _add_bench(sub)
        args = parser.parse_args(argv)
        with warnings.catch_warnings():
            warnings.showwarning = _warning_line(sys.argv[1:] if argv is None else argv, warnings.showwarning)
            return args.func(args)
    except KeyboardInterrupt:   # Ctrl-C: the shell's convention (128 + SIGINT), not a traceback
        print("pcg: interrupted", file=sys.stderr)
        return 130
    except OutputFailed as e:
        print(f"error: cannot write the results to stdout: {e}", file=sys.stderr)
        _quiet_stdout()
        return 1
    except BrokenPipeError:
        # The reader went away (`pcg generate --json | head -1`): nothing is left to say to it. Quiet,
        # as other Unix tools are, with the shell's code for SIGPIPE (128 + 13); stdout goes to
        # /dev/null so the interpreter's last flush at exit does not raise it again.
        _quiet_stdout()
        return 141
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise               # argparse's own exits (--help, a bad flag) keep their codes
        # A refusal raised as SystemExit("--flag: ..."): one line and exit 2, as argparse and the
        # engine's own errors give (Python would print it bare and exit 1).
        print(f"error: {e.code}", file=sys.stderr)
        return 2


def _warning_line(argv: list, plain):
    """warnings.showwarning for the engine's own warnings: one line "warning: ...", a setting named
    by the flag the user typed. Python wrote "/path/model_runner.py:94: UserWarning: EngineConfig:
    compile_cache=False has no effect ..." with a source line under it, naming API fields."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep

    def show(message, category, filename, lineno, file=None, line=None):
        if not (issubclass(category, UserWarning) and str(filename).startswith(package)):
            return plain(message, category, filename, lineno, file, line)   # torch's, a library's: as Python writes them
        text = str(message).removeprefix("EngineConfig: ")
        head = ""
        # "field=value has no effect ..." or "field: ...": the setting by the flag typed, if one was
        setting = re.match(r"(\w+)=(.*?)(?= has no effect)", text) or re.match(r"(\w+)(?=: )", text)
        if setting:
            field = setting.group(1)
            flag = WARNING_FLAGS.get(field) or FLAG_NAMES.get(field, f"--{field.replace('_', '-')}")
            if any(_spells(a, flag) for a in argv):
                head, text = f"{flag} ({setting.group(0)})", text[setting.end():]
        print(f"warning: {head}{flag_wording(text)}", file=sys.stderr if file is None else file)
    return show


def _spells(arg: str, flag: str) -> bool:
    """Whether a command-line argument gave this flag: whole, with "=value", or abbreviated as
    argparse takes it (--no-compile for --no-compile-cache)."""
    typed = arg.split("=", 1)[0]
    return typed.startswith("--") and len(typed) > 2 and flag.startswith(typed)


def _quiet_stdout() -> None:
    """stdout to /dev/null, so the interpreter's last flush at exit does not fail a second time."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):   # a stdout without a descriptor (a test's capture): nothing to flush
        pass


if __name__ == "__main__":
    sys.exit(main())
