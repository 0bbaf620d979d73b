"""`pcg generate` as a subprocess: with --model, without (the bundled default model, built into a
temporary cache), with --stream and with --json; its tokens equal the in-process engine's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_helpers import make_llm
from pcg_engine.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["The quick brown fox", "Café 中文 🙂"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory):
    """HOME and XDG_CACHE_HOME in a temporary directory: the default model is built there, never
    in the user's ~/.cache."""
    home = tmp_path_factory.mktemp("home")
    env = dict(os.environ, HOME=str(home), XDG_CACHE_HOME=str(home / "cache"), OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return env


def pcg(env, *args, check=True):
    argv = [sys.executable, "-m", "pcg_engine.cli", "generate", "--device", "cpu", "--max-tokens", str(MAX_TOKENS)]
    for p in PROMPTS:
        argv += ["--prompt", p]
    proc = subprocess.run(argv + list(args), env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, f"pcg {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc


def parse_json_lines(stdout: str) -> list[dict]:
    lines = [line for line in stdout.splitlines() if line.strip()]
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def in_process(dense_path):
    """What the engine produces in-process for the CLI's defaults (greedy, EOS honoured)."""
    llm = make_llm(dense_path)
    return llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))


def test_generate_json(cli_env, dense_path, in_process):
    rows = parse_json_lines(pcg(cli_env, "--model", str(dense_path), "--json").stdout)
    assert [r["prompt"] for r in rows] == PROMPTS
    for row, want in zip(rows, in_process):
        assert row["token_ids"] == want.token_ids
        assert row["text"] == want.text
        assert row["finish_reason"] == want.finish_reason
        assert row["ttft_s"] is not None and row["ttft_s"] >= 0 and row["e2e_s"] >= row["ttft_s"]


def test_generate_stream(cli_env, dense_path, in_process):
    """--stream prints the deltas as they come: the same text as the in-process run, one line per
    prompt; the summary goes to stderr."""
    stream = pcg(cli_env, "--model", str(dense_path), "--stream")
    assert stream.stdout == "".join(o.text + "\n" for o in in_process)
    assert "tokens in" in stream.stderr


def test_generate_json_stream(cli_env, dense_path, in_process):
    """--json --stream: a line per step that made tokens, then the prompt's object, prompt after
    prompt (it printed the objects alone, at the end: nothing streamed). The deltas add up to the
    object, which is --json's."""
    rows = parse_json_lines(pcg(cli_env, "--model", str(dense_path), "--json", "--stream").stdout)
    finals = [n for n, r in enumerate(rows) if "delta" not in r]
    assert len(finals) == len(PROMPTS)
    start = 0
    for i, (end, want) in enumerate(zip(finals, in_process)):
        deltas, final = rows[start:end], rows[end]
        assert deltas and all(d["index"] == i and d["token_ids"] for d in deltas)
        assert [t for d in deltas for t in d["token_ids"]] == final["token_ids"] == want.token_ids
        assert "".join(d["delta"] for d in deltas) == final["text"] == want.text
        assert final["prompt"] == PROMPTS[i] and final["finish_reason"] == want.finish_reason
        start = end + 1


def test_generate_stream_interrupted_ends_its_line(dense_path, monkeypatch, capsys):
    """A Ctrl-C in the middle of a streamed line: the line is ended before "pcg: interrupted" (the
    shell's prompt came up after the partial text, on the same line)."""
    from pcg_engine import cli
    from pcg_engine.llm import LLM

    def stream(self, prompt, params):
        for delta in real(self, prompt, params):
            yield delta
            raise KeyboardInterrupt
    real = LLM.stream
    monkeypatch.setattr(LLM, "stream", stream)
    assert cli.main(["generate", "--model", str(dense_path), "--device", "cpu", "--max-tokens", "8",
                     "--ignore-eos", "--prompt", PROMPTS[0], "--stream"]) == 130
    out = capsys.readouterr()
    assert out.out.endswith("\n") and out.out.strip() and out.out.count("\n") == 1
    assert out.err.strip().endswith("pcg: interrupted")


@pytest.mark.parametrize("flag", ["--json", "--stream"])
def test_generate_into_a_closed_pipe_exits_quietly(cli_env, dense_path, flag):
    """`pcg generate --json | head -1`: the reader goes away, and pcg stops with the shell's SIGPIPE
    code and no traceback (it printed a BrokenPipeError traceback from the print or the stream's
    write). The pipe's read end is closed before pcg starts, so every write fails."""
    argv = [sys.executable, "-m", "pcg_engine.cli", "generate", "--device", "cpu", "--max-tokens", "4",
            "--model", str(dense_path), "--prompt", PROMPTS[0], flag]
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(argv, env=cli_env, cwd=REPO, stdout=write_end, stderr=subprocess.PIPE, text=True,
                              timeout=300)
    finally:
        os.close(write_end)
    assert proc.returncode == 141, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_generate_default_model(cli_env, monkeypatch):
    """No --model: the bundled tiny model is built on first use into $XDG_CACHE_HOME, then reused."""
    from pcg_engine.llm import LLM
    from pcg_engine.models.checkpoint_maker import default_model_dir

    cache = Path(cli_env["XDG_CACHE_HOME"])
    rows = parse_json_lines(pcg(cli_env, "--json").stdout)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    built = default_model_dir()
    assert cache in built.parents and (built / "config.json").is_file()
    assert [d.name for d in built.parent.iterdir()] == [built.name]    # no half-built leftovers
    stamp = (built / "config.json").stat().st_mtime_ns
    llm = LLM(None, device="cpu")                # the same default, found in the cache
    assert llm.engine.model_path == built
    assert (built / "config.json").stat().st_mtime_ns == stamp          # reused, not rebuilt
    want = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert [r["token_ids"] for r in rows] == [o.token_ids for o in want]
    assert [r["text"] for r in rows] == [o.text for o in want]



def test_generate_dump_graph(dense_path, tmp_path, capsys, monkeypatch):
    """--dump-graph DIR writes the split forward of a compiled mode: the split graph and one file
    per submodule (2L+1 for L layers: L attention ops between L+1 pieces); in eager mode it is
    refused."""
    from pcg_engine import cli
    from pcg_engine.models.loader import load_config
    monkeypatch.setenv("PCG_SAVED_TRACE", "1")   # the option sets it to 0 in this process: undone after
    layers = load_config(dense_path).num_hidden_layers
    out = tmp_path / "graph"
    argv = ["generate", "--model", str(dense_path), "--device", "cpu", "--prompt", "hi", "--max-tokens", "2",
            "--dump-graph", str(out)]
    # an earlier dump's pieces (a deeper model's) are gone, not read as this model's; other files stay
    out.mkdir()
    for name in (f"{2 * layers + 5:03d}_submod_{2 * layers + 5}.py", "split_graph.py", "notes.txt"):
        (out / name).write_text("earlier\n")
    assert cli.main(argv + ["--mode", "piecewise"]) == 0
    assert (out / "notes.txt").read_text() == "earlier\n"
    (out / "notes.txt").unlink()
    names = sorted(p.name for p in out.iterdir())
    assert "split_graph.py" in names
    pieces = [n for n in names if n[:3].isdigit()]
    assert len(pieces) == 2 * layers + 1
    assert sum("splitting op" in (out / n).read_text().splitlines()[0] for n in pieces) == layers
    # traced in this start even where a saved trace exists, so every piece has its FX code
    assert "traced_graph.py" in names and all("def forward" in (out / n).read_text() for n in pieces)
    err = capsys.readouterr().err
    assert f"graph: {len(names)} files in {out}" in err
    # the load time's split, one line (compile/setup.py's timings)
    assert len([line for line in err.splitlines() if line.startswith("start-up: weights ")]) == 1
    assert "Dynamo " in err and "Inductor " in err
    assert cli.main(argv + ["--mode", "eager"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --dump-graph: needs a compiled mode (--mode compile, piecewise or full_and_piecewise); --mode "
        "eager compiles nothing")
    # --mode not given (session 31's probe: it said "--mode (mode): ...", after loading the weights)
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")
    monkeypatch.setattr("pcg_engine.llm.LLM", no_load)
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --dump-graph: needs a compiled mode (--mode compile, piecewise or full_and_piecewise); --mode "
        "auto, which runs 'eager' here, compiles nothing")


@pytest.mark.parametrize("where", ["under a file", "a file", "blank"])
def test_generate_dump_graph_path_is_checked_before_loading(dense_path, tmp_path, capsys, monkeypatch, where):
    """A --dump-graph it cannot write was refused after the weights loaded and the forward compiled
    (a minute on a GPU); a blank one was ignored."""
    from pcg_engine import cli
    monkeypatch.setenv("PCG_SAVED_TRACE", "1")
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")
    monkeypatch.setattr("pcg_engine.llm.LLM", no_load)
    blocker = tmp_path / "file"
    blocker.write_text("")
    target = {"under a file": str(blocker / "graph"), "a file": str(blocker), "blank": " "}[where]
    assert cli.main(["generate", "--model", str(dense_path), "--device", "cpu", "--prompt", "hi", "--mode", "compile",
                     "--dump-graph", target]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == {"blank": "error: --dump-graph: got ' '; allowed: a directory to write the graphs to",
                    "a file": f"error: --dump-graph: {target} is a file; give a directory",
                    "under a file": f"error: --dump-graph: cannot write to {target}: Not a directory"}[where]
    # checked after --model: a start refused for its model leaves no directory behind
    assert cli.main(["generate", "--model", str(tmp_path / "none"), "--device", "cpu", "--prompt", "hi",
                     "--mode", "compile", "--dump-graph", str(tmp_path / "graph")]) == 2
    assert not (tmp_path / "graph").exists()


def test_generate_engine_warnings_name_the_flags(dense_path, capsys):
    """A setting the mode leaves unread: one "warning:" line naming the flag typed (Python wrote
    ".../model_runner.py:94: UserWarning: EngineConfig: compile_cache=False ..." and the source
    line under it, in the API's names)."""
    from pcg_engine import cli
    assert cli.main(["generate", "--model", str(dense_path), "--device", "cpu", "--prompt", "hi", "--max-tokens", "2",
                     "--mode", "eager", "--no-compile", "--compile-cache-dir=/tmp/pcg-unused"]) == 0   # abbreviated
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == [
        "warning: --no-compile-cache (compile_cache=False) has no effect in mode 'eager', which compiles nothing "
        "(the compile cache serves compile, piecewise, full_and_piecewise)",
        "warning: --compile-cache-dir (compile_cache_dir='/tmp/pcg-unused') has no effect in mode 'eager', which "
        "compiles nothing (the compile cache serves compile, piecewise, full_and_piecewise)"]
    assert not any("UserWarning" in line for line in err)



def test_generate_engine_warning_of_a_field_names_the_flags(dense_path, tmp_path, capsys, monkeypatch):
    """"compile_cache_dir: cannot create ...; choose another directory (or compile_cache=False)", a
    read-only place (the start goes on without the cache): the flags, as the errors name them."""
    import errno
    from pcg_engine import cli
    from pcg_engine.compile import cache

    def read_only(path):      # as root (CI), a mode-0500 directory is writable: the error stands in
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(cache, "_make_private_dirs", read_only)
    assert cli.main(["generate", "--model", str(dense_path), "--device", "cpu", "--prompt", "hi", "--max-tokens", "2",
                     "--mode", "compile", "--compile-cache-dir", str(tmp_path / "cache")]) == 0
    warning, = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warning.startswith(f"warning: --compile-cache-dir (compile_cache_dir): cannot create {tmp_path / 'cache'}: "
                              "Read-only file system")
    assert "(or --no-compile-cache)" in warning and "compile_cache=False" not in warning


def test_generate_stop(cli_env, dense_path, in_process):
    """--stop TEXT (repeatable): the output ends before the first stop string, finish reason
    "stop", as SamplingParams(stop=...) gives in-process."""
    text = in_process[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), f"no usable stop string in {text!r}"
    rows = parse_json_lines(pcg(cli_env, "--model", str(dense_path), "--json", "--stop", stop,
                                "--stop", "\u2603never").stdout)
    llm = make_llm(dense_path)
    want = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop, "\u2603never"]))
    assert rows[0]["text"] == text[:text.index(stop)] and rows[0]["finish_reason"] == "stop"
    assert [(r["text"], r["finish_reason"]) for r in rows] == [(o.text, o.finish_reason) for o in want]


def test_startup_line_parts():
    from pcg_engine.cli import _startup_line
    assert _startup_line({"weight_load_s": 1.23, "kv_cache_s": 0.5}) == "start-up: weights 1.2 s, KV cache 0.5 s"
    t = {"weight_load_s": 0.3, "kv_cache_s": 0.6, "dynamo_s": 2.0, "inductor_s": 0.61, "compile_cache_hit": 1.0,
         "capture_s": 1.74, "graph_pool_mib": 190.2}
    assert _startup_line(t) == ("start-up: weights 0.3 s, KV cache 0.6 s, Dynamo 2.0 s, Inductor 0.6 s (compile cache "
                                "hit), capture 1.7 s, graph pool 190 MiB")
    assert "(compile cache off)" in _startup_line(dict(t, compile_cache_hit=0.0), compile_cache=False)
    assert "(compiled; cached for the next start)" in _startup_line(dict(t, compile_cache_hit=0.0))
    # a damaged entry, deleted and compiled again, is not reported as a first start
    assert "(compile cache entry was bad: rebuilt" in _startup_line(dict(t, compile_cache_hit=0.0,
                                                                          compile_cache_rebuilt=1.0))
    assert "(compile cache directory not writable: not cached)" in _startup_line(
        dict(t, compile_cache_hit=0.0, compile_cache_unwritable=1.0))


@pytest.mark.parametrize("flag", [None, "--stream"])
def test_generate_on_an_ascii_stdout_writes_escapes(cli_env, dense_path, in_process, flag):
    """Found by probing (session 31): on a stdout whose encoding cannot hold the text (here the
    second prompt's output holds U+FFFD), `print` raised UnicodeEncodeError, a traceback, and under
    --stream the error was reported as "error: 'ascii' codec ..." with exit 2, as if the input had
    been refused. Now the text is written escaped, as Python writes stderr."""
    assert not in_process[1].text.isascii()      # what makes this test bite
    env = dict(cli_env, PYTHONIOENCODING="ascii")
    proc = pcg(env, "--model", str(dense_path), *([flag] if flag else []))
    assert "Traceback" not in proc.stderr
    assert proc.stdout == "".join(o.text.encode("ascii", "backslashreplace").decode() + "\n" for o in in_process)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("flag", [None, "--json", "--stream"])
def test_generate_into_a_full_disk_says_so_in_one_line(cli_env, dense_path, flag):
    """Found by probing (session 31): `pcg generate ... > /dev/full` ended in an OSError traceback."""
    argv = [sys.executable, "-m", "pcg_engine.cli", "generate", "--device", "cpu", "--max-tokens", "4",
            "--model", str(dense_path), "--prompt", PROMPTS[0], *([flag] if flag else [])]
    with open("/dev/full", "w") as full:
        proc = subprocess.run(argv, env=cli_env, cwd=REPO, stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == "error: cannot write the results to stdout: No space left on device"
