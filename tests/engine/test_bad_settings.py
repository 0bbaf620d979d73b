"""Settings that are each in range but cannot work on this machine or with each other get a
ConfigError naming the field and what is allowed, before the weights load where config.json and
the device alone decide (DESIGN.md, "Bad input")."""

import pytest

from engine_helpers import make_llm
from pcg_engine.errors import ConfigError


@pytest.mark.parametrize("setting, field, allowed", [
    (dict(attention_backend="triton"), "attention_backend", "on cpu allowed: auto, torch"),
    (dict(kernels=True), "kernels", "on cpu allowed: None, False"),
])
def test_triton_on_a_cpu_without_its_interpreter_is_named(tiny_paths, monkeypatch, setting, field, allowed):
    """Before: Triton's own RuntimeError ('0 active drivers'), at the first launch after the load."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1") as e:
        make_llm(tiny_paths["tiny-qwen3"], **setting)
    assert e.value.field == field and allowed in str(e.value)


@pytest.mark.parametrize("mode", ["full_decode", "full_and_piecewise"])
def test_full_graph_mode_with_the_torch_backend_names_the_mode(tiny_paths, mode):
    """Before: a plain ValueError without a field, so `pcg generate` could not name --mode."""
    with pytest.raises(ConfigError, match=f"mode: '{mode}' replays whole-step CUDA graphs.*allowed with it: "
                                          "eager, compile, piecewise") as e:
        make_llm(tiny_paths["tiny-qwen3"], mode=mode, attention_backend="torch")
    assert e.value.field == "mode"


@pytest.mark.parametrize("setting, field", [(dict(num_kv_blocks=2**40), "num_kv_blocks"),
                                            (dict(cpu_kv_blocks=2**40), "cpu_kv_blocks")])
def test_a_kv_cache_larger_than_memory_names_the_field(tiny_paths, setting, field):
    """Before: the allocator's bare RuntimeError ('DefaultCPUAllocator: can't allocate memory')."""
    with pytest.raises(ConfigError, match=f"{field}: {2**40} KV blocks of 32768 bytes each .* cannot be allocated "
                                          "on cpu; allowed: as many as its free memory holds") as e:
        make_llm(tiny_paths["tiny-qwen3"], **setting)
    assert e.value.field == field
