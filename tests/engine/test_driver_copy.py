"""engine/driver_copy.py: when the driver's copies serve, that a refusal leaves the copy to torch,
and (GPU) that they land in order on the current stream."""

import pytest
import torch

from pcg_engine.engine import driver_copy
from pcg_engine.engine.driver_copy import DriverCopy


class Calls:
    """A stand-in for a driver function: records its calls, returns the given results in turn."""

    def __init__(self, *results):
        self.results, self.calls = list(results), []

    def __call__(self, *args):
        self.calls.append(args)
        return self.results.pop(0) if self.results else 0


def test_none_on_the_cpu_and_when_switched_off(monkeypatch):
    assert driver_copy.for_device(torch.device("cpu")) is None
    monkeypatch.setenv("PCG_DRIVER_COPY", "0")
    assert driver_copy.for_device(torch.device("cuda", 0)) is None


def test_another_current_device_or_a_driver_error_leaves_the_copy_to_torch(monkeypatch):
    current = {"device": 1}
    monkeypatch.setattr(driver_copy, "_get_device", lambda: current["device"])
    monkeypatch.setattr(driver_copy, "_get_stream", lambda index: 1000 + index)
    h2d = Calls(0, 0, 700)
    copier = DriverCopy(3, h2d)
    spans = [(10, 20, 8), (30, 40, 16), (50, 60, 24), (70, 80, 32)]
    assert not copier.host_to_device(spans)
    assert h2d.calls == []                                 # another device is current: nothing issued
    current["device"] = 3
    assert not copier.host_to_device(spans)                # the third span's error stops it there
    assert h2d.calls == [(10, 20, 8, 1003), (30, 40, 16, 1003), (50, 60, 24, 1003)]
    assert copier.host_to_device(spans[:1])
    assert h2d.calls[-1] == (10, 20, 8, 1003)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_copies_land_in_order_on_the_current_stream():
    """On a side stream held up by a sleeping kernel: a read enqueued before the copies sees the old
    values and one enqueued after sees the new ones (a copy on another stream would have landed
    before the first read)."""
    copier = driver_copy.for_device(torch.device("cuda"))
    assert copier is not None
    gen = torch.Generator().manual_seed(torch.seed())
    src = torch.randint(-2 ** 62, 2 ** 62, (3000,), generator=gen).pin_memory()
    dst = torch.zeros(3000, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        before = dst.clone()
        spans = [(dst.data_ptr(), src.data_ptr(), 8 * 1000), (dst[2000:].data_ptr(), src[2000:].data_ptr(), 8 * 1000)]
        assert copier.host_to_device(spans)
        after = dst.clone()
    torch.cuda.synchronize()
    assert torch.equal(before.cpu(), torch.zeros(3000, dtype=torch.int64))
    assert torch.equal(after[:1000].cpu(), src[:1000]) and torch.equal(after[2000:].cpu(), src[2000:])
    assert not after[1000:2000].any()                      # between the two spans: untouched
