"""kernels/scatter.py against index_copy_: fresh random appends into a random table, several grids."""

import pytest
import torch

from pcg_engine.kernels import scatter
from pcg_engine.kernels.scatter import BLOCK, _scatter_kernel, scatter_

ON_GPU = torch.cuda.is_available()


def _case(k: int, size: int, device, gen):
    flat = torch.randint(-100, 100, (size,), dtype=torch.int32, generator=gen).to(device)
    index = torch.randperm(size, generator=gen)[:k + 3].to(device)            # distinct, and 3 beyond k
    value = torch.randint(0, 2 ** 31 - 1, (k + 3,), dtype=torch.int32, generator=gen).to(device)
    expected = flat.clone().index_copy_(0, index[:k], value[:k])
    return flat, index, value, expected


@pytest.mark.parametrize("k", [1, 7, BLOCK, BLOCK + 5])
def test_kernel_matches_index_copy(k):
    """The kernel itself (under the interpreter on the CPU): exactly the first k pairs land,
    entries past k (and the rest of the table) are left alone."""
    gen = torch.Generator().manual_seed(torch.seed())
    flat, index, value, expected = _case(k, 3 * BLOCK, "cpu", gen)
    _scatter_kernel[(-(-k // BLOCK),)](flat, index, value, k, BLOCK=BLOCK)
    assert torch.equal(flat, expected)


def test_cpu_tensors_take_index_copy():
    gen = torch.Generator().manual_seed(torch.seed())
    flat, index, value, expected = _case(9, 64, "cpu", gen)
    scatter_(flat, index, value, 9)
    assert torch.equal(flat, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_recorded_launches_serve_other_k_and_pointers():
    """The first call of a grid records the launch; later calls with another k (not specialised),
    other tensors and an unaligned index view must still write exactly their pairs."""
    scatter._PLANS.clear()
    gen = torch.Generator().manual_seed(torch.seed())
    for k in (16, 1, 7, 16, 200, BLOCK, BLOCK + 1, 3):
        flat, index, value, expected = _case(k, 4 * BLOCK, "cuda", gen)
        scatter_(flat, index, value, k)
        assert torch.equal(flat, expected), k
    flat, index, value, expected = _case(5, 4 * BLOCK, "cuda", gen)
    base = torch.cat([torch.zeros(1, dtype=torch.int64, device="cuda"), index])
    scatter_(flat, base[1:], value, 5)                                  # index 8 bytes off alignment
    assert torch.equal(flat, expected)
    with pytest.raises(ValueError, match="scatter_"):
        scatter_(flat, index.to(torch.int32), value, 5)
