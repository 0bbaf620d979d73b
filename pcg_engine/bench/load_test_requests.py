"""The load test's requests: --dataset JSONL or random prompts, checked against the model before
any engine is built.

Building an engine takes a minute on a GPU, and a request the engine refuses only fails in the
results JSON, so everything that decides whether the run's requests can be served is settled
first: the dataset's lines (JSON, fields), its size against --num-prompts / --sweep-num-prompts
(it is not repeated), each token against the vocabulary and each request's length against
max_model_len (or the KV cache of --num-kv-blocks, when smaller), from config.json and the
tokenizer alone. Random prompts are checked by the longest request their flags allow.
"""

from __future__ import annotations

import numpy as np

from pcg_engine.bench import common
from pcg_engine.prompt_files import misspelt_field, parse_json, read_lines, sampling_field

DEFAULT_NUM_PROMPTS = 500      # random prompts; a dataset's default is all of its lines
DEFAULT_WARMUP = 2             # warm-up requests; a dataset's default is at most its lines


DATASET_KEYS = ("prompt", "output_len")
# Other tools' names for a dataset line's output length.
OUTPUT_LEN_SPELLINGS = {"output_length", "output_tokens", "num_output_tokens", "max_output_len", "max_output_tokens",
                        "output_len_tokens", "max_new_tokens", "max_completion_tokens"}


def read_dataset(path: str) -> list[tuple[int, str | list[int], int | None]]:
    """--dataset JSONL as (line number, prompt, output_len or None), checked line by line before
    any engine is built: a file that cannot be read, a line that is not JSON or lacks a usable
    "prompt" (a non-empty string or list of token ids), an "output_len" that is not an integer >= 1,
    or no request at all stops the command with the line's number."""
    entries = []
    for number, line in read_lines(path, "--dataset"):
        obj = parse_json(line, number, "--dataset")
        prompt = obj.get("prompt") if isinstance(obj, dict) else None
        ids_ok = isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ids_ok:
            raise SystemExit(f"--dataset: line {number}: needs a \"prompt\": a non-empty string or list of "
                             f"token ids (integers >= 0)")
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:    # a "\ud800" escape: the tokenizer's TypeError traceback
                raise SystemExit(f"--dataset: line {number}: \"prompt\" is not valid Unicode text: {e.reason} at "
                                 f"character {e.start}") from None
        # A sampling parameter on the line ("max_tokens": 50, where output_len was meant) was dropped
        # without a word: the request ran with the default output length.
        own = sampling_field(obj)
        if own is not None:
            raise SystemExit(f"--dataset: line {number}: {own!r} is not read from a dataset line; a line gives "
                             f"\"prompt\" and \"output_len\" (the output length in tokens)")
        # Another spelling of the output length ("max_new_tokens", "output_length", "Output_len") was
        # ignored like any unknown key: the request ran at --output-len.
        for key in obj:
            if key not in DATASET_KEYS and (key.lower().replace("-", "_") in OUTPUT_LEN_SPELLINGS
                                            or misspelt_field(key, DATASET_KEYS)):
                raise SystemExit(f"--dataset: line {number}: {key!r} is not read from a dataset line; a line gives "
                                 f"\"prompt\" and \"output_len\" (the output length in tokens)")
        out = obj.get("output_len")
        if out is not None and (not isinstance(out, int) or isinstance(out, bool) or out < 1):
            raise SystemExit(f"--dataset: line {number}: \"output_len\" must be an integer >= 1, got {out!r}")
        entries.append((number, prompt, out))
    if not entries:
        raise SystemExit(f"--dataset: {path} holds no request")
    return entries


def resolve_num_prompts(args, entries) -> None:
    """--num-prompts' default (every line of --dataset, else DEFAULT_NUM_PROMPTS), and a refusal
    when --num-prompts, --warmup or --sweep-num-prompts asks for more requests than the dataset holds (it
    was used as it was: a shorter run than asked, with nothing said)."""
    if args.num_prompts is None:
        args.num_prompts = len(entries) if entries else DEFAULT_NUM_PROMPTS
    warmup_given = args.warmup is not None
    if not warmup_given:
        args.warmup = min(DEFAULT_WARMUP, len(entries)) if entries else DEFAULT_WARMUP
    if not entries:
        return
    if args.sweep_rates and len(entries) < 2:   # (it was told to lower --sweep-num-prompts to 1, then refused)
        raise SystemExit(f"--sweep-rates needs a --dataset of at least 2 requests (a trial of one sends it at once, "
                         f"whatever the rate); {args.dataset} holds {len(entries)}")
    asked = [("--num-prompts", args.num_prompts)]
    if warmup_given:       # (a --warmup past the dataset's size was cut to fit, with nothing said)
        asked.append(("--warmup", args.warmup))
    if args.sweep_rates:
        asked.append(("--sweep-num-prompts", args.sweep_num_prompts))
    for flag, count in asked:
        if count > len(entries):
            raise SystemExit(f"{flag} {count} asks for more requests than --dataset {args.dataset} holds "
                             f"({len(entries)}); the dataset is not repeated: lower {flag} to at most {len(entries)}")


def prepare(args, model: str, entries) -> list[tuple[list[int], int]] | None:
    """Check every request the run can send against the model (config.json, the tokenizer), before
    an engine is built. Returns the dataset's requests as (prompt ids, output length), tokenized
    here once for every mode; None for random prompts (drawn per engine: they need its tokenizer)."""
    from pcg_engine.models.model_config import read_config

    config = read_config(model)
    limit, what, flag = common.request_token_limit(args, model)
    if not entries:
        from pcg_engine.engine.tokenizer import LazyTokenizer
        tokens = LazyTokenizer(model)
        if not tokens.available:    # (found by token_pool only once the engine was built)
            raise SystemExit(f"random prompts are drawn from the tokenizer's ids, but {tokens.missing()}; give "
                             "--dataset with token-id prompts")
        _, hi = common.length_bounds(args.input_len, args.range_ratio)
        _, ohi = common.length_bounds(args.output_len, args.range_ratio)
        prompt = args.shared_prefix_len + hi
        if prompt + ohi > limit:
            raise SystemExit(f"the longest request the flags allow, {prompt} prompt + {ohi} output tokens "
                             f"(--shared-prefix-len {args.shared_prefix_len}, --input-len {args.input_len}, "
                             f"--output-len {args.output_len}, --range-ratio {args.range_ratio:g}), exceeds "
                             f"{what}; lower them or raise {flag}")
        return None
    used = max(args.num_prompts, args.warmup, args.sweep_num_prompts if args.sweep_rates else 0)
    entries = entries[:used]
    tokenizer = None
    if any(isinstance(prompt, str) for _, prompt, _ in entries):
        from pcg_engine.engine.tokenizer import LazyTokenizer
        tokenizer = LazyTokenizer(model).get()      # a checkpoint without one: named, as the engine would
    items = []
    for number, prompt, out in entries:
        if isinstance(prompt, str):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = prompt
            bad = next(((i, t) for i, t in enumerate(ids) if t >= config.vocab_size), None)
            if bad is not None:
                raise SystemExit(f"--dataset: line {number}: token {bad[1]} at position {bad[0]} is outside the "
                                 f"model's vocabulary; allowed: 0..{config.vocab_size - 1} (vocab_size in "
                                 f"{model}/config.json)")
        out = args.output_len if out is None else out
        if len(ids) + out > limit:
            raise SystemExit(f"--dataset: line {number}: a request of {len(ids)} prompt + {out} output tokens "
                             f"exceeds {what}; shorten it, lower its output_len (or --output-len) "
                             f"or raise {flag}")
        items.append((list(ids), out))
    return items


def build_dataset(args, llm, num: int, seed: int, prepared=None) -> list[tuple[list[int], int]]:
    """[(prompt ids, output length)]: the first `num` of the prepared --dataset, or random ids (same
    seed, same prompts; random warm-up and sweep trials draw with other seeds). Either way each
    measured run starts from a cold prefix cache (load_test.run_once), so a prompt sent again, as
    the dataset's first lines are, is computed again."""
    if prepared is not None:
        return prepared[:num]
    rng = np.random.default_rng(seed)
    lo, hi = common.length_bounds(args.input_len, args.range_ratio)
    olo, ohi = common.length_bounds(args.output_len, args.range_ratio)
    in_lens = rng.integers(lo, hi + 1, size=num)
    out_lens = rng.integers(olo, ohi + 1, size=num)
    prompts = common.random_prompts(rng, common.token_pool(llm), in_lens, args.shared_prefix_len)
    return list(zip(prompts, out_lens.tolist()))
