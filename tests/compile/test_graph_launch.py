"""compile/graph_launch.py: a captured graph launched through the driver does what replay() does."""

import pytest
import torch

from pcg_engine.compile import graph_launch


class NoRawGraph:
    def replay(self):
        pass


class RawGraph(NoRawGraph):
    def raw_cuda_graph_exec(self):   # pragma: no cover - must not be asked when disabled
        raise AssertionError("asked for the executable while the raw launch is off")


def test_objects_without_an_executable_replay():
    g = NoRawGraph()
    assert graph_launch.launcher(g) == g.replay


def test_switched_off_gives_replay(monkeypatch):
    monkeypatch.setattr(graph_launch, "ENABLED", False)
    g = RawGraph()
    assert graph_launch.launcher(g) == g.replay


def _captured(x, out):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):   # warm-up off the default stream, as torch's docs ask
        out.copy_(torch.sin(x) * 2 + 1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(torch.sin(x) * 2 + 1)
    return graph


@pytest.mark.gpu
def test_raw_launch_runs_the_graph_on_new_inputs_and_on_the_current_stream():
    x = torch.zeros(4096, device="cuda")
    out = torch.full_like(x, float("nan"))
    graph = _captured(x, out)
    launch = graph_launch.launcher(graph)
    assert launch != graph.replay, "the raw driver launch is not in use on this GPU"
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        launch()
        torch.testing.assert_close(out, torch.sin(x) * 2 + 1)
    # Ordered on whatever stream is current: inputs written there, read back after its sync.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            launch()
            expected = torch.sin(x) * 2 + 1
            torch.testing.assert_close(out, expected)
    side.synchronize()
