"""Settings that are each in range but cannot work on this machine or with each other get a
ConfigError naming the field and what is allowed, before the weights load where config.json and
the device alone decide (DESIGN.md, "Bad input")."""

import pytest
import torch

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


def test_kv_sizing_that_leaves_no_room_names_gpu_memory_utilization():
    """Found by probing: a gpu_memory_utilization too low for the model's peak was a bare
    RuntimeError from the KV sizing (CUDA only; its arithmetic is tested here on plain numbers)."""
    from pcg_engine.engine.model_runner import KV_HEADROOM, kv_blocks_for
    gib, per_block = 2**30, 2**20
    assert kv_blocks_for(0.5, 80 * gib, 10 * gib, 0, per_block) == (40 * gib - 10 * gib - KV_HEADROOM) // per_block
    with pytest.raises(ConfigError) as info:
        kv_blocks_for(0.1, 80 * gib, 10 * gib, 2 * gib, per_block)
    needed = (10 * gib + 2 * gib + KV_HEADROOM + 2 * per_block) / (80 * gib)
    assert info.value.field == "gpu_memory_utilization"
    assert (f"0.1 of 80.0 GiB leaves no room for the KV cache (model peak 10.0 GiB, other processes 2.0 GiB); "
            f"allowed: at least {needed:.3f} (up to 1.0)") in str(info.value)
    with pytest.raises(ConfigError, match="allowed: none on this device"):
        kv_blocks_for(0.9, 80 * gib, 79 * gib, 2 * gib, per_block)


def test_kv_sizing_forward_out_of_memory_names_max_num_batched_tokens(monkeypatch):
    """Found by probing: a max_num_batched_tokens whose profile forward does not fit beside the
    weights failed with torch's bare OutOfMemoryError (CUDA only; the runner's sizing is driven
    here with the forward and the device's memory query stubbed)."""
    from types import SimpleNamespace

    from pcg_engine.engine.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    runner.config = SimpleNamespace(num_kv_blocks=None, gpu_memory_utilization=0.9)
    runner.device = torch.device("cuda", 0)
    runner.max_num_tokens = 262144

    def no_room():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 48.00 GiB")

    monkeypatch.setattr(runner, "_profile_peak", no_room)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * 2**30, 80 * 2**30))
    with pytest.raises(ConfigError) as info:
        runner._num_kv_blocks()
    assert info.value.field == "max_num_batched_tokens"
    assert ("a step of 262144 tokens ran out of GPU memory beside the weights (3.0 of 80.0 GiB free after it); "
            "allowed: a smaller value") in str(info.value)
