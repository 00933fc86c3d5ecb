"""``MemOptProfileCallback``: the memory of a Lightning fit's first training step, per module.

At the first training batch it measures the LightningModule as it is and under the memopt config
(:func:`~memopt_plugins.profiler.profile_model`, with the state of the first optimizer
``configure_optimizers`` returned), logs the table on the ``memopt`` logger and
writes ``memopt_profile.md`` in the trainer's log directory, with ``memopt_profile.png`` and
``memopt_timeline.png`` (with matplotlib). Where a :class:`~memopt_plugins.callbacks.MemOptCallback`
has patched the module, its patch is lifted for the measurement and put back with its state.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from ..config import MemOptConfig
from ..engine import patched_by
from ..logs import quiet
from ..profiler import ProfileReport, profile_model
from .training_step import LossFn, silenced_logging, step_loss

log = logging.getLogger("memopt")


class MemOptProfileCallback(Callback):
    """Log a per-module memory table of the first training batch and save its chart.

    Example::

        trainer = Trainer(callbacks=[MemOptCallback("int4_drift"), MemOptProfileCallback()])

    Refused under a sharding strategy (``FSDPStrategy``, ``ModelParallelStrategy``): the profile
    runs on rank 0 alone, and a sharded forward needs every rank.

    Args:
        config: the plan to measure the model under (a YAML path, a dict or a ``MemOptConfig``).
            Default: the config of the memopt patch on the module (a ``MemOptCallback``), else
            the defaults, which change nothing.
        loss_fn: ``loss_fn(pl_module, batch) -> scalar loss``. Default: the module's own
            ``training_step``, with its ``self.log`` calls suppressed.
        top: rows of the logged table.
    """

    def __init__(
        self,
        config: dict[str, Any] | str | os.PathLike[str] | MemOptConfig | None = None,
        loss_fn: LossFn | None = None,
        top: int = 20,
    ) -> None:
        super().__init__()
        self.config = config
        self.loss_fn = loss_fn
        self.top = top
        self._done = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if stage == "fit" and isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
            raise MisconfigurationException(
                f"MemOptProfileCallback profiles on rank 0 alone, "
                f"and under {type(strategy).__name__} a sharded model's forward needs every rank "
                "(each layer's parameters are all-gathered). Profile the unsharded model on one "
                "device (`memopt profile`, or a Trainer without sharding) and drop it here."
            )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._done:
            return
        self._done = True
        if trainer.is_global_zero:
            self.profile(trainer, pl_module, batch, batch_idx)

    def profile(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Measure ``batch`` now, log the table and write the chart and the Markdown."""
        loss = self.loss_fn or step_loss(batch_idx)
        # the state of the optimizer configure_optimizers returned counts (one step, undone)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        memopt = patched_by(pl_module)
        config = self.config if self.config is not None or memopt is None else memopt.config
        state = memopt.state_dict() if memopt is not None else None
        # profile_model measures the model as it is, then under the config; the training patch
        # is lifted meanwhile and put back as it was (its apply lines were said already)
        with quiet():
            if memopt is not None:
                memopt.remove()
            try:
                with silenced_logging(pl_module):
                    report = profile_model(pl_module, batch, loss, config, optimizer)
            finally:
                if memopt is not None:
                    memopt.load_state_dict(state)
                    memopt.apply(pl_module)
        if memopt is not None and config is memopt.config:
            memopt.internal.take_measured_fits(
                report.fits
            )  # the step measured here: one figure for it
        log.info("memopt: memory of the first training step by module\n%s", report.table(self.top))
        folder = trainer.log_dir or trainer.default_root_dir
        if folder:
            self.write(report, Path(folder))

    def write(self, report: ProfileReport, folder: Path) -> None:
        """``memopt_profile.md`` in ``folder``, with ``memopt_profile.png`` and
        ``memopt_timeline.png`` beside it when matplotlib is installed (linked only then)."""
        folder.mkdir(parents=True, exist_ok=True)
        markdown = folder / "memopt_profile.md"
        try:
            chart = report.plot(folder / "memopt_profile.png")
            timeline = report.plot_timeline(folder / "memopt_timeline.png")
        except ImportError as err:
            markdown.write_text(report.to_markdown())
            log.info("memopt: profile written to %s (no charts: %s)", markdown, err)
            return
        markdown.write_text(report.to_markdown(image=chart.name, timeline=timeline.name))
        log.info("memopt: profile written to %s (charts: %s, %s)", markdown, chart, timeline)
