"""The model with split-K o and down projections (kernels/split_k.py): eager steps of up to MAX_ROWS
tokens hand partials to the add + RMSNorm after them; a traced forward keeps the plain projection."""

import torch

from compile_helpers import make_runner, run_workload
from pcg_engine.kernels import split_k
from pcg_engine.models.layers import Linear


def _split(model, splits: int) -> list[str]:
    names = []
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.endswith(split_k.SPLIT_K_PROJECTIONS):
            module.split_k = splits
            names.append(name)
    return names


def test_eager_steps_with_split_k_match_the_plain_projections(tiny_dense, monkeypatch):
    plain = make_runner(tiny_dense, "eager")
    split = make_runner(tiny_dense, "eager")
    assert len(_split(split.model, 4)) == 2 * split.num_layers
    calls = []
    real = split_k.partials
    monkeypatch.setattr(split_k, "partials", lambda x, w, s: calls.append(x.shape[0]) or real(x, w, s))

    def check(results, index):
        (ref, _), (out, _) = results
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {index}: {m}")

    run_workload([plain, split], check)
    # the schedule's steps of 1, 2, 3 and 4 tokens split, the others (5 to 35 tokens) do not
    assert sorted(set(calls)) == [1, 2, 3, 4] and len(calls) % (2 * split.num_layers) == 0


def test_a_traced_projection_ignores_split_k():
    torch._dynamo.reset()
    lin = Linear(32, 16)
    lin.weight.data = torch.randn(16, 32)
    lin.split_k = 4
    x = torch.randn(3, 32)
    assert lin(x).shape == (4, 3, 16)          # eager: the partials
    traced = torch.compile(lin, backend="eager", fullgraph=True)
    torch._dynamo.decorators.mark_unbacked(x, 0)   # a symbolic token count, as compile/piecewise.py traces it
    out = traced(x)
    assert out.shape == (3, 16)
    torch.testing.assert_close(out, x @ lin.weight.t())
