"""``MemOptCallback``: memopt in a Lightning ``Trainer`` — patch at setup, check drift, log.

The callback owns one :class:`~memopt_plugins.MemoryOptimizer`. It patches the LightningModule in
``setup("fit")`` (before the strategy wraps it), applies restored state in ``on_fit_start`` (a
callback's ``load_state_dict`` runs after ``setup``), runs the drift check at optimizer-step
boundaries on a slice of the current batch, logs ``memopt/*`` metrics through the trainer's
loggers, and removes the patch in ``teardown``.

A model built in ``configure_model`` is patched in ``on_fit_start``, after it: under
``ModelParallelStrategy`` that is after ``configure_model`` sharded it with ``fully_shard``
(FSDP2), which memopt supports in either order (see :mod:`memopt_plugins.compress.hooks` and
:mod:`memopt_plugins.drift`). Checkpoints carry the callback's state, distributed ones too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.optim import Optimizer
from typing_extensions import override

from ..config import MemOptConfig
from ..engine import COMPRESS, KEEP, DriftReport, MemoryOptimizer, slice_batch
from ..profiler import profile_model

log = logging.getLogger("memopt")

_MIB = 1024 * 1024


def _no_log(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``LightningModule.log``/``log_dict`` while the drift check runs."""


@contextmanager
def _silenced_logging(pl_module: pl.LightningModule) -> Iterator[None]:
    """``self.log``/``self.log_dict`` do nothing inside (the drift check's extra training_step)."""
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


def _loss_of(output: Any) -> torch.Tensor:
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


def _describe(report: DriftReport) -> str:
    """One line for the console: the drift a check found and what it changed."""
    found = report.round_max[0] if report.round_max else report.max
    text = (
        f"drift check at step {report.step}: max {report.metric} drift {found:.4f} "
        f"(threshold {report.threshold:g})"
    )
    if not report.escalated:
        return text + ", nothing escalated"
    return text + f"; {len(report.escalated)} modules escalated, max drift now {report.max:.4f}"


def _mib(nbytes: float) -> str:
    return f"{nbytes / _MIB:.2f} MiB"


class MemOptCallback(Callback):
    """Cut the activation memory of training with a memopt config (see DESIGN.md).

    Example::

        trainer = Trainer(callbacks=[MemOptCallback("configs/int4_drift.yaml")])

    Args:
        config: the memopt config: a path to a YAML file, a dict in the YAML schema, a
            ``MemOptConfig``, or ``None`` for the defaults (which change nothing).
        loss_fn: ``loss_fn(pl_module, batch) -> scalar loss`` for the drift check. Default: the
            module's own ``training_step`` on the sliced batch, with its ``self.log`` calls
            suppressed. Required under manual optimization.
        slicer: ``slicer(batch, n) -> batch`` that keeps ``n`` samples for the drift check.
            Default: cut every tensor of the batch along dim 0.
        profile: log a per-module memory table of the first training batch at the start of fit
            (and save its chart in the logger's directory). Refused under a sharding strategy
            (``FSDPStrategy``, ``ModelParallelStrategy``): the profile runs on rank 0 alone.
    """

    def __init__(
        self,
        config: dict[str, Any] | str | os.PathLike[str] | MemOptConfig | None = None,
        loss_fn: Callable[[pl.LightningModule, Any], torch.Tensor] | None = None,
        slicer: Callable[[Any, int], Any] | None = None,
        profile: bool = False,
    ) -> None:
        super().__init__()
        self.optimizer = MemoryOptimizer(config)  # a bad config fails here, at construction
        self.loss_fn = loss_fn
        self.slicer = slicer or slice_batch
        self.profile = profile
        self._restored: dict[str, Any] | None = None  # loaded state waiting for on_fit_start
        self._deferred = False  # patch in on_fit_start (the model is built in configure_model)
        self._fit_started = False
        self._batch: Any = None
        self._batch_idx = 0
        self._step_at_batch_start = 0
        self._report: DriftReport | None = None  # the check of the current step, to log
        self._checked_step = -1
        self._reported_memory = False
        self._profiled = False

    # ----------------------------------------------------------------- properties
    @property
    def config(self) -> MemOptConfig:
        """The validated config."""
        return self.optimizer.config

    @property
    def bits(self) -> dict[str, int]:
        """``{fqn: bits}`` of every compressed module (fqns relative to the LightningModule).

        Outside a fit: the bits the last fit ended with (or restored from a checkpoint), which
        the next fit starts from.
        """
        if self.optimizer.model is None and self._restored is not None:
            return dict(self._restored.get("bits", {}))
        return self.optimizer.bits

    @property
    def _drift_active(self) -> bool:
        cfg = self.config
        compresses = cfg.quantize.bits < 32 or any(b < 32 for b in cfg.quantize.overrides.values())
        return cfg.drift.enabled and compresses

    # ----------------------------------------------------------------- set-up and tear-down
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._check_strategy(trainer)
        if self._drift_active and not pl_module.automatic_optimization and self.loss_fn is None:
            raise MisconfigurationException(
                "MemOptCallback: under manual optimization training_step steps the optimizers "
                "itself, so the drift check cannot call it. Pass "
                "MemOptCallback(loss_fn=lambda module, batch: <loss>), or set drift.enabled: false."
            )
        strategy = trainer.strategy
        self.optimizer.reduce_max = lambda t: strategy.reduce(t, reduce_op="max")
        if self.optimizer.model is pl_module:
            return  # setup("fit") again on the same model: already patched
        if is_overridden("configure_model", pl_module):
            self._deferred = True  # configure_model runs after setup: patch in on_fit_start
            return
        self._patch(pl_module)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._deferred:
            if isinstance(trainer.strategy, FSDPStrategy):
                raise MisconfigurationException(
                    "MemOptCallback cannot patch a model built in configure_model under FSDP: by "
                    "on_fit_start FSDP has wrapped its layers and their names no longer match the "
                    "config. Build the layers in __init__ (FSDP shards them at setup anyway)."
                )
            self._patch(pl_module)
            self._deferred = False
        if self._restored is not None:
            self.optimizer.load_state_dict(self._restored)
            self._restored = None
        self._fit_started = True
        if trainer.is_global_zero:
            self._log_plan()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.optimizer.model is None:
            return
        # Keep what training learned (escalated bits, counters) for a later fit on this callback.
        self._restored = self.optimizer.state_dict()
        self.optimizer.remove()
        self._fit_started = False
        self._batch = None

    def _patch(self, pl_module: pl.LightningModule) -> None:
        self.optimizer.apply(pl_module)
        self._reported_memory = False

    def _check_strategy(self, trainer: pl.Trainer) -> None:
        strategy = trainer.strategy
        if self.profile and isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
            raise MisconfigurationException(
                f"MemOptCallback(profile=True) profiles on rank 0 alone, and under "
                f"{type(strategy).__name__} a sharded model's forward needs every rank (each "
                "layer's parameters are all-gathered). Profile the unsharded model on one device "
                "(`memopt profile`, or a Trainer without sharding) and drop profile=True here."
            )
        if not isinstance(strategy, FSDPStrategy):
            return
        if self.optimizer.recomputes and strategy._activation_checkpointing_kwargs:
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
        if self.profile and not self._profiled:
            self._profiled = True
            self._profile(trainer, pl_module, batch, batch_idx)

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        # Between forward and backward: what the hooks hold now is the memory compression saves.
        hooks = self.optimizer.hooks
        if self._reported_memory or hooks is None or not trainer.is_global_zero:
            return
        self._reported_memory = True
        stats = hooks.stats
        if stats.saved_original:
            log.info(
                "memopt: first training step kept %s for backward where the model saves %s "
                "(%.1fx less)",
                _mib(stats.saved_stored),
                _mib(stats.saved_original),
                stats.forward_ratio,
            )

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        # Called only at optimizer-step boundaries (after the last accumulated backward).
        step = trainer.global_step
        if step == self._checked_step or self._batch is None:
            return  # one check per step, also with several optimizers
        if self.optimizer.model is None or not self.optimizer.should_check(step):
            return
        self._checked_step = step
        self._report = self.run_drift_check(trainer, pl_module, self._batch, step)

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
        self.optimizer.count_step()
        report, self._report = self._report, None
        if report is None and (step + 1) % trainer.log_every_n_steps != 0:
            return
        # Drift values belong to the step of their check.
        metrics = self.optimizer.metrics(drift=report is not None)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def run_drift_check(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, step: int
    ) -> DriftReport:
        """Run one drift check on a slice of ``batch`` now (all ranks must call it together)."""
        sample = self.slicer(batch, self.config.drift.sample_size)
        batch_idx = self._batch_idx

        if self.loss_fn is not None:
            user_loss = self.loss_fn

            def loss_fn() -> torch.Tensor:
                return user_loss(pl_module, sample)

        else:

            def loss_fn() -> torch.Tensor:
                with trainer.strategy.precision_plugin.train_step_context():
                    return _loss_of(pl_module.training_step(sample, batch_idx))

        with _silenced_logging(pl_module):
            report = self.optimizer.check_drift(loss_fn, step=step)
        if trainer.is_global_zero:
            log.info("memopt: %s", _describe(report))
        return report

    # ----------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        if self.optimizer.model is None and self._restored is not None:
            return dict(self._restored)
        return self.optimizer.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._fit_started:  # strategies that restore after on_fit_start
            self.optimizer.load_state_dict(state_dict)
        else:
            self._restored = dict(state_dict)

    # ----------------------------------------------------------------- console output
    def _log_plan(self) -> None:
        if self.optimizer.model is None:
            return
        plan = self.optimizer.plan
        actions: dict[str, int] = {}
        for entry in plan.values():
            if entry.action == COMPRESS:
                key = f"{COMPRESS}@{entry.bits}"
            elif entry.action == KEEP:
                continue
            else:
                key = entry.action
            actions[key] = actions.get(key, 0) + 1
        summary = ", ".join(f"{n} {a}" for a, n in sorted(actions.items())) or "nothing to do"
        cfg = self.config
        log.info(
            "memopt: plan for %d modules: %s; dropout %s, batchnorm %s; drift %s",
            len(plan),
            summary,
            cfg.dropout.mode,
            cfg.batchnorm.mode,
            (
                f"{cfg.drift.metric} <= {cfg.drift.threshold} every {cfg.drift.check_every} steps"
                if self._drift_active
                else "off"
            ),
        )

    def _profile(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Per-module memory of the first batch, unpatched and under the plan; table and chart.

        :func:`~memopt_plugins.profiler.profile_model` measures the model as it is and then under
        the config, so the patch is lifted for the measurement and put back with its state.
        """
        if not trainer.is_global_zero or self.optimizer.model is None:
            return
        loss = self.loss_fn or (
            lambda module, sample: _loss_of(module.training_step(sample, batch_idx))
        )
        state = self.optimizer.state_dict()
        self.optimizer.remove()
        try:
            with _silenced_logging(pl_module):
                report = profile_model(pl_module, batch, loss, self.config)
        finally:
            self.optimizer.load_state_dict(state)
            self.optimizer.apply(pl_module)
        log.info("memopt: memory of the first training step by module\n%s", report.table(top=20))
        folder = trainer.log_dir or trainer.default_root_dir
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            chart = report.plot(Path(folder) / "memopt_profile.png")
            (Path(folder) / "memopt_profile.md").write_text(report.to_markdown(image=chart.name))
            log.info("memopt: profile written to %s", chart)
