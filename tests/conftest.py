import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT / "tests", ROOT / "examples"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


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
