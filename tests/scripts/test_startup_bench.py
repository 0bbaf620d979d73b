"""pcg bench startup: both child processes share one private bytecode cache (PYTHONPYCACHEPREFIX, and
bytecode writing on) under the run's cache root, beside the compile, Inductor and Triton caches."""

import json

from pcg_engine.bench import startup


class FakeChild:
    envs = []

    def __init__(self, argv, stdout, stderr, text, env):
        FakeChild.envs.append(env)
        self.stdout = iter(["PCG_READY " + json.dumps({"timings": {}, "mode": "eager"}) + "\n"])
        self.returncode = 0

    def communicate(self):
        return "", ""


def test_children_share_a_private_pycache_prefix(monkeypatch, tmp_path):
    monkeypatch.setattr(startup.subprocess, "Popen", FakeChild)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")     # as on the GPU and development machines
    for _ in range(2):
        startup.run_once("model-dir", {}, str(tmp_path))
    cold, warm = FakeChild.envs[-2:]
    assert cold["PYTHONPYCACHEPREFIX"] == warm["PYTHONPYCACHEPREFIX"] == str(tmp_path / "pycache")
    assert cold["TRITON_CACHE_DIR"].startswith(str(tmp_path))
    assert "PYTHONDONTWRITEBYTECODE" not in cold and "PYTHONDONTWRITEBYTECODE" not in warm


def test_warm_ab_alternates_the_switch_over_one_cache(monkeypatch, tmp_path, capsys):
    """--warm-ab VAR=A,B: a cold run with VAR=A, a start with VAR=B (its compile-cache entry), then
    warm runs with VAR = A, B, A, B on those caches; --no-cold-bytecode leaves out the third kind of
    run."""
    monkeypatch.setattr(startup.subprocess, "Popen", FakeChild)
    monkeypatch.setattr(startup, "env_record", lambda model, device: {})   # it runs git through subprocess
    monkeypatch.delenv("PCG_X", raising=False)
    FakeChild.envs.clear()
    out = tmp_path / "ab.json"
    assert startup.main(["--model", str(tmp_path), "--warm-ab", "PCG_X=0,1", "--no-cold-bytecode",
                         "--json", str(out)]) == 0
    envs = FakeChild.envs
    # cold at the first value, one start priming the other's cache entry, then the alternation
    assert [e.get("PCG_X") for e in envs] == ["0", "1", "0", "1", "0", "1"]
    assert len({e["TRITON_CACHE_DIR"] for e in envs}) == 1          # one cache: the cold run's
    data = json.loads(out.read_text())
    assert [(w["env"], w["round"]) for w in data["warm"]] == [({"PCG_X": "0"}, 1), ({"PCG_X": "1"}, 1),
                                                             ({"PCG_X": "0"}, 2), ({"PCG_X": "1"}, 2)]
    assert data["cold_bytecode"] is None and [p["env"] for p in data["primes"]] == [{"PCG_X": "1"}]
    assert "PCG_X=1 #2" in capsys.readouterr().out      # the row of the last warm run


def test_warm_ab_flag_is_checked(tmp_path):
    import pytest
    for bad in ("PCG_X", "PCG_X=1", "=0,1", "A-B=0,1"):
        with pytest.raises(SystemExit):
            startup.main(["--model", str(tmp_path), "--warm-ab", bad])


def test_a_bad_setting_is_refused_naming_the_flag_before_any_run(monkeypatch, tmp_path, capsys):
    """Found by following the README: `pcg bench startup --device gpu` (or --max-num-seqs 5000, or
    --mode full_decode on the CPU) started a child process, which failed after its imports with a
    ConfigError traceback ('start-up run failed (exit 1)'); now one line naming the flag, no child."""
    from pcg_engine.cli import main
    FakeChild.envs.clear()
    monkeypatch.setattr(startup.subprocess, "Popen", FakeChild)
    for flags, expected in ((["--device", "gpu"], "error: --device (device): got 'gpu'; allowed: auto, cpu, cuda or cuda:N"),
                            (["--max-num-seqs", "5000"], "error: --max-num-seqs (max_num_seqs): got 5000; allowed: 1..4096"),
                            (["--device", "cpu", "--mode", "full_decode"], "error: --mode (mode): 'full_decode' replays")):
        assert main(["bench", "startup", "--model", str(tmp_path), *flags]) == 2
        assert capsys.readouterr().err.startswith(expected)
    assert FakeChild.envs == []


def test_a_child_writing_much_to_stderr_is_read_not_waited_on_for_ever(monkeypatch, tmp_path):
    """Found by a review: the child's stderr was a pipe read only at its end, so a child that wrote
    more than the pipe holds before its ready line (TORCH_LOGS=+dynamo, PYTHONVERBOSE=1) blocked in
    that write while the bench waited for the line, for ever. A thread with a timeout fails instead."""
    import threading

    import pytest
    ready = "print('PCG_READY ' + json.dumps({'timings': {}, 'mode': 'eager'}), flush=True)"
    results = {}

    def run(code, key):
        monkeypatch.setattr(startup, "_CHILD", code)
        try:
            results[key] = startup.run_once("model-dir", {}, str(tmp_path))
        except SystemExit as e:
            results[key] = e
    for code, key in [(f"import json, sys; sys.stderr.write('x' * (1 << 20)); sys.stderr.flush(); {ready}", "ready"),
                      ("import sys; sys.stderr.write('y' * (1 << 20) + 'the end'); sys.exit(3)", "failed")]:
        thread = threading.Thread(target=run, args=(code, key), daemon=True)
        thread.start()
        thread.join(60)
        if thread.is_alive():
            pytest.fail("the bench waited for ever on a child blocked writing its stderr")
    assert results["ready"]["mode"] == "eager" and results["ready"]["ready_s"] > 0
    assert str(results["failed"]).startswith("start-up run failed (exit 3):") and str(results["failed"]).endswith("the end")
