"""kernels/step_upload.py against a copy plus index_copy_: fresh random words and appends."""

import pytest
import torch

from pcg_engine.kernels import step_upload
from pcg_engine.kernels.step_upload import BLOCK, _upload_kernel

ON_GPU = torch.cuda.is_available()


def _case(n: int, k: int, table_size: int, gen, pin: bool = False):
    src = torch.randint(-2 ** 40, 2 ** 40, (n,), generator=gen)
    dst = torch.randint(-9, 9, (n + 5,), generator=gen)               # 5 words past n: left alone
    table = torch.randint(-100, 100, (table_size,), dtype=torch.int32, generator=gen)
    index = torch.randperm(table_size, generator=gen)[:k + 3]          # distinct, and 3 past k
    value = torch.randint(0, 2 ** 31 - 1, (k + 3,), dtype=torch.int32, generator=gen)
    expected_dst = dst.clone()
    expected_dst[:n] = src
    expected_table = table.clone().index_copy_(0, index[:k], value[:k])
    if pin:
        src, index, value = src.pin_memory(), index.pin_memory(), value.pin_memory()
    return src, dst, table, index, value, expected_dst, expected_table


@pytest.mark.parametrize("n,k", [(1, 0), (7, 1), (BLOCK, 16), (BLOCK + 3, 0), (3 * BLOCK - 1, BLOCK + 2), (5, 2 * BLOCK)])
def test_kernel_matches_copy_and_index_copy(n, k):
    """The kernel itself under the interpreter: exactly n words and k pairs land; the grid covers
    whichever of the two is longer."""
    gen = torch.Generator().manual_seed(torch.seed())
    src, dst, table, index, value, expected_dst, expected_table = _case(n, k, 4 * BLOCK, gen)
    grid = max(-(-n // BLOCK), -(-k // BLOCK), 1)
    _upload_kernel[(grid,)](dst, src, n, table, index, value, k, BLOCK=BLOCK)
    assert torch.equal(dst, expected_dst)
    assert torch.equal(table, expected_table)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_pinned_words_and_pairs_through_the_recorded_launch():
    """From pinned host memory at its kernel address: the first call of a grid goes through the
    JIT, later ones (other n, k and buffers) through the recorded launch."""
    from pcg_engine.kernels.argmax import pinned_address
    step_upload._PLANS.clear()
    gen = torch.Generator().manual_seed(torch.seed())
    cases = [(900, 16), (700, 0), (1000, 3), (900, 256), (40, 1), (2 * BLOCK + 1, 16)]
    for n, k in cases:
        src, dst, table, index, value, expected_dst, expected_table = _case(n, k, 8 * BLOCK, gen, pin=True)
        dst, table = dst.cuda(), table.cuda()
        step_upload.upload(dst[:n], src, table, index, value, k,
                           (pinned_address(src), pinned_address(index), pinned_address(value)))
        assert torch.equal(dst.cpu(), expected_dst), (n, k)
        assert torch.equal(table.cpu(), expected_table), (n, k)
    assert len(step_upload._PLANS) == len({max(-(-n // BLOCK), -(-k // BLOCK)) for n, k in cases})   # one a grid
