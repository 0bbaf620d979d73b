"""Dynamo and Inductor imported in a thread during start-up (compile/background_import.py)."""

import importlib.util
import json
import subprocess
import sys
import textwrap

from pcg_engine.compile import background_import
from pcg_engine.compile.background_import import MODULES, BackgroundImport


def test_a_compiled_runner_joined_the_thread_before_its_set_up(dense_compile):
    thread = dense_compile.background_import
    assert thread is not None and not thread._thread.is_alive()
    assert thread.failed == [m for m in MODULES if importlib.util.find_spec(m) is None] == []
    assert dense_compile.timings["background_import_s"] > 0.0
    assert dense_compile.timings["background_import_wait_s"] >= 0.0
    assert all(m in sys.modules for m in MODULES)


def test_eager_starts_no_thread_and_the_switch_turns_it_off(dense_eager, monkeypatch):
    assert dense_eager.background_import is None and "background_import_s" not in dense_eager.timings
    monkeypatch.setenv("PCG_BACKGROUND_IMPORT", "0")
    assert background_import.start("piecewise") is None
    monkeypatch.setenv("PCG_BACKGROUND_IMPORT", "1")
    assert background_import.start("eager") is None and background_import.start("full_decode") is None


def test_a_failing_import_is_recorded_and_left_to_the_main_thread():
    thread = BackgroundImport(("pcg_no_such_module_for_the_test", "json"))
    assert thread.join() >= 0.0
    assert thread.failed == ["pcg_no_such_module_for_the_test"]
    assert "pcg_no_such_module_for_the_test" not in sys.modules


def test_an_eager_start_imports_nothing_the_thread_imports(tiny_dense):
    """What makes the thread safe: before the compile set-up joins it, the main thread imports none of
    its modules, so neither thread imports into the other's half-initialised modules. An eager start
    runs exactly those steps (device, weights, KV cache), in a fresh interpreter."""
    code = textwrap.dedent(f"""
        import json, sys
        from pcg_engine.engine.model_runner import ModelRunner
        from pcg_engine.config import EngineConfig
        import torch
        config = EngineConfig(model={str(tiny_dense)!r}, mode="eager", device="cpu", num_kv_blocks=16,
                              max_num_seqs=4, max_num_batched_tokens=32)
        ModelRunner(config, {str(tiny_dense)!r}, torch.device("cpu"))
        print(json.dumps(sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor")))))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
