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


@pytest.mark.parametrize("setting", [dict(num_kv_blocks=64, gpu_memory_utilization=0.5),
                                     dict(num_kv_blocks=64, cpu_kv_blocks=128)])
def test_two_kv_sizes_in_one_config_are_refused(tiny_paths, setting):
    """Found by probing (session 30): num_kv_blocks silently won over a fraction or a CPU block count
    given beside it (the command line refused the first pair already)."""
    other = next(k for k in setting if k != "num_kv_blocks")
    with pytest.raises(ConfigError, match=f"{other}: got .*no effect with num_kv_blocks \\(64\\).*give one of "
                                          "the two") as e:
        make_llm(tiny_paths["tiny-qwen3"], **setting)
    assert e.value.field == other


@pytest.mark.parametrize("setting, mode, words", [
    (dict(gpu_memory_utilization=0.5), "eager", "gpu_memory_utilization=0.5 has no effect on cpu"),
    (dict(max_capture_tokens=64), "eager", "max_capture_tokens=64 has no effect in mode 'eager'"),
    # found by a review: `pcg generate --compile-cache-dir D` in eager mode wrote nothing, said nothing
    (dict(compile_cache_dir="/tmp/pcg-unused-cache"), "eager",
     "compile_cache_dir='/tmp/pcg-unused-cache' has no effect in mode 'eager', which compiles nothing"),
    (dict(compile_cache=False), "eager", "compile_cache=False has no effect in mode 'eager'"),
    (dict(max_capture_tokens=64, cudagraph_buckets=[2, 8]), "piecewise",
     "max_capture_tokens=64 has no effect with cudagraph_buckets \\(the largest bucket, 8"),
])
def test_a_setting_this_device_or_mode_never_reads_is_named(tiny_paths, setting, mode, words):
    """Found by probing (session 30): these were accepted and ignored without a word. A warning, not
    an error: one config that runs every mode or device (the benchmarks' --modes) stays valid, and
    the engine still serves."""
    from pcg_engine.sampling_params import SamplingParams
    with pytest.warns(UserWarning, match=f"EngineConfig: {words}"):
        llm = make_llm(tiny_paths["tiny-qwen3"], mode=mode, **setting)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False))
    assert len(out[0].token_ids) == 2
    llm.close()


def test_settings_at_their_defaults_or_read_here_warn_nothing(tiny_paths):
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="EngineConfig")
        make_llm(tiny_paths["tiny-qwen3"], mode="eager", cpu_kv_blocks=128, gpu_memory_utilization=0.85).close()
        make_llm(tiny_paths["tiny-qwen3"], mode="compile", max_capture_tokens=64).close()


@pytest.mark.parametrize("setting, mode, field", [
    (dict(kernels=False), "piecewise", "kernels"),
    (dict(kernels=False), "full_and_piecewise", "kernels"),
    (dict(kernels=False), "auto", "kernels"),              # full_and_piecewise on CUDA
    (dict(fuse=False), "full_decode", "fuse"),
])
def test_moe_reference_path_in_a_capturing_mode_is_refused(tiny_paths, setting, mode, field):
    """Found by review (session 31): a MoE model without the Triton kernels reads its routing back to
    the host in every forward (the reference op's bincount().tolist()), which a CUDA graph capture
    forbids: the start died in the capture with a CUDA error. Checked on CUDA's terms here (the
    check reads config.json only); the GPU test below builds the engines."""
    from pcg_engine.config import EngineConfig
    from pcg_engine.engine.model_runner import _check_moe_reference_in_graphs
    config = EngineConfig(model=str(tiny_paths["tiny-qwen3-moe"]), mode=mode, **setting)
    with pytest.raises(ConfigError, match=f"{field}: got False: a MoE model then runs its experts through the "
                                          "reference path.*allowed with this mode: kernels None or True with fuse "
                                          "True \\(or mode eager or compile\\)") as e:
        _check_moe_reference_in_graphs(config, tiny_paths["tiny-qwen3-moe"], "cuda")
    assert e.value.field == field


@pytest.mark.parametrize("preset, mode, device", [
    ("tiny-qwen3-moe", "compile", "cuda"),       # no capture
    ("tiny-qwen3-moe", "eager", "cuda"),
    ("tiny-qwen3-moe", "piecewise", "cpu"),      # no capture on the CPU
    ("tiny-qwen3", "full_and_piecewise", "cuda"),  # a dense model's unfused path is plain tensor ops
])
def test_moe_reference_path_where_nothing_captures_it_passes(tiny_paths, preset, mode, device):
    from pcg_engine.config import EngineConfig
    from pcg_engine.engine.model_runner import _check_moe_reference_in_graphs
    config = EngineConfig(model=str(tiny_paths[preset]), mode=mode, kernels=False)
    _check_moe_reference_in_graphs(config, tiny_paths[preset], device)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["piecewise", "full_decode", "full_and_piecewise"])
def test_gpu_moe_without_kernels_in_a_capturing_mode_is_refused(tiny_paths, mode):
    with pytest.raises(ConfigError) as e:
        make_llm(tiny_paths["tiny-qwen3-moe"], device="cuda", mode=mode, kernels=False)
    assert e.value.field == "kernels"
