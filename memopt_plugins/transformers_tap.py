"""What :class:`~memopt_plugins.transformers.MemOptTrainerCallback` takes from a running
``transformers.Trainer``, which hands its callbacks the args, state and control but neither
itself nor the batch:

* :func:`calling_trainer`: the Trainer, found on the call stack;
* :class:`TrainerTap`: its ``compute_loss`` wrapped to keep a slice of the inputs of a step with
  a drift check due, the check's loss through that same ``compute_loss``, and rows logged through
  ``Trainer.log`` (so into ``state.log_history`` and every ``report_to`` integration; a callback's
  ``on_log`` runs after the integrations').
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import Trainer


def calling_trainer() -> Trainer:
    """The ``Trainer`` whose callback handler runs the current event."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer):
                return owner
            frame = frame.f_back
    finally:
        del frame  # a frame in a local is a reference cycle
    raise RuntimeError(
        "MemOptTrainerCallback: no transformers.Trainer is running this event; pass the callback "
        "to a Trainer (Trainer(..., callbacks=[...]) or trainer.add_callback(...))"
    )


class TrainerTap:
    """Watches ``trainer.compute_loss`` until :meth:`close` (which puts the Trainer's own back).

    Args:
        trainer: the Trainer.
        cut: ``cut(inputs) -> inputs``: the slice of a micro-batch the drift check runs on.
    """

    def __init__(self, trainer: Trainer, cut: Callable[[Any], Any]) -> None:
        self.trainer = trainer
        self.keep = False  # keep a slice of the next training compute_loss's inputs
        self.sample: Any = None
        compute_loss = self._compute_loss = trainer.compute_loss
        self._previous = vars(trainer).get("compute_loss")  # an instance attribute of its own

        def watched(model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if self.keep and model.training and torch.is_grad_enabled():
                self.sample = cut(inputs)
            return compute_loss(model, inputs, *args, **kwargs)

        trainer.compute_loss = watched

    def close(self) -> None:
        """Give the Trainer its ``compute_loss`` back."""
        self.sample = None
        if self._previous is None:
            vars(self.trainer).pop("compute_loss", None)
        else:
            self.trainer.compute_loss = self._previous

    def take(self) -> Any:
        """The slice kept in this step (``None``: no ``compute_loss`` call kept one)."""
        sample, self.sample = self.sample, None
        return sample

    def loss_on(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The Trainer's own loss of ``model`` on ``batch`` (``compute_loss_func``, label
        smoothing and subclass overrides apply), as ``loss_fn(model, batch)``. Each call gets its
        own shallow copy of ``batch``: ``compute_loss`` pops the labels when it computes the loss
        itself."""
        with self.trainer.compute_loss_context_manager():
            return self._compute_loss(model, copy.copy(batch))

    def log(self, metrics: dict[str, float], step: int) -> None:
        """A row through ``Trainer.log`` (at the Trainer's own step)."""
        # Trainer.log resets should_log, which the Trainer reads next for its own row.
        control = self.trainer.control
        should_log = control.should_log
        self.trainer.log(metrics)
        control.should_log = should_log
