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
