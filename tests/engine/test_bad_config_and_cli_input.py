"""Bad settings and bad CLI input get a clear error naming the field (or flag) and what it allows,
before anything is loaded: EngineConfig's device, and `pcg generate --prompts-file`."""

import argparse

import pytest

from pcg_engine.cli import _read_prompts
from pcg_engine.config import EngineConfig
from pcg_engine.errors import ConfigError


@pytest.mark.parametrize("device", ["bogus", "cuda:x", "cpu:0", "", "CUDA", "cuda:", " cpu"])
def test_device_outside_the_allowed_forms(device):
    with pytest.raises(ConfigError, match="device: got .*allowed: auto, cpu, cuda or cuda:N") as e:
        EngineConfig(device=device)
    assert e.value.field == "device"


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_forms_accepted(device):
    assert EngineConfig(device=device).device == device


def test_cpu_device_resolves_to_itself():
    assert EngineConfig(device="cpu").resolved_device() == "cpu"


def _args(path):
    return argparse.Namespace(prompt=[], prompts_file=str(path))


def test_prompts_file_plain_lines_and_jsonl(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text('first\n\n{"prompt": "second"}\nthird é\n', encoding="utf-8")
    assert _read_prompts(_args(path)) == ["first", "second", "third é"]


@pytest.mark.parametrize("content, expected", [
    (b"ok\n{\"prompt\": \"x\"\n", "line 2 is not valid JSON"),
    (b"{\"text\": \"x\"}\n", "line 1: JSONL line without a 'prompt' field"),
    (b"\xff\xfe bad\n", "is not UTF-8 text"),
    (b"\n\n", "give --prompt"),
])
def test_prompts_file_bad_content_is_named(tmp_path, content, expected):
    path = tmp_path / "p.txt"
    path.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        _read_prompts(_args(path))
    assert expected in str(e.value) and (expected == "give --prompt" or "--prompts-file" in str(e.value))


@pytest.mark.parametrize("name", ["missing.txt", "."])
def test_prompts_file_unreadable_is_named(tmp_path, name):
    with pytest.raises(SystemExit, match="--prompts-file: cannot read"):
        _read_prompts(_args(tmp_path / name))


def test_calls_after_close_name_the_closed_engine(tiny_paths):
    """generate, stream, add_request and step on a closed engine raise EngineClosedError (was an
    AttributeError from inside the step, after the request had been queued); close twice is fine."""
    from engine_helpers import make_llm
    from pcg_engine.errors import EngineClosedError
    llm = make_llm(tiny_paths["tiny-qwen3"])
    assert [len(o.token_ids) for o in llm.generate([[5, 6, 7]], {"max_tokens": 2})] == [2]
    llm.close()
    llm.close()
    with pytest.raises(EngineClosedError, match="add_request: the engine is closed"):
        llm.generate([[5, 6, 7]], {"max_tokens": 2})
    with pytest.raises(EngineClosedError):
        list(llm.stream([5, 6, 7], {"max_tokens": 2}))
    with pytest.raises(EngineClosedError, match="step: the engine is closed"):
        llm.engine.step()
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    from pcg_engine import cli

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "cmd_generate", interrupted)
    assert cli.main(["generate", "--prompt", "hi"]) == 130
    assert capsys.readouterr().err.strip() == "pcg: interrupted"
