"""`pcg generate`'s sampling and engine flags, and a JSONL prompt line's own sampling fields: each
reaches the request or the engine it names, and a refused value is named by its flag or its line."""

import json

import pytest

from pcg_engine import cli
from pcg_engine.llm import LLM


def _run(capsys, tiny_paths, *flags) -> tuple[int, list[dict], str]:
    code = cli.main(["generate", "--model", str(tiny_paths["tiny-qwen3"]), "--device", "cpu", "--json", *flags])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines() if line.strip()], err


def test_line_sampling_fields_override_the_flags_for_their_prompt(tiny_paths, tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello there", "max_tokens": 3, "logprobs": 2}\n'
                    '{"prompt": "abc", "id": 5}\n'
                    '{"prompt": [5, 6, 7], "max_tokens": 4, "stop_token_ids": []}\n')
    code, outs, err = _run(capsys, tiny_paths, "--prompts-file", str(path), "--max-tokens", "6", "--ignore-eos")
    assert code == 0, err
    assert [len(o["token_ids"]) for o in outs] == [3, 6, 4]
    assert [len(lp["top"]) for lp in outs[0]["logprobs"]] == [2, 2, 2]
    assert [lp["token"] for lp in outs[0]["logprobs"]] == outs[0]["token_ids"]
    assert "logprobs" not in outs[1] and "logprobs" not in outs[2]


def test_line_fields_and_flags_make_the_same_parameters_and_tokens(tiny_paths, tmp_path, capsys, monkeypatch):
    """A line's temperature / seed / penalties reach its request as the same values given by flags
    do, and draw the same tokens."""
    fields = {"temperature": 0.8, "seed": 11, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.3,
              "presence_penalty": 0.5, "frequency_penalty": 0.2, "max_tokens": 5, "min_tokens": 5,
              "skip_special_tokens": False}
    seen = []
    real = LLM.generate

    def spy(self, prompts, sampling_params=None, on_output=None):
        seen.append(sampling_params)
        return real(self, prompts, sampling_params, on_output)

    monkeypatch.setattr(LLM, "generate", spy)
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "x"}\n' + json.dumps({"prompt": "the cat", **fields}) + "\n")
    code, by_line, err = _run(capsys, tiny_paths, "--prompts-file", str(path))
    assert code == 0, err
    flags = [x for k, v in fields.items() if k != "skip_special_tokens" for x in (f"--{k.replace('_', '-')}", str(v))]
    code, by_flag, err = _run(capsys, tiny_paths, "--prompt", "x", "--prompt", "the cat", *flags,
                              "--keep-special-tokens")
    assert code == 0, err
    line_params, flag_params = seen[0][1], seen[1]
    assert {k: getattr(line_params, k) for k in fields} == fields == {k: getattr(flag_params, k) for k in fields}
    assert seen[0][0].max_tokens == 32 and seen[0][0].temperature == 0.0        # the other line: the flags' defaults
    assert by_line[1]["token_ids"] == by_flag[1]["token_ids"] and len(by_flag[1]["token_ids"]) == 5


@pytest.mark.parametrize("line, flags, expected", [
    ('{"prompt": "b", "temperature": -1}', [],
     "--prompts-file: line 2: temperature: must be a finite number in [0, 1e6] (0 means greedy), got -1"),
    # the engine's refusal of the line's own max_tokens: not "--max-tokens", which the user did not give
    ('{"prompt": "b", "max_tokens": 100}', ["--max-model-len", "64"],
     "--prompts-file: line 2: max_tokens: prompt has 1 tokens and max_tokens is 100, beyond max_model_len 64"),
    ('{"prompt": "b", "stop_token_ids": [99999]}', ["--stream"],
     "--prompts-file: line 2: stop_token_ids: must be in [0, 1023] (the model's vocabulary), got 99999"),
    # checked against the model with the first prompt's request: named by the flag, at that prompt
    ('{"prompt": "b"}', ["--stop-token-id", "99999"],
     "--prompts-file: line 1: --stop-token-id (stop_token_ids): must be in [0, 1023] (the model's vocabulary)"),
    ('{"prompt": "b"}', ["--min-p", "2"], "--min-p (min_p): must be a finite number in [0, 1], got 2.0"),
    ('{"prompt": "b"}', ["--logprobs", "99"], "--logprobs (logprobs): must be an integer"),
    ('{"prompt": "b"}', ["--block-size", "3"], "--block-size (block_size): got 3; allowed: a power of two"),
    ('{"prompt": "b"}', ["--attention-backend", "x"], "--attention-backend (attention_backend): got 'x'; allowed"),
], ids=["line-temperature", "line-max-tokens", "line-stop-ids-stream", "flag-stop-id", "flag-min-p",
        "flag-logprobs", "flag-block-size", "flag-backend"])
def test_refusals_name_the_line_or_the_flag(tiny_paths, tmp_path, capsys, line, flags, expected):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n' + line + "\n")
    code, outs, err = _run(capsys, tiny_paths, "--prompts-file", str(path), *flags)
    assert code == 2 and not outs
    assert err.strip().splitlines()[-1].startswith(f"error: {expected}"), err


def test_engine_flags_reach_the_engine_config(tiny_paths, capsys, monkeypatch):
    seen = {}
    real = LLM.__init__

    def spy(self, model=None, progress=None, **kw):
        seen.update(kw)
        real(self, model, progress=progress, **kw)

    monkeypatch.setattr(LLM, "__init__", spy)
    code, outs, err = _run(capsys, tiny_paths, "--prompt", "hi", "--max-tokens", "2", "--block-size", "8",
                           "--max-num-batched-tokens", "64", "--no-prefix-caching", "--async-scheduling", "on",
                           "--no-compile-cache", "--attention-backend", "torch")
    assert code == 0, err
    assert {k: seen[k] for k in ("block_size", "max_num_batched_tokens", "enable_prefix_caching", "async_scheduling",
                                 "compile_cache", "attention_backend")} == {
        "block_size": 8, "max_num_batched_tokens": 64, "enable_prefix_caching": False, "async_scheduling": True,
        "compile_cache": False, "attention_backend": "torch"}
    seen.clear()
    code, outs, err = _run(capsys, tiny_paths, "--prompt", "hi", "--max-tokens", "2")
    assert code == 0, err
    # Unset: EngineConfig's own defaults, not the CLI's guesses of them.
    assert "block_size" not in seen and "max_num_batched_tokens" not in seen and seen["async_scheduling"] is None
    assert seen["enable_prefix_caching"] is True and seen["compile_cache"] is True


def test_help_gives_each_flags_default_and_range(capsys):
    """Found by fuzzing: --help gave no range for --block-size, --max-num-batched-tokens,
    --gpu-memory-utilization, --min-tokens, --stop-token-id, --seed or --truncate-prompt-tokens, no
    default for --attention-backend or --logprobs, nothing at all for --ignore-eos, and --num-kv-blocks
    said "blocks of 16 tokens" and "85% of the GPU's memory", which --block-size and
    --gpu-memory-utilization now change. Each is taken from SamplingParams / EngineConfig here."""
    import re
    from dataclasses import fields

    from pcg_engine.config import MAX_NUM_BATCHED_TOKENS, EngineConfig
    from pcg_engine.sampling_params import MAX_LOGPROBS

    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    # Each flag's entry starts a line of the help ("  --flag METAVAR  its help"), wrapped or not.
    entries = re.split(r"\n  (?=-)", capsys.readouterr().out.split("options:", 1)[1])
    helps = {e.split()[0].rstrip(","): re.sub(r"\s+", " ", e) for e in entries if e.strip()}
    default = {f.name: f.default for f in fields(EngineConfig)}
    expected = {
        "--max-num-batched-tokens": [f"1..{MAX_NUM_BATCHED_TOKENS}", f"default {default['max_num_batched_tokens']}"],
        "--block-size": ["a power of two from 1 to 128", f"default {default['block_size']}"],
        "--gpu-memory-utilization": ["in (0, 1]", f"default {default['gpu_memory_utilization']}", "CUDA"],
        "--attention-backend": ["auto, torch, triton", f"default {default['attention_backend']}"],
        "--num-kv-blocks": ["--block-size", "--gpu-memory-utilization", f"{default['cpu_kv_blocks']} on the CPU"],
        "--min-tokens": ["0..--max-tokens", "default 0"],
        "--stop-token-id": ["0..the vocabulary size - 1"],
        "--seed": ["in [-2**63, 2**64)", "default: none"],
        "--truncate-prompt-tokens": [">= 1"],
        "--logprobs": [f"0..{MAX_LOGPROBS}", "default: none"],
        "--ignore-eos": ["EOS"],
    }
    for flag, parts in expected.items():
        for part in parts:
            assert part in helps.get(flag, ""), (flag, part, helps.get(flag))
    assert "16 tokens" not in helps["--num-kv-blocks"] and "85%" not in helps["--num-kv-blocks"]


def test_json_logprobs_are_strict_json():
    """A -inf logprob (a masked logit) was written as -Infinity, which strict JSON parsers refuse."""
    entries = [{"token": 3, "logprob": float("-inf"), "top": [(5, -0.1), (3, float("-inf"))]},
               {"token": 4, "logprob": -1.5, "top": []}]
    text = json.dumps(cli._json_logprobs(entries), allow_nan=False)
    assert json.loads(text) == [{"token": 3, "logprob": -9999.0, "top": [[5, -0.1], [3, -9999.0]]},
                                {"token": 4, "logprob": -1.5, "top": []}]


@pytest.mark.parametrize("flags, expected", [
    (["--num-kv-blocks", "64", "--gpu-memory-utilization", "0.5"], "has no effect with --num-kv-blocks"),
    (["--device", "cpu", "--gpu-memory-utilization", "0.5"], "sizes the KV cache on CUDA only"),
], ids=["with-num-kv-blocks", "on-the-cpu"])
def test_gpu_memory_utilization_that_would_be_ignored_is_refused(tiny_paths, capsys, monkeypatch, flags, expected):
    """Known since session 22: --gpu-memory-utilization was ignored without a word beside
    --num-kv-blocks (which sets the cache's size) and on the CPU (whose cache has num_kv_blocks
    blocks). Refused before any engine is built, by generate and by the benchmarks."""
    def built(*a, **k):
        raise AssertionError("an engine was built")

    monkeypatch.setattr(LLM, "__init__", built)
    code, outs, err = _run(capsys, tiny_paths, "--prompt", "hi", "--max-tokens", "2", *flags)
    assert code == 2 and not outs
    assert err.strip().splitlines()[-1].startswith(f"error: --gpu-memory-utilization (gpu_memory_utilization): {expected}"), err
    code = cli.main(["bench", "overhead", "--host-only", "--model", str(tiny_paths["tiny-qwen3"]), "--batch-sizes", "16",
                     *flags] + ([] if "--device" in flags else ["--device", "cpu"]))
    bench_err = capsys.readouterr().err
    assert code == 2 and f"error: --gpu-memory-utilization (gpu_memory_utilization): {expected}" in bench_err, bench_err


@pytest.mark.parametrize("prompt, loaded", [
    ('{"prompt": "hello"}', True),
    ('{"prompt": [5, 6, 7]}', True),           # its outputs are detokenized
    ('{"prompt": [5, 6, 7], "detokenize": false}', False),
])
def test_the_tokenizer_loads_before_generation_is_timed(tiny_paths, tmp_path, capsys, monkeypatch, prompt, loaded):
    """Found by probing (session 26): the summary's rates and TTFT included loading the tokenizer on
    first use (0.67 s for 4 tokens that took 0.011 s; "mean TTFT 680 ms" for a token-id prompt). It
    loads before the clock starts when the run uses it, and not at all when nothing does."""
    seen = []
    real = LLM.generate

    def spy(self, prompts, sampling_params=None, on_output=None):
        seen.append(self.engine.lazy_tokenizer.loaded)
        return real(self, prompts, sampling_params, on_output)
    monkeypatch.setattr(LLM, "generate", spy)
    path = tmp_path / "p.jsonl"
    path.write_text(prompt + "\n")
    code, outs, err = _run(capsys, tiny_paths, "--prompts-file", str(path), "--max-tokens", "2")
    assert code == 0, err
    assert seen == [loaded] and len(outs) == 1
