"""TRITON_INTERPRET read as Triton reads it (1, true, on, yes, y in any case; not stripped), in every
place the project asks whether kernels run in the interpreter. It read "1" alone in three: with
TRITON_INTERPRET=true Triton interpreted while the attention launcher took its GPU fast path, and the
first step failed deep in Triton with "0 active drivers"; EngineConfig took " 1" (which Triton does
not) and refused "yes" (which it does)."""

import json
import os
import subprocess
import sys

import pytest

from pcg_engine.config import EngineConfig
from pcg_engine.errors import ConfigError
from pcg_engine.kernels import triton_interpreting
from tiny_checkpoints import build_tiny


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("TRUE", True), ("on", True), ("yes", True),
                                       ("y", True), ("0", False), ("", False), (" 1", False), ("2", False)])
def test_the_variable_is_read_as_triton_reads_it(value, on, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_interpreting() is on
    # The same answer as Triton's own knob (it reads the environment on each access).
    from triton import knobs
    assert knobs.runtime.interpret is on
    config = EngineConfig(device="cpu", kernels=True)
    if on:
        config.check_triton_usable("cpu")
    else:
        with pytest.raises(ConfigError, match="kernels: True runs Triton kernels"):
            config.check_triton_usable("cpu")


_RUN = """
import json, sys
from pcg_engine.llm import LLM
from pcg_engine.sampling_params import SamplingParams
llm = LLM(sys.argv[1], device="cpu", dtype="float32", attention_backend="triton", kernels=True, max_model_len=64)
outs = llm.generate([[5, 6, 7, 8], [9] * 11], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
print(json.dumps([o.token_ids for o in outs]))
"""


def test_the_moe_model_runs_the_triton_kernels_with_interpret_true(tmp_path_factory):
    """End to end in a fresh process (the variable is read at import): the tiny MoE model with the
    Triton attention backend and kernels under TRITON_INTERPRET=true gives the tokens it gives under
    TRITON_INTERPRET=1 (this process's setting)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from pcg_engine.llm import LLM
    from pcg_engine.sampling_params import SamplingParams

    path = build_tiny(tmp_path_factory.getbasetemp(), "tiny-qwen3-moe")
    with LLM(str(path), device="cpu", dtype="float32", attention_backend="triton", kernels=True,
             max_model_len=64) as llm:
        want = [o.token_ids for o in llm.generate([[5, 6, 7, 8], [9] * 11],
                                                  SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))]
    import pcg_engine
    root = os.path.dirname(os.path.dirname(pcg_engine.__file__))   # this tree's package, not an installed one
    env = dict(os.environ, TRITON_INTERPRET="true", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _RUN, str(path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == want
