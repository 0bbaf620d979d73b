"""kernels/l2_prefetch.py: a prefetch changes no value, so the tests check what it must not do (write,
fault, read past the tensor, break a CUDA graph) and its argument checks."""

import pytest
import torch

from pcg_engine.kernels import l2_prefetch

gpu = pytest.mark.gpu


def test_bad_arguments_are_named():
    t = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="mode"):
        l2_prefetch.prefetch(t, mode="nope")
    with pytest.raises(ValueError, match="nbytes: expected 0..128"):
        l2_prefetch.prefetch(t, 129)
    with pytest.raises(ValueError, match="t: expected a contiguous"):
        l2_prefetch.prefetch(torch.zeros(4, 8, 2)[:, :, 0])
    with pytest.raises(ValueError, match="chunk: expected a positive multiple of 16"):
        l2_prefetch.prefetch(t, mode="bulk", chunk=24)


def test_cpu_is_a_no_op():
    t = torch.randn(512, 512)
    before = t.clone()
    assert not l2_prefetch.available(t.device)
    for mode in l2_prefetch.MODES:
        l2_prefetch.prefetch(t, mode=mode)
        l2_prefetch.prefetch(t.t(), mode=mode)   # the transpose of a contiguous tensor is accepted
    assert torch.equal(t, before)


@gpu
@pytest.mark.parametrize("mode", l2_prefetch.MODES)
def test_prefetch_in_a_cuda_graph_changes_nothing(mode):
    dev = torch.device("cuda")
    if not l2_prefetch.available(dev):
        pytest.skip("needs sm_90")
    # sizes that are not a multiple of a chunk or of a program's requests; a transposed weight
    tensors = [torch.randn(1000, 777, device=dev, dtype=torch.bfloat16),
               torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16).t(),
               torch.randn(3, 65536 + 48, device=dev, dtype=torch.float16)]
    before = [t.clone() for t in tensors]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for t in tensors:
            l2_prefetch.prefetch(t, mode=mode)   # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for t in tensors:
            l2_prefetch.prefetch(t, mode=mode)
            l2_prefetch.prefetch(t, t.numel() * t.element_size() // 3, mode=mode)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))
    assert l2_prefetch._sink(dev).item() == 0
