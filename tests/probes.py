"""Lightning callbacks the tests read a fit with (shared by the single-process and FSDP2 tests)."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback
from memopt_plugins.callbacks import MemOptCallback


class BitsAtFirstBatch(Callback):
    """The memopt bits in force when the first training batch starts."""

    def __init__(self, memopt: MemOptCallback):
        self.memopt = memopt
        self.bits: dict[str, int] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.bits is None:
            self.bits = self.memopt.bits
