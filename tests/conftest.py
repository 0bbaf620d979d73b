import os

# Without a GPU, Triton kernels run in its CPU interpreter. The variable must be set before the
# first `import triton` anywhere in the process (torch._dynamo imports it), hence here, first.
if not os.path.exists("/dev/nvidia0") and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    # GPU tests are run through the device tool; on a CPU machine they skip cleanly.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    # The tiny test models gain nothing from intra-op threads, and on a loaded 2-core machine
    # OpenMP spin-waiting makes every small op an order of magnitude slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
