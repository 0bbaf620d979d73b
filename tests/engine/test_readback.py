"""The token read-back waits for its own step only (async scheduling's overlap depends on it)."""

import time

import pytest
import torch

from pcg_engine.engine.readback import TokenReadback
from pcg_engine.engine.sampler import SamplerOutput


def test_cpu_readback_returns_the_values():
    rb = TokenReadback(8, torch.device("cpu"))
    ids = torch.randint(0, 1000, (5,))
    assert rb.wait(rb.start(SamplerOutput(token_ids=ids))) == ids.tolist()


@pytest.mark.gpu
def test_gpu_readback_does_not_wait_for_later_work():
    dev = torch.device("cuda")
    rb = TokenReadback(8, dev)
    want1, want2 = torch.randint(0, 1000, (6,)), torch.randint(0, 1000, (6,))
    first, second = want1.to(dev), want2.to(dev)
    p1 = rb.start(SamplerOutput(token_ids=first))
    p2 = rb.start(SamplerOutput(token_ids=second))   # the other buffer: p1's values stay intact
    torch.cuda._sleep(2_000_000_000)                 # the next step: ~1 s of GPU work behind both copies
    t0 = time.perf_counter()
    got1, got2 = rb.wait(p1), rb.wait(p2)
    waited = time.perf_counter() - t0
    assert got1 == want1.tolist() and got2 == want2.tolist()
    assert waited < 0.2, f"the read-back waited {waited:.2f} s: for work enqueued after it"
    torch.cuda.synchronize()
