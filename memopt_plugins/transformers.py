"""``MemOptTrainerCallback``: memopt in a Hugging Face ``transformers.Trainer``.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[MemOptTrainerCallback("int4_drift")])

An adapter of the Trainer's events over one :class:`~memopt_plugins.session.MemOptSession`:
``on_init_end`` patches the model (before ``train()`` turns on activation checkpointing and before
``accelerator.prepare`` wraps or compiles it); ``on_train_begin`` restores state and watches
``Trainer.compute_loss`` for a check's inputs (callbacks are not handed the batch);
``on_pre_optimizer_step`` runs a due drift check through the Trainer's own ``compute_loss`` on the
patched model, in pieces of its sample sized to the compressed step; ``on_step_end`` counts the
step and logs through ``Trainer.log``; ``on_train_end`` removes the patch and keeps its state.
The console lines are the Lightning callback's. The state is saved in ``trainer_state.json`` and
restored on resume whatever ``restore_callback_states_from_checkpoint`` says (bits are numerics,
like optimizer state). docs/integrations.md says more.
"""

from __future__ import annotations

import copy
import logging
import os
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from .config import ConfigError, MemOptConfig
from .engine import patched_by
from .loss_fn import takes_model_and_batch
from .session import SessionAdapter
from .transformers_tap import TrainerTap, calling_trainer
from .tree import batch_size_of

__all__ = ["MemOptTrainerCallback"]

log = logging.getLogger("memopt")

#: The key of memopt's state in the callback's entry of ``TrainerState.stateful_callbacks``.
STATE_KEY = "memopt"

#: Every live callback, so that a copy the Trainer built on resuming finds the one it replaces.
_CALLBACKS: weakref.WeakSet[MemOptTrainerCallback] = weakref.WeakSet()


class MemOptTrainerCallback(SessionAdapter, TrainerCallback, ExportableState):
    """Cut a ``Trainer``'s activation memory with a memopt config (docs/integrations.md).

    Example::

        Trainer(model=model, args=args, train_dataset=ds,
                callbacks=[MemOptTrainerCallback("int4_drift")])

    Args:
        config: the memopt config: a preset's name (``"int4_drift"``), a path to a YAML file, a
            dict in the YAML schema, a ``MemOptConfig``, or ``None`` for the defaults (which
            change nothing).
        loss_fn: ``loss_fn(model, batch) -> scalar loss`` for the drift check, where ``model`` is
            the patched model and ``batch`` the sliced micro-batch (the inputs dict
            ``compute_loss`` gets; a closure ``loss_fn()`` is accepted too). Default: the
            Trainer's own ``compute_loss``.
        slicer: ``slicer(inputs, n) -> inputs`` that keeps ``n`` samples for the drift check.
            Default: cut every tensor of the batch along dim 0.
    """

    def __init__(
        self,
        config: str | os.PathLike[str] | Mapping[str, Any] | MemOptConfig | None = None,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        slicer: Callable[[Any, int], Any] | None = None,
    ) -> None:
        self._open_session(config, slicer, loss_fn)
        self.loss_fn = loss_fn
        self._batch_size: int | None = None  # of the micro-batch the check's sample comes from
        self._tap: TrainerTap | None = None  # the running Trainer, watched
        self._warned = False
        _CALLBACKS.add(self)

    # ----------------------------------------------------------------- properties
    # ----------------------------------------------------------------- patching
    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        checkpointing = getattr(args, "activation_checkpointing", None) or getattr(
            args, "gradient_checkpointing", None
        )
        if checkpointing and self.session.recomputes:
            raise ConfigError(
                "MemOptTrainerCallback: TrainingArguments(activation_checkpointing=True) (alias "
                "gradient_checkpointing) checkpoints the model's layers and the memopt config "
                "recomputes modules too; the layers would be wrapped twice. Keep one: drop the "
                "config's recompute section (compression works under the Trainer's "
                "checkpointing), or turn activation_checkpointing off."
            )
        self.session.apply(kwargs["model"])

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        trainer = calling_trainer()
        model = kwargs["model"]
        replaced = self._replaced(trainer, model)
        if replaced is not None:
            replaced.on_train_begin(args, state, control, **kwargs)
            return
        self.session.apply(model)  # a callback added after __init__, a second train(), model_init
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        if state.global_step > 0 and isinstance(saved, Mapping) and STATE_KEY in saved:
            self.session.load_state_dict(saved[STATE_KEY])  # resumed from a checkpoint
        self._watch(trainer)
        self.session.log_plan()  # with the state laid: the bits this run starts from

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.remove()

    def remove(self) -> None:
        """Undo the patch and stop watching the Trainer (the end of ``train()`` does it): the model
        is exactly as before, and the state is kept for a later ``train()``."""
        self._unwatch()
        self.session.remove()

    def _replaced(self, trainer: Trainer, model: nn.Module) -> MemOptTrainerCallback | None:
        """The callback this one was built to replace, put back in its place, or ``None``.

        With ``restore_callback_states_from_checkpoint``, ``train(resume_from_checkpoint=...)``
        swaps every stateful callback for a new instance, after the user's instance has patched
        the model in ``__init__``: that instance carries on (with its ``loss_fn`` and ``slicer``,
        which a checkpoint cannot hold), and this copy steps aside.
        """
        owner = patched_by(model)
        if self.session.model is not None or owner is None:
            return None
        callbacks = trainer.callback_handler.callbacks
        for old in list(_CALLBACKS):
            if old is not self and old.memopt is owner and all(c is not old for c in callbacks):
                index = next(i for i, c in enumerate(callbacks) if c is self)
                callbacks[index] = old
                return old
        return None

    def _watch(self, trainer: Trainer) -> None:
        """Watch the running Trainer: its inputs for the check, its log for the metrics."""
        self._unwatch()
        self._tap = TrainerTap(trainer, self._sample)
        self.session.log_metrics = self._tap.log

    def _sample(self, inputs: Any) -> Any:
        """The check's slice of a micro-batch (whose size the check judges at)."""
        self._batch_size = batch_size_of(inputs)
        return self.slicer(inputs, self.config.drift.sample_size)

    def _unwatch(self) -> None:
        tap, self._tap, self.session.log_metrics = self._tap, None, None
        if tap is not None:
            tap.close()

    # ----------------------------------------------------------------- the training loop
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Called at the first micro-batch of each optimizer step.
        if self._tap is not None:
            self._tap.keep = self.session.due(state.global_step)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        tap = self._tap
        if tap is None or not tap.keep:
            return
        tap.keep = False
        sample = tap.take()
        if sample is not None:
            self._check(tap, sample, state.global_step)
        elif not self._warned:
            self._warned = True
            log.warning(
                "memopt: no drift check at step %d: the Trainer's training_step did not call "
                "compute_loss, where the callback takes its inputs from",
                state.global_step,
            )

    def _check(self, tap: TrainerTap, sample: Any, step: int) -> None:
        """The drift check on ``sample``, handed a loss of the form ``loss_fn(model, batch)``
        (``compute_loss``'s, or the user's) and the sample, so that it may run its passes on
        pieces of it sized to what the compressed step kept (no pass above the step it guards);
        a closure ``loss_fn()`` of the user's runs its own sample whole."""
        user_loss = self.loss_fn
        if user_loss is not None and not takes_model_and_batch(user_loss):
            self.session.check(user_loss, step=step, batch_size=self._batch_size)
            return
        if user_loss is None:
            loss_fn = tap.loss_on
        else:

            def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
                return user_loss(model, copy.copy(batch))  # its own copy: labels get popped

        self.session.check(loss_fn, batch=sample, step=step, batch_size=self._batch_size)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.session.end_step(state.global_step, log_due=control.should_log)

    # ----------------------------------------------------------------- state
    def state(self) -> dict[str, Any]:
        """What ``TrainerState.stateful_callbacks`` keeps of the callback in a checkpoint."""
        return {"args": {}, "attributes": {}, STATE_KEY: self.state_dict()}

    def state_dict(self) -> dict[str, Any]:
        """Bits, step counter, drift history and planner choice (plain Python types)."""
        return self.session.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (before or after the model is patched)."""
        self.session.load_state_dict(state)
