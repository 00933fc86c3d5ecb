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
