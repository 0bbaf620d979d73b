"""The user-facing benchmarks run end to end on the tiny model (CPU) and write consistent JSON.

No speed is asserted (BENCHMARKS.md): only that every request completes, token counts are what was
asked, latencies are ordered (TTFT <= E2EL), and the arrival process has the rate and burstiness
asked for. Sizes are tiny so the whole file stays well under two minutes on a CPU.
"""

import json
import math
import os
import runpy
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pcg_engine.bench import common, kernels, load_test, overhead, profile, latency, throughput
from pcg_engine.bench.engine_thread import RequestRecord
from pcg_engine.bench.load_metrics import parse_slos, summarize

REPO = Path(__file__).resolve().parents[2]
ENV_KEYS = {"model", "commit", "torch", "triton", "device", "date", "config"}
SEED_KEYS = {"config", "tok_s", "steps", "host_ms_per_step", "same_tokens"}


def read(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ---- pure pieces ---------------------------------------------------------------------------------
@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrivals_have_the_rate_and_burstiness_asked_for(burstiness):
    rate, n = 8.0, 40_000
    offsets = load_test.arrival_offsets(n, rate, burstiness, np.random.default_rng(0))
    assert offsets[0] == 0 and np.all(np.diff(offsets) >= 0)
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


@pytest.mark.parametrize("rate, burstiness", [(1.0, 1e-320), (1e-320, 1.0), (1e-200, 1e-200)])
def test_arrivals_refuse_gaps_without_a_finite_scale(rate, burstiness):
    """Found by probing: burstiness 1e-320 drew NaN gaps (the client sent every request at once),
    rate 1e-320 inf ones, and 1e-200 x 1e-200 a ZeroDivisionError."""
    with pytest.raises(SystemExit, match="finite gap scale"):
        load_test.arrival_offsets(4, rate, burstiness, np.random.default_rng(0))
    assert np.isfinite(load_test.arrival_offsets(4, 1e300, 1e-300, np.random.default_rng(0))).all()


def test_infinite_rate_submits_everything_at_once():
    assert not load_test.arrival_offsets(5, float("inf"), 1.0, np.random.default_rng(0)).any()


def test_percentiles_and_length_bounds():
    p = common.percentiles(list(range(1, 101)))
    assert p["mean"] == pytest.approx(50.5) and p["median"] == pytest.approx(50.5)
    assert p["p90"] == pytest.approx(90.1) and p["p99"] == pytest.approx(99.01)
    # no sample is no figure (zeros read as a perfect result: the TPOT of 1-token outputs)
    assert common.percentiles([]) == {"mean": None, "median": None, "p90": None, "p99": None}
    assert common.length_bounds(100, 0.5) == (50, 150)
    assert common.length_bounds(10, 0.0) == (10, 10)


def test_metrics_and_goodput_from_token_times():
    def rec(i, submit, times):
        r = RequestRecord(f"r{i}", 4, len(times), submit_time=submit, token_times=times, num_output_tokens=len(times),
                          finished=True, finish_reason="length")
        return r
    records = [rec(0, 0.0, [0.1, 0.2, 0.3]),        # ttft 100, tpot 100
               rec(1, 0.0, [0.5, 0.51]),            # ttft 500: breaks the TTFT SLO
               rec(2, 1.0, [1.05])]                 # one token: no TPOT, meets both
    res = summarize(records, 0.0, 2.0, parse_slos(["ttft:200", "tpot:150"]))
    assert res["completed"] == 3 and res["failed"] == 0 and res["total_output_tokens"] == 6
    assert res["ttft_ms"]["median"] == pytest.approx(100)
    assert res["tpot_ms"]["mean"] == pytest.approx((100 + 10) / 2)
    assert res["itl_ms"]["mean"] == pytest.approx((100 + 100 + 10) / 3)
    assert res["goodput"] == pytest.approx(2 / 2.0) and res["slo_attainment"] == pytest.approx(2 / 3)
    with pytest.raises(SystemExit):
        parse_slos(["latency:5"])


def test_metrics_count_a_request_without_tokens_and_an_aborted_one_as_failed():
    """A finished request with no token (no TTFT) and an aborted one with tokens are failed: no
    latency, token or goodput figure counts them, and each row says why (the empty one's row read
    "ok": true, "error": null while the run counted it failed)."""
    def rec(i, times, error=None):
        return RequestRecord(f"r{i}", 3, 4, submit_time=0.0, token_times=times, num_output_tokens=len(times),
                             finished=True, finish_reason="abort" if error else "length", error=error)
    records = [rec(0, [0.2, 0.3, 0.5]), rec(1, []), rec(2, [0.1, 0.15], error="abort")]
    res = summarize(records, 0.0, 1.0, parse_slos(["ttft:1000"]))
    assert res["completed"] == 1 and res["failed"] == 2 and res["total_output_tokens"] == 3
    assert res["total_input_tokens"] == 3 and res["request_throughput"] == pytest.approx(1.0)
    assert res["ttft_ms"]["p99"] == pytest.approx(200) and res["itl_ms"]["mean"] == pytest.approx(150)
    assert res["tpot_ms"]["median"] == pytest.approx(150) and res["e2el_ms"]["mean"] == pytest.approx(500)
    assert res["goodput"] == pytest.approx(1.0) and res["slo_attainment"] == pytest.approx(1 / 3)
    rows = res["requests"]
    assert [r["ok"] for r in rows] == [True, False, False]
    assert [r["error"] for r in rows] == [None, "finished without an output token", "abort"]
    assert sum(not r["ok"] for r in rows) == res["failed"]


@pytest.mark.parametrize("module, flags, instead", [
    (overhead, [], "--slots"), (overhead, ["--host-only"], "--batch-sizes"), (profile, [], "--requests")])
def test_max_num_seqs_set_by_another_flag_is_refused(module, flags, instead, monkeypatch):
    """Found by probing: overhead and profile replaced a given --max-num-seqs with their own flag's
    value without a word."""
    monkeypatch.setattr(common, "build_llm", lambda *a, **k: pytest.fail("an engine was built"))
    with pytest.raises(SystemExit, match=f"--max-num-seqs: this benchmark sets max_num_seqs from {instead}; "
                                         f"give {instead} instead \\(got --max-num-seqs 8\\)"):
        module.main(["--device", "cpu", "--max-num-seqs", "8", *flags])


def test_input_len_defaults_without_a_dataset():
    args = load_test.make_parser().parse_args([])
    load_test.check_args(args)
    assert args.input_len == load_test.DEFAULT_INPUT_LEN


@pytest.mark.parametrize("limit, lower_bound", [(13.0, False), (1e9, True)])
def test_sweep_that_never_fails_reports_a_lower_bound(monkeypatch, limit, lower_bound):
    """Found by probing: a sweep whose every trial met the SLOs reported its last rate (3200) as the
    highest the engine holds."""
    def fake_run(llm, dataset, args, rate, slos, label, progress):
        return {"slo_attainment": 1.0 if rate <= limit else 0.0, "goodput": rate, "failed": 0,
                "ttft_ms": {"p90": 1.0}, "tpot_ms": {"p90": 1.0}, "duration_s": 1.0, "cached_prompt_tokens": 0}
    monkeypatch.setattr(load_test, "run_once", fake_run)
    monkeypatch.setattr(load_test, "build_dataset", lambda *a: [])
    args = load_test.make_parser().parse_args(["--sweep-rates", "--goodput", "ttft:100", "--sweep-start", "4"])
    load_test.check_args(args)       # (as main() does: it fills in the sweep's defaults)
    out = load_test.sweep_mode(None, args, None, {"ttft": 100.0}, "m", None)
    assert out["max_rate_is_lower_bound"] is lower_bound
    assert out["max_rate"] == (13.0 if limit == 13.0 else 4.0 * 2 ** load_test.SWEEP_MAX_DOUBLINGS)


def test_sweep_brackets_then_bisects():
    best, trials = load_test.sweep_rates(lambda r: r, 4.0, lambda r: r <= 13, bisect_steps=3)
    assert best == 13.0 and [r for r, _ in trials] == [4, 8, 16, 12, 14, 13]
    best, _ = load_test.sweep_rates(lambda r: r, 4.0, lambda r: r <= 1.5, bisect_steps=2)
    assert 1.0 <= best <= 1.5


def test_modes_and_models_are_validated(tmp_path):
    assert common.parse_modes("eager,piecewise+async+unfused") == [
        ("eager", {"mode": "eager"}),
        ("piecewise+async+unfused", {"mode": "piecewise", "async_scheduling": True, "fuse": False, "kernels": False})]
    for bad in ("warp", "eager+fast", "", "eager, eager"):    # (a repeat replaced the first run's result)
        with pytest.raises(SystemExit):
            common.parse_modes(bad)
    assert common.resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(SystemExit, match="preset"):
        common.resolve_model("no-such-model")


# ---- end to end on the tiny model ------------------------------------------------------------------
def test_load_test_two_modes(tmp_path):
    out = tmp_path / "load.json"
    rc = load_test.main(["--device", "cpu", "--modes", "eager,eager+async", "--num-prompts", "8",
                         "--input-len", "12", "--output-len", "5", "--range-ratio", "0.5", "--request-rate", "40",
                         "--max-concurrency", "4", "--max-num-seqs", "4", "--goodput", "ttft:1e9", "tpot:1e9",
                         "--warmup", "1", "--no-progress", "--json", str(out)])
    assert rc == 0
    data = read(out)
    assert ENV_KEYS <= set(data) and data["config"]["max_concurrency"] == 4
    assert set(data["modes"]) == {"eager", "eager+async"}
    assert data["modes"]["eager+async"]["async_scheduling"] is True
    for res in data["modes"].values():
        assert res["completed"] == 8 and res["failed"] == 0 and res["duration_s"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert set(res[key]) == {"mean", "median", "p90", "p99"}
        assert res["goodput"] == pytest.approx(res["request_throughput"])
        assert res["cpu_probe"]["after"]["python_min_us"] > 0     # bench/cpu_probe.py, beside each run
        assert res["total_output_tokens"] == sum(r["output_len_asked"] for r in res["requests"])
        for r in res["requests"]:
            assert r["ok"] and r["output_len"] == r["output_len_asked"]
            assert 0 < r["ttft_ms"] <= r["e2el_ms"]
            assert 2 <= r["output_len"] <= 8 and 6 <= r["prompt_len"] <= 18
            assert r["engine_ttft_ms"] <= r["ttft_ms"] + 1e-6   # the engine stamps first, same clock


def test_load_test_jsonl_dataset(tmp_path):
    ds = tmp_path / "prompts.jsonl"
    ds.write_text('{"prompt": "def main():", "output_len": 3}\n{"prompt": [5, 6, 7, 8], "output_len": 4}\n\n'
                  '{"prompt": "import sys"}\n')
    out = tmp_path / "load.json"
    assert load_test.main(["--device", "cpu", "--modes", "eager", "--dataset", str(ds), "--output-len", "2",
                           "--warmup", "0", "--no-progress", "--json", str(out)]) == 0
    data = read(out)
    assert "modes" not in data and data["completed"] == 3 and data["goodput"] is None
    assert [r["output_len"] for r in data["requests"]] == [3, 4, 2]
    assert data["requests"][1]["prompt_len"] == 4


def test_load_test_warmup_gives_each_dataset_line_its_own_output_length(tmp_path):
    """Found by a review: the warm-up gave every request the first line's output length (capped at
    16), so a later line of a long prompt and a short output went past max_model_len and ended the
    run before anything was measured, though the line fits."""
    ds = tmp_path / "prompts.jsonl"
    ds.write_text(json.dumps({"prompt": [5, 6, 7], "output_len": 16}) + "\n"
                  + json.dumps({"prompt": list(range(10, 70)), "output_len": 2}) + "\n")
    out = tmp_path / "load.json"
    assert load_test.main(["--device", "cpu", "--modes", "eager", "--dataset", str(ds), "--max-model-len", "64",
                           "--warmup", "2", "--no-progress", "--json", str(out)]) == 0
    assert [r["output_len"] for r in read(out)["requests"]] == [16, 2]


def test_load_test_dataset_runs_start_from_a_cold_prefix_cache(tmp_path):
    """Found by probing: the warm-up sent the dataset's first prompts, which the measured run then
    sent again and found in the prefix cache, and each sweep trial found the blocks of the runs
    before it (the same first lines): their TTFT was not a prefill's. Each run now starts cold;
    a prompt repeated inside the dataset still hits, as it would on a server."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 1000, size=40).tolist() for _ in range(4)]
    ds = tmp_path / "prompts.jsonl"
    ds.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts + [prompts[0]]))
    out = tmp_path / "load.json"
    assert load_test.main(["--device", "cpu", "--modes", "eager", "--dataset", str(ds), "--output-len", "2",
                           "--warmup", "2", "--max-num-seqs", "1", "--sweep-rates", "--goodput", "ttft:1e9",
                           "--sweep-num-prompts", "3", "--sweep-start", "1000", "--no-progress",
                           "--json", str(out)]) == 0
    data = read(out)
    assert [r["cached_tokens"] for r in data["requests"]] == [0, 0, 0, 0, 32]   # line 5 repeats line 1
    assert data["cached_prompt_tokens"] == 32
    trials = data["sweep"]["eager"]["trials"]
    assert len(trials) == 7 and all(t["failed"] == 0 and t["cached_prompt_tokens"] == 0 for t in trials)


@pytest.mark.parametrize("content, expected", [
    (b'{"prompt": "a"}\n{"prompt": "b"\n', "line 2 is not valid JSON"),
    (b'{"text": "a"}\n', 'line 1: needs a "prompt"'),
    (b'{"prompt": ""}\n', 'line 1: needs a "prompt"'),
    (b'{"prompt": [1, -2]}\n', 'line 1: needs a "prompt"'),
    (b'[1, 2]\n', 'line 1: needs a "prompt"'),
    (b'{"prompt": "a", "output_len": 0}\n', 'line 1: "output_len" must be an integer >= 1, got 0'),
    (b'{"prompt": "a", "output_len": "3"}\n', '"output_len" must be an integer >= 1'),
    # found by probing: dropped without a word, the request ran with the default output length
    (b'{"prompt": "a", "max_tokens": 5}\n', 'line 1: \'max_tokens\' is not read from a dataset line; a line gives '
                                            '"prompt" and "output_len"'),
    # found by probing: other tools' names and misspellings of output_len, ignored: the run used --output-len
    (b'{"prompt": "a", "max_new_tokens": 5}\n', "line 1: 'max_new_tokens' is not read from a dataset line"),
    (b'{"prompt": "a", "output_length": 5}\n', "line 1: 'output_length' is not read from a dataset line"),
    (b'{"prompt": "a", "Output_len": 5}\n', "line 1: 'Output_len' is not read from a dataset line"),
    (b'{"prompt": "a", "outputlen": 5}\n', "line 1: 'outputlen' is not read from a dataset line"),
    (b"\n\n", "holds no request"),
    (b"\xff\xfe", "is not UTF-8 text"),
    # found by probing: a lone surrogate escape reached the tokenizer, a TypeError traceback
    (b'{"prompt": "a"}\n{"prompt": "ab\\ud800c"}\n', 'line 2: "prompt" is not valid Unicode text: surrogates not '
                                                    'allowed at character 2'),
])
def test_load_test_bad_dataset_named_before_building_an_engine(tmp_path, content, expected, monkeypatch):
    ds = tmp_path / "d.jsonl"
    ds.write_bytes(content)
    monkeypatch.setattr(common, "build_llm", lambda *a, **k: pytest.fail("an engine was built"))
    with pytest.raises(SystemExit, match="--dataset: ") as e:
        load_test.main(["--device", "cpu", "--dataset", str(ds)])
    assert expected in str(e.value)


@pytest.mark.parametrize("flags, expected", [
    (["--num-prompts", "3"], "--num-prompts 3 asks for more requests than --dataset {ds} holds (2); the dataset "
                             "is not repeated: lower --num-prompts to at most 2"),
    (["--num-prompts", "2", "--sweep-rates", "--goodput", "ttft:1e9", "--sweep-num-prompts", "5"],
     "--sweep-num-prompts 5 asks for more requests than --dataset {ds} holds (2)"),
    # found by a review (session 40): cut to the dataset's size without a word
    (["--warmup", "3"], "--warmup 3 asks for more requests than --dataset {ds} holds (2); the dataset is not "
                        "repeated: lower --warmup to at most 2"),
])
def test_load_test_dataset_shorter_than_asked_is_refused(tmp_path, monkeypatch, flags, expected):
    """Found by probing: --num-prompts 10 on a 2-line dataset ran 2 requests, with nothing said."""
    ds = tmp_path / "d.jsonl"
    ds.write_text('{"prompt": [5, 6, 7]}\n\n{"prompt": [8, 9]}\n')
    monkeypatch.setattr(common, "build_llm", lambda *a, **k: pytest.fail("an engine was built"))
    with pytest.raises(SystemExit) as e:
        load_test.main(["--device", "cpu", "--dataset", str(ds), *flags])
    assert expected.format(ds=ds) in str(e.value)


def test_load_test_sweep_of_a_one_line_dataset_is_refused(tmp_path, monkeypatch):
    """Found by a review (session 41): told to lower --sweep-num-prompts to at most 1, which is refused."""
    ds = tmp_path / "one.jsonl"
    ds.write_text('{"prompt": [5, 6, 7]}\n')
    monkeypatch.setattr(common, "build_llm", lambda *a, **k: pytest.fail("an engine was built"))
    with pytest.raises(SystemExit, match=f"--sweep-rates needs a --dataset of at least 2 requests .*; {ds} holds 1"):
        load_test.main(["--device", "cpu", "--dataset", str(ds), "--sweep-rates", "--goodput", "ttft:1e9"])



@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny_checkpoints import build_tiny
    return str(build_tiny(tmp_path_factory.getbasetemp(), "tiny-qwen3"))


@pytest.mark.parametrize("dataset, flags, expected", [
    ('{"prompt": [5, 6, 7]}\n\n{"prompt": [5, 1024, 7]}\n', [],
     "--dataset: line 3: token 1024 at position 1 is outside the model's vocabulary; allowed: 0..1023 (vocab_size"),
    ('{"prompt": [5, 6, 7]}\n{"prompt": [5, 6, 7], "output_len": 62}\n', ["--max-model-len", "64"],
     "--dataset: line 2: a request of 3 prompt + 62 output tokens exceeds max_model_len 64"),
    ('{"prompt": "' + "hello " * 40 + '"}\n', ["--max-model-len", "32"],
     "output tokens exceeds max_model_len 32; shorten it"),      # (a text prompt: its count is the tokenizer's)
    (None, ["--input-len", "40", "--range-ratio", "0.5", "--max-model-len", "62"],
     "the longest request the flags allow, 60 prompt + 3 output tokens (--shared-prefix-len 0, --input-len 40, "
     "--output-len 2, --range-ratio 0.5), exceeds max_model_len 62"),
    (None, ["--input-len", "8", "--shared-prefix-len", "60", "--max-model-len", "64"],
     "the longest request the flags allow, 68 prompt + 2 output tokens (--shared-prefix-len 60"),
    (None, ["--input-len", "40", "--num-kv-blocks", "3"],
     "40 prompt + 2 output tokens (--shared-prefix-len 0, --input-len 40, --output-len 2, --range-ratio 0), exceeds "
     "the 32 tokens of the KV cache (--num-kv-blocks 3); lower them or raise --num-kv-blocks"),
    ('{"prompt": [5, 6, 7]}\n{"prompt": [5, 6, 7], "output_len": 14}\n', ["--num-kv-blocks", "2"],
     "--dataset: line 2: a request of 3 prompt + 14 output tokens exceeds the 16 tokens of the KV cache "
     "(--num-kv-blocks 2); shorten it, lower its output_len (or --output-len) or raise --num-kv-blocks"),
], ids=["token-outside-vocab", "ids-too-long", "text-too-long", "random-too-long", "shared-prefix-too-long",
        "random-beyond-kv-cache", "ids-beyond-kv-cache"])
def test_load_test_requests_that_cannot_run_are_refused_before_building_an_engine(
        tiny_model, tmp_path, monkeypatch, dataset, flags, expected):
    """Found by probing: a dataset token outside the vocabulary failed its request, the reason only in
    the JSON; a request longer than max_model_len was found after the engine was built; one beyond
    the KV cache of --num-kv-blocks failed in the engine, every request of the run with it, the
    reason only in the JSON (the table all zeros, exit 1)."""
    if dataset is not None:
        (tmp_path / "d.jsonl").write_text(dataset)
        flags = ["--dataset", str(tmp_path / "d.jsonl"), *flags]
    monkeypatch.setattr(common, "build_llm", lambda *a, **k: pytest.fail("an engine was built"))
    with pytest.raises(SystemExit) as e:
        load_test.main(["--model", tiny_model, "--device", "cpu", "--output-len", "2", *flags])
    assert expected in str(e.value)


def test_load_test_random_prompts_without_a_tokenizer_refused_before_building_an_engine(tiny_model, tmp_path,
                                                                                          monkeypatch):
    """Found by probing: a checkpoint without tokenizer files built the engine, then token_pool's
    CheckpointError stopped the run; random prompts need the tokenizer's ids."""
    import shutil
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    for f in model.glob("tokenizer*"):
        f.unlink()
    monkeypatch.setattr(common, "build_llm", lambda *a, **k: pytest.fail("an engine was built"))
    with pytest.raises(SystemExit, match="random prompts are drawn from the tokenizer's ids, but the checkpoint .* "
                                         "has no tokenizer .*; give --dataset with token-id prompts"):
        load_test.main(["--model", str(model), "--device", "cpu", "--input-len", "4", "--output-len", "2"])
    (tmp_path / "d.jsonl").write_text('{"prompt": [5, 6, 7]}\n')   # token ids need none: checked, then built
    monkeypatch.setattr(common, "build_llm", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("built")))
    with pytest.raises(RuntimeError, match="built"):
        load_test.main(["--model", str(model), "--device", "cpu", "--dataset", str(tmp_path / "d.jsonl"),
                        "--output-len", "2"])


def test_load_test_missing_dataset(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "build_llm", lambda *a, **k: pytest.fail("an engine was built"))
    with pytest.raises(SystemExit, match="--dataset: cannot read"):
        load_test.main(["--device", "cpu", "--dataset", str(tmp_path / "none.jsonl")])


def test_throughput(tmp_path):
    out = tmp_path / "tp.json"
    assert throughput.main(["--device", "cpu", "--modes", "eager", "--num-prompts", "6", "--input-len", "12",
                            "--output-len", "5", "--range-ratio", "0.5", "--warmup-prompts", "1",
                            "--json", str(out)]) == 0
    data = read(out)
    assert ENV_KEYS <= set(data) and data["config"]["max_model_len"] == 4096
    assert data["num_requests"] == 6 and data["total_output_tokens"] == data["expected_output_tokens"]
    assert data["output_throughput"] > 0 and data["steps"] >= 5
    # The phase split accounts for every step, prefill first (all requests arrive at once).
    phases = data["phases"]
    assert sum(p["steps"] for p in phases.values()) == data["steps"]
    assert phases["prefill (until every prompt is in)"]["steps"] >= 1
    assert sum(p["s"] for p in phases.values()) <= data["elapsed_s"]


def test_load_test_without_tpot_samples_says_so(tmp_path):
    """Found by probing: 1-token outputs have no TPOT, and the table and JSON showed 0.000 ms (a
    perfect result); now null in the JSON and n/a in the table."""
    out = tmp_path / "lt.json"
    load_test.main(["--model", "tiny-qwen3", "--device", "cpu", "--modes", "eager", "--num-prompts", "2",
                    "--input-len", "4", "--output-len", "1", "--warmup", "0", "--no-progress", "--json", str(out)])
    data = read(out)
    assert data["completed"] == 2 and data["ttft_ms"]["median"] > 0
    assert data["tpot_ms"] == {"mean": None, "median": None, "p90": None, "p99": None}
    row = next(r for r in load_test.table_rows({"eager": data})[1] if r[0] == "tpot median (ms)")
    assert row == ["tpot median (ms)", "n/a"]


def test_load_test_dataset_from_stdin_with_a_process_per_mode(tmp_path):
    """Found by probing: `--dataset -` with a process per mode (CUDA's default for several modes)
    failed: each child read an empty stdin ("--dataset: - holds no request"). The parent hands the
    children what it read."""
    import subprocess
    out = tmp_path / "lt.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "pcg_engine.cli", "bench", "load-test", "--model", "tiny-qwen3",
                           "--device", "cpu", "--dataset", "-", "--modes", "eager,eager+async", "--process-per-mode",
                           "on", "--output-len", "2", "--warmup", "0", "--no-progress", "--json", str(out)],
                          input='{"prompt": [5, 6, 7]}\n{"prompt": [8, 9]}\n', text=True, capture_output=True,
                          env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = read(out)
    assert {name: r["completed"] for name, r in data["modes"].items()} == {"eager": 2, "eager+async": 2}
    assert len({r["pid"] for r in data["modes"].values()}) == 2        # two processes did run


def test_throughput_p2_defaults():
    args = throughput.parse_args([])
    assert (args.num_prompts, args.input_min, args.input_max, args.output_min, args.output_max, args.seed,
            args.max_model_len) == (256, 100, 1024, 100, 1024, 0, None)      # None: 4096, set by main()
    assert throughput.P2_MAX_MODEL_LEN == 4096


def test_a_json_file_that_cannot_be_written_leaves_the_old_one_whole(tmp_path, monkeypatch):
    """Found by a review: on a full disk `--json PATH` ended in a traceback after the whole run and
    left PATH cut in the middle, the previous results lost. Now one line, and the old file stays."""
    out = tmp_path / "r.json"
    common.write_json(str(out), {"old": 1})
    real = Path.write_text

    def full(self, *args, **kwargs):
        real(self, "{\"cut", encoding="utf-8")       # a part written, then the disk is full
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(SystemExit) as e:
        common.write_json(str(out), {"new": 2})
    assert "--json: cannot write" in str(e.value) and "No space left on device" in str(e.value)
    assert read(out) == {"old": 1} and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    monkeypatch.undo()
    if Path("/dev/full").exists():            # a device: written in place, its error one line too
        with pytest.raises(SystemExit, match="cannot write /dev/full"):
            common.write_json("/dev/full", {"x": 1})


def test_bench_load_records_the_dtype_it_loaded(tmp_path):
    """Found by a review: `pcg bench load`'s JSON named no dtype (nor its flags), so a bf16 and an
    fp32 load of one checkpoint read alike."""
    from pcg_engine.bench import load
    out = tmp_path / "load.json"
    assert load.main(["--model", "tiny-qwen3", "--device", "cpu", "--dtype", "fp32", "--json", str(out)]) == 0
    data = read(out)
    assert data["dtype"] == "float32" and data["config"]["dtype"] == "fp32" and data["load_s"] > 0


def test_throughput_records_no_range_that_a_fixed_length_replaced():
    """Found by a review: with --input-len, the JSON's config still recorded input_min / input_max
    as 100 / 1024, a range no length was drawn from."""
    args = throughput.parse_args(["--input-len", "30"])
    assert (args.input_len, args.input_min, args.input_max) == (30, None, None)
    assert (args.output_min, args.output_max) == (100, 1024)
    rng = np.random.default_rng(0)
    assert set(throughput.lengths(rng, 8, args.input_len, 0.0, args.input_min, args.input_max).tolist()) == {30}


def test_throughput_default_max_model_len_fits_a_smaller_checkpoint(tmp_path):
    """Found by probing: P2's max_model_len 4096, a fixed default, was refused by a checkpoint of 2048
    positions ("max_model_len: got 4096; allowed: 2..2048"), a value the user never gave."""
    import shutil
    small = tmp_path / "small"
    shutil.copytree(common.resolve_model("tiny-qwen3"), small)
    config = json.loads((small / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (small / "config.json").write_text(json.dumps(config))
    out = tmp_path / "tp.json"
    assert throughput.main(["--model", str(small), "--device", "cpu", "--modes", "eager", "--num-prompts", "2",
                            "--input-len", "8", "--output-len", "2", "--warmup-prompts", "0",
                            "--json", str(out)]) == 0
    assert read(out)["config"]["max_model_len"] == 2048


def test_latency(tmp_path):
    out = tmp_path / "lat.json"
    assert latency.main(["--device", "cpu", "--modes", "eager", "--input-len", "12", "--output-len", "5",
                         "--num-iters", "3", "--warmup-iters", "1", "--json", str(out)]) == 0
    data = read(out)
    assert data["output_lens"] == [5] and len(data["iterations"]) == 3
    # the table's tok/s column stands beside the median TPOT (it came from the mean)
    assert data["decode_tok_s_per_request"] == pytest.approx(1000 / data["tpot_ms"]["median"])
    for it in data["iterations"]:
        assert 0 < it["ttft_ms"] <= it["e2el_ms"] and it["tpot_ms"] > 0
        assert it["cpu_probe_python_us"] > 0           # the probe taken just before the iteration
    assert data["iterations"][0]["cpu_probe_python_us"] == data["cpu_probe"]["before"]["python_median_us"]
    if sys.platform == "linux":        # what the OS did during the timed iterations (bench/proc_stats.py)
        proc = data["proc"]
        assert proc["minflt"] >= 0 and proc["voluntary_switches"] >= 0 and proc["rss_kb"] > 0
        assert proc["cpu"] in os.sched_getaffinity(0)
    probe = data["cpu_probe"]            # fixed host work before and after them (bench/cpu_probe.py)
    for side in ("before", "after"):
        assert 0 < probe[side]["python_min_us"] <= probe[side]["python_median_us"]
        assert 0 < probe[side]["torch_min_us"] <= probe[side]["torch_median_us"]


def test_latency_refuses_a_batch_the_kv_cache_holds_only_in_turns(tmp_path):
    """Found by a review: 8 requests of 1100 tokens in a 79-block cache ran in turns (TTFT 0.37 to
    3.6 s), reported as "batch 8"."""
    flags = ["--device", "cpu", "--modes", "eager", "--input-len", "40", "--output-len", "8", "--num-iters", "1",
             "--warmup-iters", "0", "--json", str(tmp_path / "lat.json")]
    with pytest.raises(SystemExit) as e:      # 4 x 3 blocks of 16 tokens, 10 blocks held
        latency.main([*flags, "--batch-size", "4", "--num-kv-blocks", "11"])
    assert str(e.value) == ("--batch-size: 4 requests of 40 + 8 tokens need 12 KV blocks at once, the cache holds 10 "
                            "(at most 3 such requests); lower --batch-size, --input-len or --output-len, or give "
                            "the cache more blocks (--num-kv-blocks, --gpu-memory-utilization)")
    assert latency.main([*flags, "--batch-size", "3", "--num-kv-blocks", "11"]) == 0


def test_latency_process_per_mode_runs_each_mode_in_its_own_process(tmp_path):
    out = tmp_path / "lat.json"
    assert latency.main(["--device", "cpu", "--modes", "eager,eager+sync", "--process-per-mode", "on",
                         "--input-len", "6", "--output-len", "3", "--num-iters", "1", "--warmup-iters", "0",
                         "--json", str(out)]) == 0
    data = read(out)
    pids = [data["modes"][m]["pid"] for m in ("eager", "eager+sync")]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert data["modes"]["eager+sync"]["async_scheduling"] is False
    assert all(len(data["modes"][m]["iterations"]) == 1 for m in data["modes"])


def test_load_test_process_per_mode_runs_each_mode_in_its_own_process(tmp_path):
    """P3 compares modes: in one process the later engine decoded slower (docs/PERF.md, session 19)."""
    out = tmp_path / "load.json"
    assert load_test.main(["--device", "cpu", "--modes", "eager,eager+sync", "--process-per-mode", "on",
                           "--num-prompts", "3", "--input-len", "6", "--output-len", "3", "--warmup", "0",
                           "--sweep-rates", "--goodput", "ttft:100000", "--sweep-num-prompts", "2", "--sweep-bisect", "0",
                           "--sweep-start", "1000", "--no-progress", "--json", str(out)]) == 0
    data = read(out)
    pids = [data["modes"][m]["pid"] for m in ("eager", "eager+sync")]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert data["modes"]["eager+sync"]["async_scheduling"] is False
    assert all(data["modes"][m]["completed"] == 3 for m in data["modes"])
    assert set(data["sweep"]) == {"eager", "eager+sync"} and "sweep" not in data["modes"]["eager"]


def test_latency_in_one_process_by_default_on_cpu(tmp_path):
    out = tmp_path / "lat.json"
    assert latency.main(["--device", "cpu", "--modes", "eager,eager+sync", "--input-len", "6", "--output-len", "3",
                         "--num-iters", "1", "--warmup-iters", "0", "--json", str(out)]) == 0
    assert {m["pid"] for m in read(out)["modes"].values()} == {os.getpid()}


def test_process_per_mode_names_the_mode_whose_process_failed(capfd):
    # a child that dies (here: a benchmark that does not exist) stops the run with the mode named
    args = latency.make_parser().parse_args(["--device", "cpu", "--modes", "eager,compile", "--process-per-mode", "on"])
    with pytest.raises(SystemExit, match="mode eager: its process exited with status 2"):
        common.run_each_mode(args, "unused", latency.run_mode, "", bench="no-such-benchmark", argv=[])
    assert "error: pcg bench: unknown benchmark 'no-such-benchmark'" in capfd.readouterr().err


def test_process_per_mode_child_refuses_in_one_error_line(capfd):
    """Found by probing: a child that refused a setting (one the parent had not checked: here the
    parent's own flags are fine and only the child's carry the bad one) printed a bare line or a
    traceback and exited 1; it runs through the CLI now, as the user's command would."""
    args = latency.make_parser().parse_args(["--device", "cpu", "--modes", "eager", "--process-per-mode", "on"])
    with pytest.raises(SystemExit, match="mode eager: its process exited with status 2"):
        common.run_each_mode(args, "tiny-qwen3", latency.run_mode, "", bench="latency",
                             argv=["--device", "cpu", "--max-num-seqs", "0", "--num-iters", "1"])
    err = capfd.readouterr().err
    assert "error: --max-num-seqs (max_num_seqs): got 0; allowed: 1..4096" in err and "Traceback" not in err


def test_cpu_probe_times_its_work():
    from pcg_engine.bench import cpu_probe
    small = cpu_probe.probe(repeats=3, python_iters=5000, torch_iters=100)
    large = cpu_probe.probe(repeats=3, python_iters=40000, torch_iters=800)
    assert set(small) == {f"{w}_{s}_us" for w in ("python", "torch") for s in ("min", "median")}
    # 8x the work takes longer (a probe that timed nothing, or the wrong thing, would not)
    assert large["python_min_us"] > 2 * small["python_min_us"] and large["torch_min_us"] > 2 * small["torch_min_us"]
    line = cpu_probe.summary(small, large)
    assert line.startswith(f"python {small['python_median_us']:.0f} -> {large['python_median_us']:.0f} us")
    assert "torch" in line


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_proc_stats_counts_faults_and_keeps_gauges():
    from pcg_engine.bench import proc_stats
    import mmap
    fresh = mmap.mmap(-1, 16 << 20)             # a new anonymous mapping: each page faults when first written
    before = proc_stats.snapshot()
    for at in range(0, len(fresh), 4096):
        fresh[at] = 1
    after = proc_stats.snapshot()
    d = proc_stats.delta(before, after)
    assert d["minflt"] >= 8 and d["majflt"] >= 0           # >= 8 even if the 16 MiB got 2 MiB huge pages
    assert d["rss_kb"] == after["rss_kb"] and d["rss_kb"] >= before["rss_kb"] + 8 * 1024   # gauges: the value after
    assert d["cpu"] == after["cpu"] and set(d) == set(after)
    assert proc_stats.thp_mode() in (None, "always", "madvise", "never")
    fresh.close()


def test_overhead_table(tmp_path, capsys):
    out = tmp_path / "oh.json"
    assert overhead.main(["--device", "cpu", "--requests", "3", "--slots", "3", "--new-tokens", "5",
                          "--prompt-len", "8", "--json", str(out)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [set(line) for line in lines] == [SEED_KEYS] * 3        # exactly the chapter's keys
    data = read(out)
    assert [c["config"] for c in data["configs"]] == ["eager", "fused", "fused + async"]
    for c in data["configs"]:
        assert SEED_KEYS <= set(c) and c["same_tokens"] is True and c["token_match"] == 1.0
        assert c["steps"] == 5 and c["tok_s"] > 0 and c["engine_config"]["max_num_seqs"] == 3
    assert any("full graphs" in note for note in data["skipped"])


def test_host_overhead(tmp_path):
    out = tmp_path / "host.json"
    prof = tmp_path / "host.prof"
    assert overhead.main(["--host-only", "--device", "cpu", "--batch-sizes", "4,8", "--host-steps", "3",
                          "--warm-steps", "1", "--prompt-len", "16", "--json", str(out),
                          "--host-profile", str(prof)]) == 0
    data = read(out)
    assert [s["running"] for s in data["host_only"]] == [4, 8]
    for run in data["runs"]:
        assert run["steps"] == 3 and run["tokens_per_step"] == run["running"] and run["host_ms_per_step"] > 0
        assert run["cpu_probe"]["before"]["python_min_us"] > 0      # bench/cpu_probe.py, around the timed steps
    # the profile covers the persistent batch's timed steps at the largest size only: 3 engine steps
    import pstats
    steps = [v for k, v in pstats.Stats(str(prof)).stats.items() if k[2] == "step" and "llm_engine" in k[0]]
    assert len(steps) == 1 and steps[0][1] == 3
    assert "persistent, 8 running, 3 timed steps" in (tmp_path / "host.prof.txt").read_text()


@pytest.mark.parametrize("flag", [["--prompt-len=8"], ["--prompt", "8"], ["--prompt-len", "8"], []])
def test_host_overhead_takes_the_prompt_length_in_any_form(tmp_path, flag):
    """Found by a review: the host-only run replaced --prompt-len=8 (or the abbreviation --prompt 8)
    with its default of 128, as it looked for "--prompt-len" among the arguments."""
    out = tmp_path / "host.json"
    assert overhead.main(["--host-only", "--device", "cpu", "--batch-sizes", "2", "--host-steps", "2",
                          "--warm-steps", "0", "--fake-vocab", "16", "--json", str(out), *flag]) == 0
    assert read(out)["config"]["prompt_len"] == (8 if flag else 128)


def test_host_overhead_keeps_every_request_running_at_a_small_token_budget(tmp_path):
    """Found by a review: max_tokens left the decodes out of the prefill phase's token budget, so at
    a small --max-num-batched-tokens early requests finished inside the timed steps (31.68 tokens a
    step in the row of 32 running; 241.7 at 256)."""
    out = tmp_path / "host.json"
    assert overhead.main(["--host-only", "--device", "cpu", "--batch-sizes", "32", "--host-steps", "3",
                          "--warm-steps", "1", "--prompt-len", "64", "--max-num-batched-tokens", "64",
                          "--fake-vocab", "16", "--json", str(out)]) == 0
    assert [run["tokens_per_step"] for run in read(out)["runs"]] == [32.0, 32.0]


def test_host_overhead_refuses_a_kv_cache_too_small_before_measuring(monkeypatch):
    """Found by a review: --num-kv-blocks 100 failed after the smaller sizes were measured, as
    "--batch-sizes 16: only 5 of the 16 requests were still running", naming the default list."""
    from pcg_engine.bench import host_overhead
    def no_measure(*args, **kwargs):
        raise AssertionError("measured before the refusal")
    monkeypatch.setattr(host_overhead, "measure", no_measure)
    with pytest.raises(SystemExit) as e:
        overhead.main(["--host-only", "--device", "cpu", "--batch-sizes", "2,8", "--host-steps", "3",
                       "--warm-steps", "1", "--prompt-len", "16", "--fake-vocab", "16", "--num-kv-blocks", "12"])
    # a request holds at least 16 + 1 + 3 tokens, 2 blocks: 2 or 5 of them fit 11 blocks, 8 do not
    assert str(e.value) == ("--batch-sizes: 8 requests of at least 20 tokens need 16 KV blocks of 16; --num-kv-blocks 12 "
                            "holds 11; give more blocks, or smaller sizes, --prompt-len or --host-steps")
    monkeypatch.undo()
    assert overhead.main(["--host-only", "--device", "cpu", "--batch-sizes", "2,5", "--host-steps", "3",
                          "--warm-steps", "1", "--prompt-len", "16", "--fake-vocab", "16", "--num-kv-blocks", "12"]) == 0
    # at the edge: 4 requests of 8 + 4 tokens in 4 blocks measured before the check, and still do (a
    # review: counting up to max_tokens refused it)
    assert overhead.main(["--host-only", "--device", "cpu", "--batch-sizes", "4", "--host-steps", "4",
                          "--warm-steps", "0", "--prompt-len", "8", "--fake-vocab", "16", "--num-kv-blocks", "5"]) == 0


def test_profile_keeps_every_request_running_through_the_profile(tmp_path):
    """Found by a review: each request's max_tokens left out the steps its neighbours' prefill took,
    so the profile of "64 requests" ended with 25 running. Now they last, and a profile where some
    stopped running (finished, or waiting for KV blocks) is refused, not labelled N requests."""
    flags = ["--device", "cpu", "--configs", "eager", "--requests", "16", "--prompt-len", "48",
             "--max-num-batched-tokens", "32", "--steps", "2", "--warm-steps", "0", "--out-dir", str(tmp_path)]
    assert profile.main(flags) == 0
    with pytest.raises(SystemExit, match="only [0-9]+ of the 16 requests were still running"):
        profile.main([*flags[:-4], "--num-kv-blocks", "20", "--out-dir", str(tmp_path)])


@pytest.mark.parametrize("config", ["full graphs", "full + piecewise + async"])
def test_profile_refuses_a_graph_config_on_cpu(config, tmp_path):
    with pytest.raises(SystemExit, match="needs CUDA"):
        profile.main(["--device", "cpu", "--configs", f"eager,{config}", "--out-dir", str(tmp_path)])


def test_profile_writes_trace_and_png(tmp_path):
    out = tmp_path / "prof.json"
    assert profile.main(["--device", "cpu", "--configs", "eager", "--requests", "2", "--prompt-len", "8",
                         "--steps", "2", "--warm-steps", "0", "--out-dir", str(tmp_path / "prof"),
                         "--json", str(out)]) == 0
    data = read(out)
    (cfg,) = data["configs"]
    trace = read(cfg["trace"])
    assert any(e.get("name") == "pcg.forward" for e in trace["traceEvents"])
    assert cfg["steps"] == 2 and cfg["kernels_per_step"] > 0 and 0 <= cfg["idle_fraction"] < 1
    assert 0 <= cfg["steady_idle_fraction"] < 1
    assert "CPU ops" in cfg["events"]
    assert Path(data["timeline_png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kernels_delegates_to_the_script(tmp_path, monkeypatch):
    script = tmp_path / "bench_kernels.py"
    script.write_text("SEEN = []\ndef main(argv=None):\n    import builtins\n    builtins._pcg_seen = argv\n"
                      "    return 0\n")
    monkeypatch.setattr(kernels, "SCRIPT", script)
    assert kernels.main(["--json", "x.json"]) == 0
    import builtins
    assert builtins._pcg_seen == ["--json", "x.json"]
    del builtins._pcg_seen
    monkeypatch.setattr(kernels, "SCRIPT", tmp_path / "missing.py")
    assert kernels.main([]) == 2


def test_kernels_help_names_the_command_and_a_bad_section_is_refused(capsys):
    """Found by following the README: `pcg bench kernels --help` printed "usage: cli.py", its --only
    said "(default: all)" while two sections (argmax, rope_attention) run only when named, and a
    misspelt section ended in a KeyError traceback on a GPU (on the CPU: "Nothing measured", exit 0)."""
    with pytest.raises(SystemExit) as exit_info:
        kernels.main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith("usage: pcg bench kernels ")
    assert "rope_attention" in out and "default: all" not in out
    with pytest.raises(SystemExit) as exit_info:
        kernels.main(["--only", "norm,attn"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "--only: 'attn' is not a section; allowed: norm, activation, moe, attention, graph_split, argmax, " \
           "rope_attention" in err


@pytest.mark.parametrize("argv, error", [
    (["--only", "norm", "--moe-sweep"], "--moe-sweep: only with the moe section, which reads it"),
    (["--only", "moe", "--attention-sweep", "full"], "--attention-sweep: only with the attention section"),
    (["--only", "moe,moe"], "--only: 'moe,moe' names a section twice"),
])
def test_kernels_refuses_a_flag_no_section_reads(argv, error, capsys):
    """Found by a review: `--only norm --moe-sweep` was accepted and swept nothing."""
    with pytest.raises(SystemExit) as exit_info:
        kernels.main(argv)
    assert exit_info.value.code == 2 and error in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer: no kernels measured")
def test_kernels_json_on_a_cpu_says_why_it_holds_no_rows(tmp_path, capsys):
    """Found by following the README: `pcg bench kernels --json F` on a CPU printed "Nothing
    measured" and wrote no F, so the next step of a script failed on a missing file."""
    out = tmp_path / "kernels.json"
    assert kernels.main(["--json", str(out), "--only", "norm"]) == 0
    data = json.loads(out.read_text())
    assert data["rows"] == [] and data["gpu"] is None and "no CUDA device" in data["skipped"]
    assert data["torch"] == torch.__version__
    # The record every benchmark's JSON carries (it held the versions alone); a missing parent is made.
    assert data["benchmark"] == "kernels" and data["device"].startswith("CPU") and data["date"].startswith("20")
    assert "commit" in data and data["config"]["only"] == "norm"
    assert "Nothing measured" in capsys.readouterr().out
    nested = tmp_path / "new" / "dir" / "kernels.json"
    assert kernels.main(["--json", str(nested), "--only", "norm"]) == 0 and json.loads(nested.read_text())["rows"] == []


@pytest.mark.parametrize("name", ["load_test", "bench_throughput", "bench_latency", "bench_overhead",
                                  "bench_profile"])
def test_wrapper_scripts(name, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / "scripts" / f"{name}.py"), run_name="__main__")
    assert exit_info.value.code == 0 and "--model" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["load_test", "bench_throughput", "bench_latency"])
def test_wrapper_scripts_refuse_a_setting_in_one_line(name, monkeypatch, capsys):
    """Found by probing: `python scripts/load_test.py --max-num-seqs 0` ("same as pcg bench
    load-test") ended in a ConfigError traceback; `pcg bench` gives one line and exit 2."""
    monkeypatch.setattr(sys, "argv", [name, "--device", "cpu", "--max-num-seqs", "0"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / "scripts" / f"{name}.py"), run_name="__main__")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == "error: --max-num-seqs (max_num_seqs): got 0; allowed: 1..4096"


@pytest.mark.parametrize("name", ["latency", "throughput", "load_test", "overhead", "profile", "load", "startup"])
def test_bench_help_names_every_default(name):
    """Found by reading the help: most of the benchmarks' options with a default (latency's
    --input-len 128, load-test's --warmup 2, ...) and the engine flags (--max-num-batched-tokens,
    --max-model-len, --num-kv-blocks, ...) had no help text, so --help did not say what a bare run does."""
    import argparse
    import importlib
    parser = importlib.import_module(f"pcg_engine.bench.{name}").make_parser()
    entries, current = {}, None        # flag -> its entry in the help, on one line
    for line in parser.format_help().splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            entries[current] = line
        elif line.startswith("    ") and current is not None:
            entries[current] += " " + line.strip()
        else:
            current = None
    for action in parser._actions:
        if not action.option_strings or action.help is argparse.SUPPRESS:
            continue
        flag = action.option_strings[0]
        block = " ".join(entries[flag].split()[1:])
        if action.default not in (None, argparse.SUPPRESS, [], ()) and not isinstance(action.default, bool):
            assert "default" in block, f"{name} {flag}: {block!r}"
        if flag in ("--max-num-batched-tokens", "--max-model-len", "--num-kv-blocks", "--gpu-memory-utilization",
                    "--attention-backend"):
            assert "default" in block and len(block) > 30, f"{name} {flag}: {block!r}"


def test_cli_dispatches_bench(capsys):
    from pcg_engine.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "load-test", "--help"])
    assert exit_info.value.code == 0 and "--request-rate" in capsys.readouterr().out


def test_load_test_time_limit_fails_the_rest_and_leaves_the_engine_idle(tmp_path):
    out = tmp_path / "load.json"
    rc = load_test.main(["--device", "cpu", "--modes", "eager", "--num-prompts", "4", "--input-len", "8",
                         "--output-len", "400", "--timeout", "0.3", "--warmup", "0", "--no-progress",
                         "--json", str(out)])
    data = read(out)
    assert rc == 1 and data["failed"] >= 1 and data["completed"] + data["failed"] == 4
    # Found by probing: the run lasted until its stop, not its last token (duration ended there), and
    # a request stopped after its first tokens counts them (its row read output_len 0 beside a TTFT).
    assert data["duration_s"] >= 0.3
    for row in data["requests"]:
        assert (row["output_len"] > 0) == (row["ttft_ms"] is not None), row


def test_load_test_dataset_records_no_input_len_and_warms_up_as_it_measures(tmp_path, monkeypatch):
    """Found by probing: with --dataset the JSON's config recorded input_len 1024 (no request had
    it), and the warm-up ran without --detokenize, so the measured run paid the tokenizer's warm-up."""
    from pcg_engine.llm import LLM
    seen = []
    generate = LLM.generate

    def spy(self, prompts, params=None, *a, **k):
        # (the warm-up gives each prompt its own parameters: a list)
        seen.extend(p.detokenize for p in (params if isinstance(params, list) else [params]))
        return generate(self, prompts, params, *a, **k)
    monkeypatch.setattr(LLM, "generate", spy)
    data_file = tmp_path / "d.jsonl"
    data_file.write_text('{"prompt": [1, 2, 3], "output_len": 2}\n' * 2)
    out = tmp_path / "load.json"
    rc = load_test.main(["--device", "cpu", "--modes", "eager", "--dataset", str(data_file), "--warmup", "1",
                         "--detokenize", "--no-progress", "--json", str(out)])
    data = read(out)
    assert rc == 0 and data["config"]["input_len"] is None and seen == [True]


def test_load_test_time_limit_between_slow_arrivals(tmp_path, capsys):
    """Found by probing: at a low rate the time limit passed while the client slept until its next
    submission (~10 s here); the run waited for it, then reported only the request it had sent,
    completed, with exit 0. Now the client wakes at the stop and the unsent requests fail."""
    out = tmp_path / "load.json"
    t0 = time.monotonic()
    rc = load_test.main(["--device", "cpu", "--modes", "eager", "--num-prompts", "3", "--input-len", "4",
                         "--output-len", "2", "--request-rate", "0.1", "--timeout", "0.5", "--warmup", "0",
                         "--no-progress", "--json", str(out)])
    elapsed = time.monotonic() - t0
    data = read(out)
    assert rc == 1 and data["completed"] == 1 and data["failed"] == 2
    assert [r["id"] for r in data["requests"]] == ["eager-0", "eager-1", "eager-2"]
    assert data["requests"][2]["error"] == "never sent: the run stopped first"
    assert data["slo_attainment"] is None and elapsed < 8
    # why the run exited 1, on the terminal too (it was in the JSON alone)
    assert "eager: 2 of 3 requests failed: 2 x never sent: the run stopped first" in capsys.readouterr().err


def test_load_test_time_limit_with_a_tiny_rate(tmp_path):
    """Found by probing: --request-rate 1e-300 (allowed: > 0) draws gaps of ~1e300 s; sleeping one
    raised OverflowError in the client thread and the run ended in a KeyError traceback. Now the
    client waits in slices, so --timeout stops it like any other run."""
    out = tmp_path / "load.json"
    rc = load_test.main(["--device", "cpu", "--modes", "eager", "--num-prompts", "2", "--input-len", "4",
                         "--output-len", "2", "--request-rate", "1e-300", "--timeout", "0.3", "--warmup", "0",
                         "--no-progress", "--json", str(out)])
    data = read(out)
    assert rc == 1 and data["completed"] == 1 and data["failed"] == 1


def test_engine_loop_wait_stop_wakes_at_the_stop():
    import threading
    from pcg_engine.bench.engine_thread import EngineLoop
    loop = EngineLoop(engine=None)
    assert loop.wait_stop(0.01) is False and loop.wait_stop(float("nan")) is False
    threading.Timer(0.1, loop.stop).start()
    t0 = time.monotonic()
    assert loop.wait_stop(float("inf")) is True and time.monotonic() - t0 < 5
    assert loop.wait_stop(1e300) is True


def test_env_record_commit_falls_back_and_can_be_given(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "REPO_ROOT", tmp_path)          # a copy without .git
    monkeypatch.delenv("PCG_COMMIT", raising=False)
    assert common.git_commit() == "unknown"
    monkeypatch.setenv("PCG_COMMIT", "abc123")
    env = common.env_record("m", "cpu")
    assert env["commit"] == "abc123" and env["device"].startswith("CPU") and env["torch"]
    assert common.git_commit() == "abc123"          # host_drift.py and the other scripts record it too


def test_profile_analysis_idle_overall_and_from_the_second_step():
    from pcg_engine.bench import profile_analysis
    step = dict(ph="X", cat="user_annotation", name="pcg.step", tid=1)
    kernel = dict(ph="X", cat="kernel", name="k")
    trace = {"traceEvents": [
        {**step, "ts": 0, "dur": 10}, {**step, "ts": 10, "dur": 10},
        {**kernel, "ts": 5, "dur": 3}, {**kernel, "ts": 12, "dur": 8}, {**kernel, "ts": 20, "dur": 10}]}
    r = profile_analysis.analyze(trace, on_cuda=True)
    # Busy 21 of the 25 µs from the first kernel; from step 2's start (10) on: 18 of 20.
    assert r["idle_fraction"] == pytest.approx(4 / 25)
    assert r["steady_idle_fraction"] == pytest.approx(2 / 20)
    assert r["kernels_per_step"] == 1.5 and r["gaps_per_step"] == 0.5   # touching kernels merge



def test_profile_analysis_splits_steady_idle_inside_and_outside_graph_launches():
    from pcg_engine.bench import profile_analysis
    step = dict(ph="X", cat="user_annotation", name="pcg.step", tid=1)

    def k(ts, dur, corr):
        return dict(ph="X", cat="kernel", name="k", ts=ts, dur=dur, args={"correlation": corr})
    # Step 2 starts at 10: a graph launch (correlation 7) with a 1 µs gap between its two kernels,
    # then a 3 µs wait for the next launch (correlation 8), then an eager kernel after 2 µs.
    trace = {"traceEvents": [
        {**step, "ts": 0, "dur": 10}, {**step, "ts": 10, "dur": 20},
        k(2, 8, 1), k(10, 4, 7), k(15, 4, 7), k(22, 3, 8), k(27, 3, 9)]}
    r = profile_analysis.analyze(trace, on_cuda=True)
    # From 10 to 30: busy 4 + 4 + 3 + 3 = 14, idle 6, of which 1 inside graph launch 7.
    assert r["steady_idle_fraction"] == pytest.approx(6 / 20)
    assert r["steady_idle_in_graphs_fraction"] == pytest.approx(1 / 20)
    assert r["steady_idle_outside_graphs_fraction"] == pytest.approx(5 / 20)


def test_profile_analysis_kernel_table_by_name_per_step():
    from pcg_engine.bench import profile_analysis
    step = dict(ph="X", cat="user_annotation", name="pcg.step", tid=1)

    def k(name, ts, dur):
        return dict(ph="X", cat="kernel", name=name, ts=ts, dur=dur)
    trace = {"traceEvents": [{**step, "ts": 0, "dur": 10}, {**step, "ts": 10, "dur": 10},
                             k("gemm", 0, 4), k("norm", 4, 1), k("gemm", 10, 6), k("norm", 16, 3)]}
    table = profile_analysis.analyze(trace, on_cuda=True)["kernel_table"]
    assert [r["kernel"] for r in table] == ["gemm", "norm"]
    assert table[0]["calls_per_step"] == 1 and table[0]["us_per_step"] == 5 and table[0]["us_per_call"] == 5
    assert table[1]["us_per_step"] == 2 and table[0]["share"] == pytest.approx(10 / 14)
    assert profile_analysis.kernel_table(trace["traceEvents"][2:], steps=2, top=1)[0]["kernel"] == "gemm"


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_host_profile_script_runs(phase, capsys, monkeypatch):
    script = Path(__file__).resolve().parents[2] / "scripts" / "host_profile.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--model", "tiny-qwen3", "--mode", "eager", "--requests", "2",
                                      "--prompt-len", "8", "--steps", "2", "--top", "5", "--phase", phase])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(script), run_name="__main__")
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert f"=== cProfile, mode eager, 2 requests, {phase}, 2 steps" in out and "function calls" in out


BAD_FLAGS = [
    (load_test, ["--num-prompts", "0"]), (load_test, ["--input-len", "0"]), (load_test, ["--output-len", "-1"]),
    (load_test, ["--range-ratio", "1"]), (load_test, ["--request-rate", "-1"]), (load_test, ["--request-rate", "nan"]),
    (load_test, ["--burstiness", "0"]), (load_test, ["--max-concurrency", "0"]),
    (load_test, ["--sweep-rates", "--sweep-attainment", "1.5"]), (load_test, ["--timeout", "0"]), (load_test, ["--warmup", "x"]),
    (throughput, ["--num-prompts", "0"]), (throughput, ["--input-min", "0"]), (throughput, ["--output-len", "0"]),
    (throughput, ["--range-ratio", "-0.1"]), (throughput, ["--input-min", "50", "--input-max", "10"]),
    (latency, ["--num-iters", "0"]), (latency, ["--output-len", "1"]), (latency, ["--batch-size", "0"]),
    (latency, ["--warmup-iters", "-1"]), (overhead, ["--requests", "0"]), (overhead, ["--host-steps", "0"]),
    (profile, ["--steps", "0"])]


@pytest.mark.parametrize("module, flags", BAD_FLAGS,
                         ids=[f"{m.__name__.rsplit('.', 1)[-1]}{''.join(f)}" for m, f in BAD_FLAGS])
def test_benchmarks_refuse_bad_flags_before_building_an_engine(module, flags, monkeypatch, capsys):
    """Each bad value is refused with the flag's name and its range, and no engine is built for it."""
    monkeypatch.setattr(common, "build_llm", lambda *a, **k: pytest.fail("an engine was built"))
    monkeypatch.setattr(common, "resolve_model", lambda *a, **k: pytest.fail("a model was resolved"))
    with pytest.raises(SystemExit) as e:
        module.main(["--model", "tiny-qwen3", "--device", "cpu", *flags])
    message = str(e.value) + capsys.readouterr().err      # SystemExit's text, or argparse's error line
    assert flags[-2] in message or flags[0] in message
    assert "must be" in message


def test_throughput_range_ratio_without_a_length_is_refused(monkeypatch):
    """Found by following the help: --range-ratio spreads --input-len / --output-len, and with
    neither (P2's ranges, --input-min..--input-max) it was dropped without a word."""
    monkeypatch.setattr(common, "resolve_model", lambda *a, **k: pytest.fail("a model was resolved"))
    with pytest.raises(SystemExit) as e:
        throughput.main(["--model", "tiny-qwen3", "--device", "cpu", "--range-ratio", "0.5"])
    assert str(e.value) == ("pcg bench throughput: --range-ratio spreads --input-len and --output-len, and "
                            "neither is given (the lengths come from --input-min..--input-max and "
                            "--output-min..--output-max); give one of them, or leave out --range-ratio")
    args = throughput.parse_args(["--input-len", "64", "--range-ratio", "0.5"])    # with one, taken
    assert args.range_ratio == 0.5


def test_load_test_accepts_the_defaults():
    load_test.check_args(load_test.make_parser().parse_args([]))


def test_host_drift_windows_and_clocks(tmp_path, monkeypatch):
    """scripts/host_drift.py: one record per window with this process's main-thread CPU, and the
    GPU clocks parsed from nvidia-smi's CSV (a stand-in here; None without nvidia-smi)."""
    drift = runpy.run_path(str(REPO / "scripts" / "host_drift.py"))
    out = tmp_path / "drift.json"
    assert drift["main"](["--model", "tiny-qwen3", "--mode", "eager", "--windows", "2", "--tokens", "4",
                          "--json", str(out)]) == 0
    data = read(out)
    assert [w["window"] for w in data["windows"]] == [0, 1]
    assert all(w["tpot_ms"] > 0 for w in data["windows"]) and data["threads_at_ready"]
    assert all(w["cpu_probe_python_us"] > 0 for w in data["windows"])    # the host's speed before each window
    host = data["windows"][1]["host"]
    assert 0 <= host["cpu"] < os.cpu_count() and host["involuntary_switches"] >= 0 and host["steal_s"] >= 0
    assert host["minflt"] >= 0 and host["rss_kb"] > 0 and "anon_huge_kb" in host
    signals = drift["host_signals"]()
    assert signals["cpu"] in os.sched_getaffinity(0) and signals["voluntary_switches"] >= 0
    before = drift["thread_cpu"]()
    t0 = time.process_time()
    while time.process_time() - t0 < 0.05:   # 5 clock ticks of CPU on this thread
        pass
    assert sum(drift["_delta"](drift["thread_cpu"](), before).values()) > 0
    clocks = drift["gpu_clocks"]
    monkeypatch.setattr(drift["shutil"], "which", lambda name: None)
    assert clocks() is None

    class Done:
        stdout = "1980, 3201\n1755, 3201\n"
    monkeypatch.setattr(drift["shutil"], "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(drift["subprocess"], "run", lambda *a, **k: Done())
    assert clocks() == {"sm_mhz": [1980, 1755], "mem_mhz": [3201, 3201]}


@pytest.mark.parametrize("flags, expected", [
    (["--sweep-rates", "--sweep-start", "0"], "--sweep-start must be a finite number > 0"),
    (["--sweep-rates", "--sweep-start", "nan"], "--sweep-start must be a finite number > 0"),
    (["--sweep-rates", "--sweep-start", "-1"], "--sweep-start must be a finite number > 0"),
    # gaps of NaN (sent at once), of inf, or a ZeroDivisionError traceback
    (["--burstiness", "1e-320", "--request-rate", "1"], "--request-rate 1 with --burstiness 9.99989e-321 gives no "
     "finite gap between requests"),
    (["--request-rate", "1e-320"], "--request-rate 9.99989e-321 with --burstiness 1 gives no finite gap"),
    (["--request-rate", "1e-200", "--burstiness", "1e-200"], "gives no finite gap between requests"),
    (["--sweep-rates", "--burstiness", "1e-308"], "--sweep-rates tries rates down to 0.0625 req/s, which with "
     "--burstiness 1e-308 give no finite gap"),       # (rate inf: the sweep starts at 4 and halves)
    # random-prompt flags with --dataset were dropped without a word
    (["--dataset", "d.jsonl", "--shared-prefix-len", "5"], "--shared-prefix-len shapes the random prompts; with "
     "--dataset the file gives the prompts and output lengths: leave out --shared-prefix-len \\(got 5\\)"),
    (["--dataset", "d.jsonl", "--range-ratio", "0.5"], "leave out --range-ratio \\(got 0.5\\)"),
    (["--dataset", "d.jsonl", "--input-len", "64"], "leave out --input-len \\(got 64\\)"),   # (its default was 1024)
])
def test_load_test_refuses_before_building_an_engine(flags, expected):
    """Found by probing: --seed -1 failed inside numpy after the engine was built, --sweep-start 0
    was taken as unset and NaN swept at rate nan."""
    with pytest.raises(SystemExit, match=expected):
        load_test.check_args(load_test.make_parser().parse_args(flags))


@pytest.mark.parametrize("module", [latency, throughput, load_test])
def test_a_mode_this_device_cannot_build_is_refused_before_any_runs(module, monkeypatch):
    """Found by probing: --modes eager,full_decode on the CPU ran the whole eager benchmark, then the
    second engine's ConfigError ('mode: ...', not naming --modes) threw the first result away."""
    monkeypatch.setattr(common, "build_llm", lambda *a, **k: pytest.fail("an engine was built"))
    with pytest.raises(SystemExit) as e:
        module.main(["--model", "tiny-qwen3", "--device", "cpu", "--modes", "eager,full_decode",
                     "--attention-backend", "torch", "--input-len", "4", "--output-len", "2"])
    # the engine's own message (EngineConfig.check_mode_backend), named under --modes, with the
    # flag that sets the other field it suggests (it said attention_backend='triton')
    assert str(e.value) == ("--modes: 'full_decode': 'full_decode' replays whole-step CUDA graphs and needs a "
                            "graph-safe attention backend; 'torch' is not; allowed with it: eager, compile, piecewise "
                            "(or --attention-backend triton, which on the CPU needs TRITON_INTERPRET=1)")


@pytest.mark.parametrize("module", [latency, throughput, load_test, overhead, profile])
@pytest.mark.parametrize("flags, expected", [
    (["--seed", "-1"], "argument --seed: must be an integer >= 0, got -1"),
    (["--temperature", "-1"], "argument --temperature: must be a finite number in [0, 1e6] (0 means greedy), got -1.0"),
    (["--temperature", "nan"], "argument --temperature: must be a finite number in [0, 1e6] (0 means greedy), got nan"),
    (["--temperature", "hot"], "argument --temperature: must be a finite number in [0, 1e6] (0 means greedy), got 'hot'"),
    (["--temperature", "1e39"], "argument --temperature: must be a finite number in [0, 1e6] (0 means greedy), got 1e+39"),
])
def test_seed_and_temperature_refused_at_parse_time(module, flags, expected, monkeypatch, capsys):
    """Found by probing: --seed -1 was a numpy ValueError traceback (latency, throughput), and a
    --temperature SamplingParams refuses was named only after the engine was built (throughput,
    load-test; a minute on a GPU). Benchmarks without --temperature refuse it as unknown."""
    monkeypatch.setattr(common, "build_llm", lambda *a, **k: pytest.fail("an engine was built"))
    if flags[0] == "--temperature" and module not in (throughput, load_test):
        expected = "unrecognized arguments: --temperature"
    with pytest.raises(SystemExit) as e:
        module.main(["--model", "tiny-qwen3", "--device", "cpu", *flags])
    assert e.value.code == 2 and expected in capsys.readouterr().err


@pytest.mark.parametrize("items, expected", [(["ttft:nan"], "finite number > 0"), (["ttft:inf"], "finite number > 0"),
                                             (["ttft:10", "ttft:20"], "ttft is given twice")])
def test_goodput_refuses_nan_and_repeats(items, expected):
    from pcg_engine.bench.load_metrics import parse_slos
    with pytest.raises(SystemExit, match=expected):
        parse_slos(items)
    assert parse_slos(["ttft:200", "tpot:20"]) == {"ttft": 200.0, "tpot": 20.0}


def test_block_manager_bench_runs_both_trees(capsys):
    """scripts/bench_block_manager.py: grow (evicting) and publish at P4's shape, this tree alternated
    with a base commit's block manager; each set-up does the work it says (one block per row)."""
    bench = runpy.run_path(str(REPO / "scripts" / "bench_block_manager.py"))
    grow = bench["grow_case"](bench["this_tree"], 8)
    assert len(grow()) == 8
    # The base side publishes with the commit's bulk_publish.py, not this tree's.
    assert bench["module_at"]("HEAD").publish_rows.__code__.co_filename == "HEAD:bulk_publish.py"
    bench["main"](["--rows", "8", "--reps", "2", "--base-ref", "HEAD"])
    out = capsys.readouterr().out
    assert out.count("grow, evicting") == 2 and out.count("publish") == 2 and "HEAD" in out


@pytest.mark.parametrize("module, flags, named", [
    (latency, ["--input-len", "30", "--output-len", "40"], "--input-len / --output-len: the longest request is 30 "
     "prompt + 40 output tokens, more than max_model_len 64"),
    (throughput, ["--input-len", "30", "--output-len", "40"], "--input-len / --output-len: the longest request"),
    (throughput, ["--input-max", "50", "--input-min", "1", "--output-len", "20", "--range-ratio", "0.5"],
     "--input-max / --output-len / --range-ratio: the longest request is 50 prompt + 30 output tokens"),
    (latency, ["--input-len", "30", "--output-len", "4", "--num-kv-blocks", "3"], "--input-len / --output-len: the "
     "longest request is 30 prompt + 4 output tokens, more than the 32 tokens of the KV cache (--num-kv-blocks 3); "
     "lower them or raise --num-kv-blocks"),
    # overhead and profile: the engine refused each request under prompt_token_ids / max_tokens
    (overhead, ["--prompt-len", "60", "--new-tokens", "8"], "--prompt-len / --new-tokens: the longest request is "
     "60 prompt + 8 output tokens, more than max_model_len 64"),
    (overhead, ["--host-only", "--batch-sizes", "4", "--prompt-len", "55", "--host-steps", "3", "--warm-steps", "1"],
     "--prompt-len / --host-steps / --warm-steps: the longest request is 55 prompt + 11 output tokens"),
    (profile, ["--prompt-len", "60"], "--prompt-len / --steps / --warm-steps: the longest request is 60 prompt + "
     "19 output tokens"),
])
def test_benchmarks_refuse_requests_longer_than_max_model_len_before_building_an_engine(module, flags, named,
                                                                                       monkeypatch):
    """Found by probing: latency and throughput built the engine first, then each request was refused
    under prompt_token_ids / max_tokens (or a message naming no flag)."""
    monkeypatch.setattr(common, "build_llm", lambda *a, **k: pytest.fail("an engine was built"))
    with pytest.raises(SystemExit) as e:
        module.main(["--model", "tiny-qwen3", "--device", "cpu", "--max-model-len", "64", *flags])
    assert named in str(e.value) and "raise --" in str(e.value)


def test_load_test_warmup_default_fits_a_short_dataset():
    """--warmup's default (2) is cut to a one-line dataset's size; a --warmup given is not (refused above)."""
    from pcg_engine.bench.load_test_requests import resolve_num_prompts
    args = load_test.make_parser().parse_args(["--dataset", "d.jsonl"])
    resolve_num_prompts(args, [(1, [5, 6], None)])
    assert (args.warmup, args.num_prompts) == (1, 1)
    args = load_test.make_parser().parse_args([])
    resolve_num_prompts(args, None)
    assert (args.warmup, args.num_prompts) == (2, 500)


@pytest.mark.parametrize("flags, expected", [
    (["--request-rate", "1e-300", "--num-prompts", "2"], "at --request-rate 1e-300 req/s the 2 requests' submissions "
     "span 1e+300 s on average (1 gaps of 1 / rate), more than a day; raise the rate, lower --num-prompts, or give "
     "--timeout"),
    (["--request-rate", "0.001", "--num-prompts", "100"], "the 100 requests' submissions span 9.9e+04 s"),
    (["--sweep-rates", "--goodput", "ttft:100", "--sweep-start", "1e-3", "--num-prompts", "1"],
     "at --sweep-rates' lowest rate 1.5625e-05 req/s the 100 requests' submissions span"),
])
def test_load_test_refuses_a_schedule_longer_than_a_day_without_a_timeout(flags, expected, monkeypatch):
    """Found by a review (session 40): --request-rate 1e-300 (allowed: > 0) sent one request and
    then waited for ever for the next; refused now before an engine is built, unless --timeout
    bounds the run (test_load_test_time_limit_with_a_tiny_rate)."""
    monkeypatch.setattr(common, "build_llm", lambda *a, **k: pytest.fail("an engine was built"))
    with pytest.raises(SystemExit) as e:
        load_test.main(["--model", "tiny-qwen3", "--device", "cpu", "--input-len", "4", "--output-len", "2", *flags])
    assert expected in str(e.value)


def test_load_test_sweep_needs_two_requests_a_trial(capsys):
    """Found by a review (session 40): a sweep trial of one request sends it at once whatever the
    rate, so every trial was the same run."""
    with pytest.raises(SystemExit):
        load_test.make_parser().parse_args(["--sweep-rates", "--sweep-num-prompts", "1"])
    assert "argument --sweep-num-prompts: must be an integer >= 2, got 1" in capsys.readouterr().err


def test_load_test_one_request_says_the_rate_has_no_effect(tmp_path, capsys):
    rc = load_test.main(["--device", "cpu", "--modes", "eager", "--num-prompts", "1", "--input-len", "4",
                         "--output-len", "2", "--request-rate", "5", "--warmup", "0", "--no-progress"])
    assert rc == 0
    assert "note: one request is sent at once: --request-rate 5 has no effect" in capsys.readouterr().err
    # --request-rate starts a sweep: it has an effect there (found by a review, session 41)
    assert load_test.main(["--device", "cpu", "--modes", "eager", "--num-prompts", "1", "--input-len", "4",
                           "--output-len", "2", "--request-rate", "5", "--warmup", "0", "--no-progress",
                           "--sweep-rates", "--goodput", "ttft:1e9", "--sweep-num-prompts", "2", "--sweep-bisect", "0",
                           "--json", str(tmp_path / "sw.json")]) == 0
    assert "note: one request" not in capsys.readouterr().err
    assert read(tmp_path / "sw.json")["sweep"]["eager"]["trials"][0]["rate"] == 5.0


def test_load_test_table_says_n_a_for_a_missing_goodput_and_the_sweep_title_reads_its_slos():
    """Found by a review (session 40): the goodput row of a run without --goodput read "None" where
    the latency rows read n/a, and the sweep's title printed a Python dict."""
    from pcg_engine.bench.load_metrics import summarize, table_rows
    res = summarize([], 0.0, 1.0, {})
    headers, rows = table_rows({"eager": res})
    assert dict((row[0], row[1]) for row in rows)["goodput"] == "n/a"
    assert load_test.slo_text({"ttft": 200.0, "tpot": 20.5}) == "ttft <= 200 ms, tpot <= 20.5 ms"


def test_load_test_goodput_repeated_adds_its_slos():
    """Found by a review: a second --goodput replaced the first's SLOs without a word (an impossible
    TTFT objective given first was dropped, and the run read 100% attainment)."""
    make_parser = load_test.make_parser
    args = make_parser().parse_args(["--goodput", "ttft:0.001", "--goodput", "tpot:100"])
    assert parse_slos(args.goodput) == {"ttft": 0.001, "tpot": 100.0}
    with pytest.raises(SystemExit, match="--goodput: ttft is given twice"):
        parse_slos(make_parser().parse_args(["--goodput", "ttft:1", "--goodput", "ttft:2"]).goodput)


def test_a_size_list_given_twice_is_refused():
    """Found by probing (session 41): overhead --batch-sizes 4,2,4 measured 4 twice and reported the
    second figure for both, the first dropped."""
    import argparse
    parse = common.int_list_at_least(1, 4096)
    assert parse("4,2") == [4, 2]
    with pytest.raises(argparse.ArgumentTypeError, match="4 is given twice in '4,2,4'; give each once"):
        parse("4,2,4")
