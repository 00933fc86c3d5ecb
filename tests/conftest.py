import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a test module (``pytestmark = usefixtures("one_thread")``).

    On a busy 2-core machine two OpenMP threads spin against each other and a step gets
    10-100x slower; one thread is the fast and predictable choice there.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
