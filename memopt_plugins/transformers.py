"""``MemOptTrainerCallback``: memopt in a Hugging Face ``transformers.Trainer``.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[MemOptTrainerCallback("configs/int4_drift.yaml")])

The callback owns one :class:`~memopt_plugins.MemoryOptimizer` and follows the Trainer's events:

* ``on_init_end`` (the end of ``Trainer.__init__``): patches the model, so before ``train()``
  turns on activation checkpointing and before ``accelerator.prepare`` wraps it in DDP or
  compiles it. A config that recomputes modules is refused when ``activation_checkpointing``
  (``gradient_checkpointing``) is on, since the Trainer would checkpoint the layers memopt already
  recomputes; compression alone works under the Trainer's checkpointing.
* ``on_train_begin``: restores memopt's state when resuming, and starts watching
  ``Trainer.compute_loss`` for the inputs of the steps that have a drift check due (callbacks
  are not handed the batch).
* ``on_pre_optimizer_step`` (after the last accumulated backward and gradient clipping): the drift
  check, when due, on the first ``drift.sample_size`` samples of the last micro-batch, through the
  Trainer's own ``compute_loss`` (``compute_loss_func``, label smoothing and subclass overrides
  apply) on the patched model itself, not its DDP wrapper. It changes neither ``.grad``, the
  optimizer, RNG streams nor buffers, so a run in which it escalates nothing is, bit for bit, the
  run without it; under DDP each rank checks its own slice and the maximum over ranks decides.
* ``on_step_end``: ``memopt/*`` metrics go through ``Trainer.log``, so into ``state.log_history``
  and every ``report_to`` integration, at the Trainer's logging steps and at each step that ran a
  check (drift values only at those). Escalations are INFO lines on the ``memopt`` logger.
* ``on_train_end``: the patch is removed (the model is as it was); the bits, drift history and
  planner choice carry over to a later ``train()``.

Checkpoints: the state is saved in each ``checkpoint-N/trainer_state.json`` (the callback is an
``ExportableState``) and restored by ``train(resume_from_checkpoint=...)`` whatever
``restore_callback_states_from_checkpoint`` says: bits are part of the model's numerics, like the
optimizer state, not a setting of the callback. (With that flag on, the Trainer swaps the callback
for a new instance; the new one puts the user's instance back in its place.)

A PEFT model (LoRA) is patched like any other: its frozen base weights are parameters, which are
never compressed, and each adapter's drift is judged by its own gradient.
"""

from __future__ import annotations

import copy
import inspect
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
from .engine import DriftReport, MemoryOptimizer, patched_by, slice_batch

__all__ = ["MemOptTrainerCallback"]

log = logging.getLogger("memopt")

#: The key of memopt's state in the callback's entry of ``TrainerState.stateful_callbacks``.
STATE_KEY = "memopt"

#: Every live callback, so that a copy the Trainer built on resuming finds the one it replaces.
_CALLBACKS: weakref.WeakSet[MemOptTrainerCallback] = weakref.WeakSet()


def _calling_trainer() -> Trainer:
    """The ``Trainer`` whose callback handler runs the current event.

    Callbacks are handed the args, state and control, not the Trainer; memopt needs it to log a
    row that reaches ``log_history`` and every ``report_to`` integration (``Trainer.log``; a
    callback's ``on_log`` runs after the integrations') and to run its ``compute_loss``.
    """
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


class MemOptTrainerCallback(TrainerCallback, ExportableState):
    """Cut the activation memory of ``Trainer`` training with a memopt config (see DESIGN.md).

    Example::

        Trainer(model=model, args=args, train_dataset=ds,
                callbacks=[MemOptTrainerCallback("configs/int4_drift.yaml")])

    Args:
        config: the memopt config: a path to a YAML file, a dict in the YAML schema, a
            ``MemOptConfig``, or ``None`` for the defaults (which change nothing).
        loss_fn: ``loss_fn(model, inputs) -> scalar loss`` for the drift check, where ``model`` is
            the patched model and ``inputs`` the sliced micro-batch (the dict ``compute_loss``
            gets). Default: the Trainer's own ``compute_loss``.
        slicer: ``slicer(inputs, n) -> inputs`` that keeps ``n`` samples for the drift check.
            Default: cut every tensor of the batch along dim 0.
    """

    def __init__(
        self,
        config: str | os.PathLike[str] | Mapping[str, Any] | MemOptConfig | None = None,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        slicer: Callable[[Any, int], Any] | None = None,
    ) -> None:
        self.optimizer = MemoryOptimizer(config)  # a bad config fails here, at construction
        self.loss_fn = loss_fn
        self.slicer = slicer or slice_batch
        self._trainer: Trainer | None = None  # the Trainer whose compute_loss is watched
        self._compute_loss: Callable[..., Any] | None = None  # its own, which the check runs
        self._previous: Callable[..., Any] | None = None  # its compute_loss instance attribute
        self._due = False  # a drift check is due at this optimizer step: keep its inputs
        self._sample: Any = None
        self._report: DriftReport | None = None  # the check of this step, to log at its end
        self._restored: dict[str, Any] | None = None  # state kept between two train() calls
        self._warned = False
        _CALLBACKS.add(self)

    # ----------------------------------------------------------------- properties
    @property
    def config(self) -> MemOptConfig:
        """The validated config."""
        return self.optimizer.config

    @property
    def bits(self) -> dict[str, int]:
        """``{fqn: bits}`` of every compressed module (fqns within the Trainer's model).

        After ``train()``: the bits it ended with, which the next ``train()`` starts from.
        """
        return dict(self.state_dict().get("bits", {}))

    # ----------------------------------------------------------------- patching
    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        checkpointing = getattr(args, "activation_checkpointing", None) or getattr(
            args, "gradient_checkpointing", None
        )
        if checkpointing and self.optimizer.recomputes:
            raise ConfigError(
                "MemOptTrainerCallback: TrainingArguments(activation_checkpointing=True) (alias "
                "gradient_checkpointing) checkpoints the model's layers and the memopt config "
                "recomputes modules too; the layers would be wrapped twice. Keep one: drop the "
                "config's recompute section (compression works under the Trainer's "
                "checkpointing), or turn activation_checkpointing off."
            )
        self._patch(kwargs["model"])

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        trainer = _calling_trainer()
        model = kwargs["model"]
        replaced = self._replaced(trainer, model)
        if replaced is not None:
            replaced.on_train_begin(args, state, control, **kwargs)
            return
        self._patch(model)  # a callback added after __init__, a second train(), model_init
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        if state.global_step > 0 and isinstance(saved, Mapping) and STATE_KEY in saved:
            self.optimizer.load_state_dict(saved[STATE_KEY])  # resumed from a checkpoint
        self._watch(trainer)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.remove()

    def remove(self) -> None:
        """Undo the patch and stop watching the Trainer (the end of ``train()`` does it): the model
        is exactly as before, and the state is kept for a later ``train()``."""
        self._unwatch()
        if self.optimizer.model is None:
            return
        self._restored = self.optimizer.state_dict()
        self.optimizer.remove()

    def _patch(self, model: nn.Module) -> None:
        if self.optimizer.model is model:
            return
        if self.optimizer.model is not None:  # another model: model_init builds one per train()
            self._restored = self.optimizer.state_dict()
            self.optimizer.remove()
        self.optimizer.apply(model)
        if self._restored is not None:
            self.optimizer.load_state_dict(self._restored)
            self._restored = None

    def _replaced(self, trainer: Trainer, model: nn.Module) -> MemOptTrainerCallback | None:
        """The callback this one was built to replace, put back in its place, or ``None``.

        With ``restore_callback_states_from_checkpoint``, ``train(resume_from_checkpoint=...)``
        swaps every stateful callback for a new instance, after the user's instance has patched
        the model in ``__init__``: that instance carries on (with its ``loss_fn`` and ``slicer``,
        which a checkpoint cannot hold), and this copy steps aside.
        """
        owner = patched_by(model)
        if self.optimizer.model is not None or owner is None:
            return None
        callbacks = trainer.callback_handler.callbacks
        for old in list(_CALLBACKS):
            if old is not self and old.optimizer is owner and all(c is not old for c in callbacks):
                index = next(i for i, c in enumerate(callbacks) if c is self)
                callbacks[index] = old
                return old
        return None

    # ----------------------------------------------------------------- the batch
    def _watch(self, trainer: Trainer) -> None:
        """Wrap ``trainer.compute_loss`` to keep a slice of the inputs when a check is due."""
        self._unwatch()
        compute_loss = trainer.compute_loss

        def watched(model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if self._due and model.training and torch.is_grad_enabled():
                self._sample = self.slicer(inputs, self.config.drift.sample_size)
            return compute_loss(model, inputs, *args, **kwargs)

        self._trainer, self._compute_loss = trainer, compute_loss
        self._previous = vars(trainer).get("compute_loss")
        trainer.compute_loss = watched

    def _unwatch(self) -> None:
        trainer, self._trainer = self._trainer, None
        self._compute_loss = self._sample = None
        if trainer is None:
            return
        if self._previous is None:
            vars(trainer).pop("compute_loss", None)
        else:
            trainer.compute_loss = self._previous

    # ----------------------------------------------------------------- the training loop
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Called at the first micro-batch of each optimizer step.
        self._due = self.optimizer.should_check(state.global_step)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        sample, self._sample = self._sample, None
        if not self._due:
            return
        self._due = False
        if sample is None:
            if not self._warned:
                self._warned = True
                log.warning(
                    "memopt: no drift check at step %d: the Trainer's training_step did not call "
                    "compute_loss, where the callback takes its inputs from",
                    state.global_step,
                )
            return
        self._report = self.optimizer.check_drift(self._loss_on(sample), step=state.global_step)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.optimizer.count_step()
        report, self._report = self._report, None
        if self._trainer is None or (report is None and not control.should_log):
            return
        # Trainer.log resets should_log, which the Trainer reads next for its own row.
        should_log = control.should_log
        self._trainer.log(self.optimizer.metrics(drift=report is not None))
        control.should_log = should_log

    def _loss_on(self, sample: Any) -> Callable[[], torch.Tensor]:
        """The drift check's ``loss_fn``: the loss of the patched model on ``sample``.

        Each call gets its own shallow copy of ``sample``: ``compute_loss`` pops the labels when
        ``compute_loss_func`` or label smoothing computes the loss.
        """
        model = self.optimizer.model
        if self.loss_fn is not None:
            user_loss = self.loss_fn
            return lambda: user_loss(model, copy.copy(sample))
        trainer, compute_loss = self._trainer, self._compute_loss

        def loss_fn() -> torch.Tensor:
            with trainer.compute_loss_context_manager():
                return compute_loss(model, copy.copy(sample))

        return loss_fn

    # ----------------------------------------------------------------- state
    def state(self) -> dict[str, Any]:
        """What ``TrainerState.stateful_callbacks`` keeps of the callback in a checkpoint."""
        return {"args": {}, "attributes": {}, STATE_KEY: self.state_dict()}

    def state_dict(self) -> dict[str, Any]:
        """Bits, step counter, drift history and planner choice (plain Python types)."""
        if self.optimizer.model is None and self._restored is not None:
            return dict(self._restored)
        return self.optimizer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (before or after the model is patched)."""
        if self.optimizer.model is None:
            self._restored = dict(state)
        else:
            self.optimizer.load_state_dict(state)
