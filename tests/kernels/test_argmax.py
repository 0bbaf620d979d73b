"""kernels/argmax.py against torch.argmax: first occurrence on ties, chunk boundaries, -inf rows, NaN."""

import pytest
import torch

from pcg_engine.kernels.argmax import CHUNK, ArgmaxWorkspace, argmax_rows

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 1), (1, CHUNK), (3, CHUNK + 1), (5, 2 * CHUNK + 37)])
def test_matches_torch(rows, vocab, dtype):
    # Small integers: many ties inside and across chunks, so the first-occurrence rule is exercised.
    x = torch.randint(-4, 5, (rows, vocab), device=DEVICE).to(dtype)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    y = torch.randn(rows, vocab, device=DEVICE).to(dtype)
    assert torch.equal(argmax_rows(y), y.argmax(dim=-1))


def test_maximum_at_chunk_edges_and_special_rows():
    vocab = 2 * CHUNK + 5
    x = torch.randn(6, vocab, device=DEVICE)
    x[0, CHUNK - 1] = 100.0          # last element of the first chunk
    x[1, CHUNK] = 100.0              # first element of the second
    x[2, vocab - 1] = 100.0          # the masked tail chunk
    x[3] = float("-inf")             # nothing but -inf: index 0, as torch.argmax
    x[4, 7] = float("nan")           # NaN wins, as in torch.argmax
    x[5, :] = 3.0                    # all equal: the first
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_strided_rows_and_empty_batch():
    base = torch.randn(4, 3 * CHUNK, device=DEVICE)
    view = base[:, :CHUNK + 9]       # rows strided wider than the vocabulary
    assert torch.equal(argmax_rows(view), view.argmax(dim=-1))
    assert argmax_rows(torch.empty(0, 10, device=DEVICE)).shape == (0,)
    with pytest.raises(ValueError, match="expected"):
        argmax_rows(torch.empty(3, device=DEVICE))


def test_dtypes_the_fp32_compare_cannot_order_are_refused():
    """The kernel compares in fp32: a float64 row whose maximum exceeds another value by less than
    fp32 resolves, or int64 ids above 2**24, made ties, and the first one won silently."""
    close = torch.tensor([[1.0, 1.0 + 1e-12, 0.5]], dtype=torch.float64, device=DEVICE)
    ints = torch.tensor([[2 ** 30, 2 ** 30 + 1]], device=DEVICE)
    for x in (close, ints):
        assert x.argmax(dim=-1).item() == 1
        with pytest.raises(ValueError, match="expected float32, float16 or bfloat16"):
            argmax_rows(x)
    from pcg_engine.kernels.argmax import greedy_tokens
    assert greedy_tokens(close).item() == 1   # torch.argmax for those


def test_a_kept_workspace_serves_call_after_call():
    """The engine's case: one workspace, calls of different row counts and widths up to its size.
    Each call must leave the per-row arrival counters at zero, or the next call's last program
    would never see its count and leave its row unwritten (poisoned below, so that shows)."""
    ws = ArgmaxWorkspace(6, 3 * CHUNK, DEVICE)
    ws.vals.fill_(float("nan"))                  # stale scratch from earlier calls must not matter
    ws.idx.fill_(-7)
    gen = torch.Generator().manual_seed(torch.seed())
    for rows, vocab in [(6, 3 * CHUNK), (2, CHUNK + 3), (6, 3 * CHUNK), (1, 5), (4, 2 * CHUNK)]:
        x = torch.randn(rows, vocab, generator=gen).to(DEVICE)
        if rows > 1:
            x[1, :] = 2.0                        # all ties: the first
        assert torch.equal(argmax_rows(x, ws), x.argmax(dim=-1)), (rows, vocab)
        assert int(ws.counts.abs().sum()) == 0, (rows, vocab)


def test_kept_outputs_alternate_between_two_buffers():
    """kept_out (the engine's steps): results land in the workspace's two buffers in turn, so a
    result stays intact through the next call and is overwritten by the one after; a workspace
    that does not fit the call gives a fresh tensor."""
    gen = torch.Generator().manual_seed(torch.seed())
    ws = ArgmaxWorkspace(4, 2 * CHUNK, DEVICE)
    xs = [torch.randn(rows, CHUNK + 5, generator=gen).to(DEVICE) for rows in (4, 3, 4, 2)]
    outs = [argmax_rows(x, ws, kept_out=True) for x in xs[:2]]
    assert outs[0].data_ptr() != outs[1].data_ptr()
    assert torch.equal(outs[0], xs[0].argmax(dim=-1)) and torch.equal(outs[1], xs[1].argmax(dim=-1))
    third = argmax_rows(xs[2], ws, kept_out=True)
    assert third.data_ptr() == outs[0].data_ptr() and torch.equal(third, xs[2].argmax(dim=-1))
    assert torch.equal(outs[1], xs[1].argmax(dim=-1))          # the previous result is untouched
    assert argmax_rows(xs[3], ws, kept_out=True).data_ptr() == outs[1].data_ptr()
    wide = torch.randn(2, 2 * CHUNK + 1, generator=gen).to(DEVICE)
    fresh = argmax_rows(wide, ws, kept_out=True)
    assert fresh.data_ptr() not in (outs[0].data_ptr(), outs[1].data_ptr())
    assert torch.equal(fresh, wide.argmax(dim=-1))


def test_a_workspace_too_small_or_elsewhere_is_not_used():
    ws = ArgmaxWorkspace(2, CHUNK, DEVICE)
    for x in (torch.randn(3, CHUNK, device=DEVICE), torch.randn(2, CHUNK + 1, device=DEVICE)):
        assert not ws.fits(x)
        assert torch.equal(argmax_rows(x, ws), x.argmax(dim=-1))
    assert int(ws.counts.abs().sum()) == 0
    assert ws.fits(torch.randn(2, CHUNK, device=DEVICE))


@pytest.mark.skipif(ON_GPU, reason="the interpreter's case: the GPU tests below write pinned memory")
def test_host_out_gets_the_same_tokens():
    """The read-back's variant: the kernel also writes the tokens at host_address (here, under
    the interpreter, a CPU tensor's own address). Poisoned first, so an unwritten row shows."""
    gen = torch.Generator().manual_seed(torch.seed())
    ws = ArgmaxWorkspace(5, 2 * CHUNK, DEVICE)
    for rows in (5, 2, 5):
        x = torch.randn(rows, 2 * CHUNK - 3, generator=gen)
        host = torch.full((rows + 2,), -5, dtype=torch.int64)
        out = argmax_rows(x, ws, host, host.data_ptr())
        assert torch.equal(out, x.argmax(dim=-1))
        assert torch.equal(host[:rows], out) and (host[rows:] == -5).all()
    with pytest.raises(ValueError, match="host_out"):
        argmax_rows(x, ws, torch.zeros(rows - 1, dtype=torch.int64), 0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("rows", [1, 7, 256])
def test_gpu_real_vocab(rows):
    x = torch.randn(rows, 151936, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_repeated_calls_reissue_the_recorded_launches():
    """The second and later calls of a shape go through the recorded launches (fast_launch): fresh
    inputs, a strided view and a row count not seen before must still match torch.argmax."""
    from pcg_engine.kernels import argmax as am
    from pcg_engine.kernels import fast_launch
    am._PLANS.clear()
    for step in range(6):
        x = torch.randn(3, 151936, device="cuda", dtype=torch.bfloat16)
        x[step % 3, 1000 * step + 5] = 50.0
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), step
    if fast_launch.ENABLED:
        assert len(am._PLANS) == 1
    wide = torch.randn(5, 160000, device="cuda")
    view = wide[:, :151936]
    for _ in range(3):
        view.normal_()
        assert torch.equal(argmax_rows(view), view.argmax(dim=-1))
    if fast_launch.ENABLED:
        assert len(am._PLANS) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_kept_workspace_in_recorded_launches_and_a_cuda_graph():
    """The engine's workspace through the recorded launch, many calls in a row on fresh logits
    (a counter left non-zero shows as an unwritten, poisoned row), then captured in a CUDA graph
    and replayed with new logits copied in."""
    ws = ArgmaxWorkspace(256, 151936, "cuda")
    for step in range(20):
        rows = (1, 7, 256, 64)[step % 4]
        x = torch.randn(rows, 151936, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(argmax_rows(x, ws), x.argmax(dim=-1)), step
    assert int(ws.counts.abs().sum()) == 0
    static = torch.randn(64, 151936, device="cuda", dtype=torch.bfloat16)
    argmax_rows(static, ws)                          # compiled and recorded outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_rows(static, ws)
    for _ in range(5):
        static.copy_(torch.randn_like(static))
        out.fill_(-1)
        graph.replay()
        assert torch.equal(out, static.argmax(dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_host_out_in_pinned_memory_through_the_recorded_launch():
    """The engine's read-back path: the kernel writes pinned host memory at the driver's address
    for it; after an event, the host reads the tokens there, call after call (the recorded launch
    after the first), with other row counts and the pinned buffers alternating."""
    from pcg_engine.kernels.argmax import pinned_address
    from pcg_engine.kernels import argmax as am
    bufs = [torch.full((256,), -5, dtype=torch.int64, pin_memory=True) for _ in range(2)]
    addresses = [pinned_address(b) for b in bufs]
    assert None not in addresses
    ws = ArgmaxWorkspace(256, 151936, "cuda")
    am._PLANS.clear()
    for step in range(12):
        rows = (256, 1, 64)[step % 3]
        x = torch.randn(rows, 151936, device="cuda", dtype=torch.bfloat16)
        i = step % 2
        out = argmax_rows(x, ws, bufs[i][:rows], addresses[i])
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
        expected = x.argmax(dim=-1).cpu()
        assert torch.equal(bufs[i][:rows], expected), step
        assert torch.equal(out.cpu(), expected), step
        bufs[i].fill_(-5)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_readback_claims_a_buffer_the_kernel_writes():
    """engine/readback.py's zero-copy path as the engine runs it: claim, the kernel, written,
    wait_array; both buffers in turn."""
    from pcg_engine.engine.readback import TokenReadback
    rb = TokenReadback(64, torch.device("cuda"))
    assert rb.zero_copy
    ws = ArgmaxWorkspace(64, 4096, "cuda")
    for step in range(6):
        x = torch.randn(64 - step, 4096, device="cuda")
        i, host, address = rb.claim(x.shape[0])
        argmax_rows(x, ws, host, address)
        pending = rb.written(i, host)
        assert rb.wait_array(pending).tolist() == x.argmax(dim=-1).tolist(), step
