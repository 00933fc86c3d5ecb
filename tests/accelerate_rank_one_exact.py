"""``examples/train_accelerate.py`` with rank 1's loss zeroed, for ``test_accelerate.py``.

Rank 1's gradients are then exact at any bits and its drift check measures nothing, so only
memopt's reduce of the drift over ranks can make it escalate as rank 0 does (with the ranks'
ordinary, statistically alike batches, they would escalate alike without it).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

# Loaded from its file: the example imports its neighbours (data, models) itself.
_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_accelerate.py"
_spec = importlib.util.spec_from_file_location("train_accelerate", _SCRIPT)
train_accelerate = sys.modules["train_accelerate"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_accelerate)

_loss = train_accelerate.lm_loss


def _rank_one_exact(model, batch):
    loss = _loss(model, batch)
    return loss * 0 if os.environ.get("RANK") == "1" else loss


if __name__ == "__main__":
    train_accelerate.lm_loss = _rank_one_exact  # the training and the check's loss alike
    train_accelerate.main()
    # The test reads the training's exit status, not CPython's teardown: a gloo thread that drops
    # a tensor while the interpreter finalizes aborts the process now and then ("terminate called
    # without an active exception", pytorch/pytorch#179291), after the reports are written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
