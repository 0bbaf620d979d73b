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


@pytest.mark.gpu
def test_gpu_readback_event_follows_the_current_stream():
    """The event is recorded on the stream that is current at start() (cached per raw stream): on a
    side stream it waits for that stream's copy, and the default stream's entry is not reused there."""
    dev = torch.device("cuda")
    rb = TokenReadback(8, dev)
    side = torch.cuda.Stream(dev)
    for stream in (torch.cuda.current_stream(dev), side, torch.cuda.current_stream(dev), side):
        want = torch.randint(0, 1000, (7,))
        with torch.cuda.stream(stream):
            ids = want.to(dev, non_blocking=False)
            torch.cuda._sleep(50_000_000)       # ~25 ms of work ahead of the copy on this stream
            pending = rb.start(SamplerOutput(token_ids=ids))
        assert not pending.event.query()       # the copy sits behind the sleep on `stream`
        assert rb.wait(pending) == want.tolist()
    assert len(rb._streams) == 2
    torch.cuda.synchronize()
