"""A LightningModule's ``training_step`` run outside Lightning's loop, for memopt's callbacks.

The drift check and the profile run it on a slice of the batch: its loss is what they need, and
its ``self.log`` calls must go nowhere (they would log the check's extra step as a training one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

#: ``loss_fn(pl_module, batch) -> scalar loss``, as the callbacks' ``loss_fn`` argument.
LossFn = Callable[[pl.LightningModule, Any], torch.Tensor]


def _no_log(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``LightningModule.log``/``log_dict`` while memopt runs a step of its own."""


@contextmanager
def silenced_logging(pl_module: pl.LightningModule) -> Iterator[None]:
    """``self.log``/``self.log_dict`` do nothing inside."""
    saved = {name: pl_module.__dict__.get(name) for name in ("log", "log_dict")}
    pl_module.log = _no_log  # type: ignore[method-assign]
    pl_module.log_dict = _no_log  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(pl_module, name)
            else:
                setattr(pl_module, name, value)


def loss_of(output: Any) -> torch.Tensor:
    """The loss in what ``training_step`` returned (a tensor or a mapping with ``"loss"``)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    raise MisconfigurationException(
        "memopt's drift check runs training_step on a slice of the batch and needs the loss it "
        f"returns (a tensor or a dict with 'loss'); got {type(output).__name__}. Pass "
        "MemOptCallback(loss_fn=...) to compute the loss yourself."
    )


def step_loss(batch_idx: int) -> LossFn:
    """``loss_fn(pl_module, batch)``: the loss of ``pl_module.training_step(batch, batch_idx)``."""
    return lambda pl_module, batch: loss_of(pl_module.training_step(batch, batch_idx))
