"""``MemOptCallback``: memopt in a Lightning ``Trainer`` — patch at setup, check drift, log.

An adapter of Lightning's events over one :class:`~memopt_plugins.session.MemOptSession`, which
owns the steps, the checks, the logging and the state kept while unpatched. The callback patches
the LightningModule in ``setup("fit")`` (before the strategy wraps it; a model built in
``configure_model`` in ``on_fit_start``, after it, so after ``fully_shard`` under
``ModelParallelStrategy``), applies restored state in ``on_fit_start`` (a callback's
``load_state_dict`` runs after ``setup``), runs the drift check at optimizer-step boundaries on a
slice of the current batch with the strategy's reduce, logs ``memopt/*`` metrics through the
trainer's loggers, and removes the patch in ``teardown``. Checkpoints carry the callback's state,
distributed ones too. Lightning's batch-size finder: docs/integrations.md, "Lightning".
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.optim import Optimizer
from typing_extensions import override

from ..config import MemOptConfig
from ..engine import DriftReport
from ..loss_fn import takes_model_and_batch
from ..session import SessionAdapter
from ..tree import batch_size_of
from .training_step import LossFn, silenced_logging, step_loss


class MemOptCallback(SessionAdapter, Callback):
    """Cut the activation memory of training with a memopt config.

    Example::

        trainer = Trainer(callbacks=[MemOptCallback("int4_drift")])

    Args:
        config: the memopt config: a preset's name (``"int4_drift"``), a path to a YAML file, a
            dict in the YAML schema, a ``MemOptConfig``, or ``None`` for the defaults (which
            change nothing).
        loss_fn: ``loss_fn(model, batch) -> scalar loss`` for the drift check, called with the
            LightningModule and the sliced batch (a closure ``loss_fn()`` is accepted too).
            Default: the module's own ``training_step`` on the sliced batch, with its
            ``self.log`` calls suppressed. Required under manual optimization.
        slicer: ``slicer(batch, n) -> batch`` that keeps ``n`` samples for the drift check.
            Default: cut every tensor of the batch along dim 0.
    """

    def __init__(
        self,
        config: dict[str, Any] | str | os.PathLike[str] | MemOptConfig | None = None,
        loss_fn: LossFn | None = None,
        slicer: Callable[[Any, int], Any] | None = None,
    ) -> None:
        super().__init__()
        self._open_session(config, slicer, loss_fn)
        self.loss_fn = loss_fn
        self._deferred = False  # patch in on_fit_start (the model is built in configure_model)
        self._fit_started = False
        self._batch: Any = None
        self._batch_idx = 0
        self._step_at_batch_start = 0

    # ----------------------------------------------------------------- properties
    # ----------------------------------------------------------------- set-up and tear-down
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._check_fsdp(trainer)
        if self.session.drift_active and not pl_module.automatic_optimization and not self.loss_fn:
            raise MisconfigurationException(
                "MemOptCallback: under manual optimization training_step steps the optimizers "
                "itself, so the drift check cannot call it. Pass "
                "MemOptCallback(loss_fn=lambda module, batch: <loss>), or set drift.enabled: false."
            )
        strategy = trainer.strategy
        self.session.reduce_max = lambda t: strategy.reduce(t, reduce_op="max")
        self.session.is_main = lambda: trainer.is_global_zero

        def log_metrics(metrics: dict[str, float], step: int) -> None:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

        self.session.log_metrics = log_metrics
        if self.session.model is pl_module:
            return  # setup("fit") again on the same model: already patched
        if is_overridden("configure_model", pl_module):
            self._deferred = True  # configure_model runs after setup: patch in on_fit_start
            return
        self.session.apply(pl_module)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._deferred:
            if isinstance(trainer.strategy, FSDPStrategy):
                raise MisconfigurationException(
                    "MemOptCallback cannot patch a model built in configure_model under FSDP: by "
                    "on_fit_start FSDP has wrapped its layers and their names no longer match the "
                    "config. Build the layers in __init__ (FSDP shards them at setup anyway)."
                )
            self.session.apply(pl_module)
            self._deferred = False
        self.session.restore()
        self.session.measure_afresh()  # a BatchSizeFinder's trials (patched, no callbacks) ran
        self._fit_started = True
        self.session.log_plan()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.session.model is None:
            return
        self.session.remove()  # keeps what training learned for a later fit on this callback
        self._fit_started = False
        self._batch = None

    def _check_fsdp(self, trainer: pl.Trainer) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, FSDPStrategy):
            return
        if self.session.recomputes and strategy._activation_checkpointing_kwargs:
            raise MisconfigurationException(
                "MemOptCallback: the FSDP strategy already checkpoints activations "
                "(activation_checkpointing_policy) and the memopt config has a recompute "
                "section; the layers would be wrapped twice. Remove one of them: either "
                "FSDPStrategy(activation_checkpointing_policy=...) or the config's recompute."
            )

    # ----------------------------------------------------------------- training loop
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch = batch
        self._batch_idx = batch_idx
        self._step_at_batch_start = trainer.global_step

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        # Called only at optimizer-step boundaries (after the last accumulated backward).
        step = trainer.global_step
        if self._batch is not None and self.session.due(step):
            self.run_drift_check(trainer, pl_module, self._batch, step)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._batch = None
        if trainer.global_step == self._step_at_batch_start:
            return  # accumulating gradients: no optimizer step yet
        step = trainer.global_step - 1  # the optimizer step just taken
        self.session.end_step(step, log_due=(step + 1) % trainer.log_every_n_steps == 0)

    def run_drift_check(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, step: int
    ) -> DriftReport:
        """Run one drift check on a slice of ``batch`` now (all ranks must call it together).

        The check is handed the slice and a loss of the form ``loss_fn(model, batch)`` (the
        user's, or ``training_step``), so it may run its passes on pieces of the slice sized to
        what the compressed step kept: no pass holds more than the step it guards. A closure
        ``loss_fn()`` of the user's runs the slice whole.
        """
        if self.session.model is not pl_module:
            raise MisconfigurationException(
                "MemOptCallback: the drift check runs on the patched model, which is not the "
                "LightningModule being trained; the callback patches the module it is set up with"
            )
        sample = self.slicer(batch, self.config.drift.sample_size)
        if self.loss_fn is not None and not takes_model_and_batch(self.loss_fn):
            check, pieces = self.loss_fn, None  # a closure: its own sample, run whole
        else:
            check, pieces = self.loss_fn or self._step_loss(trainer), sample
        with silenced_logging(pl_module):
            return self.session.check(
                check, batch=pieces, step=step, batch_size=batch_size_of(batch)
            )

    def _step_loss(self, trainer: pl.Trainer) -> LossFn:
        """``loss_fn(module, batch)``: ``training_step``'s loss on ``batch`` (a piece of the
        check's slice), under the precision plugin's context as a training step runs."""
        loss = step_loss(self._batch_idx)
        precision = trainer.strategy.precision_plugin

        def loss_fn(module: pl.LightningModule, batch: Any) -> torch.Tensor:
            with precision.train_step_context():
                return loss(module, batch)

        return loss_fn

    # ----------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        return self.session.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._fit_started:  # strategies that restore after on_fit_start
            self.session.load_state_dict(state_dict)
        else:
            self.session.hold(state_dict)
