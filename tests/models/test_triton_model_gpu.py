"""The whole model on the Triton path (attention backend + fused kernels) against the reference
path (torch attention backend, plain PyTorch layers), on the GPU.

Tiny checkpoints in fp32: the same greedy tokens through the whole engine. A qwen3-0.6b-shaped
checkpoint in bf16 (random weights at the published shapes): prefill logits of a packed batch
close within bf16 tolerance (greedy tokens of random bf16 weights can flip on near-ties).
"""

import pytest
import torch

from pcg_engine.config import EngineConfig
from pcg_engine.engine.block_manager import BlockManager
from pcg_engine.engine.model_runner import ModelRunner
from pcg_engine.engine.request import Request
from pcg_engine.llm import LLM
from pcg_engine.sampling_params import SamplingParams
from tiny_checkpoints import build_tiny

pytestmark = pytest.mark.gpu


def prefill_logits(path, backend: str, kernels: bool, dtype: str, prompts) -> torch.Tensor:
    """Logits of the last token of each prompt, all prompts packed in one flat prefill step."""
    config = EngineConfig(model=str(path), device="cuda", mode="eager", attention_backend=backend,
                          kernels=kernels, dtype=dtype, num_kv_blocks=256, max_num_seqs=8,
                          max_num_batched_tokens=2048)
    runner = ModelRunner(config, path, torch.device("cuda"))
    blocks = BlockManager(256, config.block_size)
    scheduled = []
    for i, prompt in enumerate(prompts):
        request = Request(str(i), prompt, SamplingParams(max_tokens=4))
        assert blocks.allocate(request, len(prompt))
        runner.batch.add(request)
        runner.batch.update(request, blocks.block_table(request.request_id))
        scheduled.append((request, len(prompt)))
    logits, _ = runner.execute(scheduled)
    return logits.float()


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_tiny_triton_path_same_greedy_tokens(tmp_path_factory, preset):
    path = build_tiny(tmp_path_factory.getbasetemp(), preset)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (1, 7, 16, 33, 70)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for backend, kernels in (("torch", False), ("triton", True)):
        llm = LLM(str(path), device="cuda", dtype="float32", mode="eager", attention_backend=backend,
                  kernels=kernels, num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=64)
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
        del llm
    assert outs["triton"] == outs["torch"]


def test_qwen3_06b_shaped_triton_path_logits_close(tmp_path_factory):
    from pcg_engine.models.checkpoint_maker import make_checkpoint
    path = tmp_path_factory.mktemp("q06") / "qwen3-0.6b"
    make_checkpoint("qwen3-0.6b", path, seed=0, device="cuda")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 8000, (n,), generator=g).tolist() for n in (5, 128, 300)]
    # bf16 rounding over 28 random layers moves the logits by about 1%, on either path. The Triton
    # path must stay as close to the fp32 reference as the plain bf16 reference path is.
    exact = prefill_logits(path, "torch", False, "float32", prompts)
    ref = prefill_logits(path, "torch", False, "bfloat16", prompts)
    fast = prefill_logits(path, "triton", True, "bfloat16", prompts)
    assert torch.isfinite(fast).all()

    def rel(x):
        return ((x - exact).norm() / exact.norm()).item()
    assert rel(ref) < 5e-2, f"bf16 reference path off the fp32 one by {rel(ref):.3e}"
    assert rel(fast) <= 1.5 * rel(ref) + 1e-3, \
        f"Triton path {rel(fast):.3e} from fp32, the bf16 reference path {rel(ref):.3e}"


def test_cuda_projections_stored_transposed_give_the_same_logits(tmp_path_factory, monkeypatch):
    """fuse on CUDA stores o_proj and down_proj as [N, K] views of [K, N] tensors (models/fuse.py,
    for cuBLAS's NN kernels); the prefill logits equal those of the checkpoint's layout in fp32."""
    from pcg_engine.models import fuse as fuse_module
    if not fuse_module._weight_nn():
        pytest.skip("PCG_WEIGHT_NN=0 keeps the checkpoint's layout")
    path = build_tiny(tmp_path_factory.getbasetemp(), "tiny-qwen3")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (1, 9, 40)]
    config = EngineConfig(model=str(path), device="cuda", mode="eager", dtype="float32", num_kv_blocks=64,
                          max_num_seqs=4, max_num_batched_tokens=256)
    model = ModelRunner(config, path, torch.device("cuda")).model
    moved = [(n, m.weight) for n, m in model.named_modules() if n.endswith(("o_proj", "down_proj"))]
    assert moved and all(w.stride() == (1, w.shape[0]) for _, w in moved), [(n, w.stride()) for n, w in moved]
    del model
    transposed = prefill_logits(path, "triton", True, "float32", prompts)
    monkeypatch.setenv("PCG_WEIGHT_NN", "0")
    stored = prefill_logits(path, "triton", True, "float32", prompts)
    torch.testing.assert_close(transposed, stored, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["eager", "full_decode"])
def test_split_k_projections_give_the_same_tokens(tmp_path_factory, monkeypatch, mode):
    """kernels/split_k.py on the tiny model's o and down shapes (both [64, 128]): the steps of up to
    MAX_ROWS tokens (eager, and the full decode graphs, which capture the eager forward) take the
    split, and the greedy tokens in fp32 equal those without it; in bf16 (bmm with fp32 outputs)
    the prefill logits of a 3-token step stay within bf16 rounding of the plain path's."""
    from pcg_engine.kernels import split_k
    from pcg_engine.models.layers import Linear
    path = build_tiny(tmp_path_factory.getbasetemp(), "tiny-qwen3")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (1, 3, 9)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    calls = []
    real = split_k.partials
    monkeypatch.setattr(split_k, "partials", lambda x, w, s: calls.append(x.shape[0]) or real(x, w, s))

    def tokens(table):
        monkeypatch.setattr(split_k, "SPLIT_K", table)
        llm = LLM(str(path), device="cuda", dtype="float32", mode=mode, num_kv_blocks=128, max_num_seqs=4,
                  max_num_batched_tokens=64)
        split = [m.split_k for m in llm.engine.runner.model.modules() if isinstance(m, Linear) and m.split_k]
        out = [o.token_ids for o in llm.generate(prompts, params)]
        llm.close()
        return out, split

    plain, none = tokens({})
    assert none == [] and calls == []
    split, taken = tokens({(64, 128): 4})
    assert taken == [4] * 8 and calls and max(calls) <= split_k.MAX_ROWS
    assert split == plain
    monkeypatch.setattr(split_k, "SPLIT_K", {(64, 128): 4})
    bf16_split = prefill_logits(path, "triton", True, "bfloat16", [[5, 6], [7]])
    monkeypatch.setattr(split_k, "SPLIT_K", {})
    bf16_plain = prefill_logits(path, "triton", True, "bfloat16", [[5, 6], [7]])
    torch.testing.assert_close(bf16_split, bf16_plain, rtol=3e-2, atol=3e-2)
