"""``MemOptPlugin``: memopt in a Hugging Face Accelerate training loop.

A thin adapter over one :class:`~memopt_plugins.session.MemOptSession` (steps, checks, logs and
state kept while unpatched): Accelerate has no events, so the loop calls ``after_backward`` after
each backward. :meth:`MemOptPlugin.apply` patches the model before ``accelerator.prepare`` and
:meth:`MemOptPlugin.attach` registers the plugin for ``save_state``/``load_state`` after it; the
loop in full: docs/integrations.md, "Accelerate".

The drift check runs ``loss_of(model, sample)`` on the patched model itself (not the DDP wrapper,
so its backward never reaches the gradient reducer) on the first ``drift.sample_size`` samples of
the batch. A closure ``loss_fn()`` is accepted too. FSDP2 and sharding on the CPU:
docs/distributed.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from .config import MemOptConfig
from .engine import DriftReport
from .loss_fn import bind_loss, takes_model_and_batch
from .session import SessionAdapter
from .tree import batch_size_of

__all__ = ["MemOptPlugin"]


class MemOptPlugin(SessionAdapter):
    """Applies a memopt config to a model trained with Accelerate; checks drift; logs.

    Args:
        config: a preset's name (``"int4_drift"``), a path to a YAML file, a
            dict in the YAML schema, a ``MemOptConfig`` or ``None``
            (the defaults, which change nothing).
        log_every: log the ``memopt/*`` metrics (:meth:`~memopt_plugins.MemoryOptimizer.metrics`)
            through ``accelerator.log`` every this many optimizer steps (drift values are logged
            at every check).
        slicer: ``slicer(batch, n) -> batch`` used by :meth:`sample`; default cuts every tensor of
            the batch along dim 0.
    """

    def __init__(
        self,
        config: str | os.PathLike[str] | Mapping[str, Any] | MemOptConfig | None = None,
        *,
        log_every: int = 50,
        slicer: Callable[[Any, int], Any] | None = None,
    ) -> None:
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1; got {log_every}")
        self._open_session(config, slicer)
        self.log_every = log_every
        self._batch_size: int | None = None  # of the batch the last sample came from
        self.accelerator: Accelerator | None = None
        self.last_report: DriftReport | None = None

    @property
    def steps(self) -> int:
        """Optimizer steps counted by :meth:`after_backward` (restored with the state)."""
        return self.session.steps

    def apply(self, model: nn.Module) -> nn.Module:
        """Patch ``model`` in place (call before ``accelerator.prepare``) and return it."""
        return self.session.apply(model)

    def remove(self) -> None:
        """Undo :meth:`apply`: the model is exactly as before (its state is kept)."""
        self.session.remove()

    def attach(self, accelerator: Accelerator) -> None:
        """Register for ``save_state``/``load_state`` and log through ``accelerator.log``.

        Also makes :meth:`after_backward` skip micro-batches that end no optimizer step
        (``accelerator.sync_gradients`` is False while gradients accumulate), and the drift check
        agree over processes through ``accelerator.reduce``.
        """
        if self.accelerator is accelerator:
            return
        accelerator.register_for_checkpointing(self)
        self.accelerator = accelerator
        self.session.reduce_max = lambda t: accelerator.reduce(t, reduction="max")
        self.session.is_main = lambda: accelerator.is_main_process
        self.session.log_metrics = lambda metrics, step: accelerator.log(metrics, step=step)

    def sample(self, batch: Any) -> Any:
        """The first ``drift.sample_size`` samples of ``batch``, for a closure ``loss_fn()`` of the
        drift check (the check judges compression at ``batch``'s size)."""
        self._batch_size = batch_size_of(batch)
        return self.slicer(batch, self.config.drift.sample_size)

    def after_backward(
        self, step: int | None, loss_fn: Callable[..., torch.Tensor], batch: Any = None
    ) -> DriftReport | None:
        """Call after each backward: at an optimizer-step boundary, runs the drift check when due.

        Args:
            step: the index of the optimizer step about to be taken (0 for the first), or
                ``None`` to use the plugin's own count of boundaries.
            loss_fn: ``loss_fn(model, batch) -> scalar loss``, run on the patched model and a
                :meth:`sample` of ``batch``; or a closure ``loss_fn() -> scalar loss`` on a small
                batch, running the patched model itself (not the DDP wrapper). Called only when
                a check runs.
            batch: the training batch (needed by ``loss_fn(model, batch)``).

        Returns:
            The drift report when a check ran, else ``None``. Under torch.distributed every
            rank must call this at the same steps (the check reduces drift over ranks).
        """
        accelerator = self.accelerator
        if accelerator is not None and not accelerator.sync_gradients:
            return None  # accumulating: not an optimizer-step boundary
        if step is None:
            step = self.session.steps
        report = None
        if self.session.due(step):
            sample = None if batch is None else self.sample(batch)
            autocast = None if accelerator is None else accelerator.autocast
            if sample is not None and takes_model_and_batch(loss_fn):
                # given the batch, the check may run its sample in pieces (no pass above the step)
                check = _under(autocast, loss_fn)
                report = self.session.check(
                    check, batch=sample, step=step, batch_size=self._batch_size
                )
            else:
                check = _under(autocast, bind_loss(loss_fn, self.session.model, sample))
                report = self.session.check(check, step=step, batch_size=self._batch_size)
            self.last_report = report
        self.session.end_step(step, log_due=step % self.log_every == 0)
        return report

    def metrics(self, drift: bool = True) -> dict[str, float]:
        """The ``memopt/*`` values (:meth:`.MemoryOptimizer.metrics`); ``drift=False`` leaves out
        the last check's drift."""
        return self.memopt.metrics(drift)

    def state_dict(self) -> dict[str, Any]:
        """Bits, step counter and drift history (plain Python types)."""
        return self.session.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (before or after :meth:`apply`)."""
        self.session.load_state_dict(state)


def _under(
    autocast: Callable[[], Any] | None, loss_fn: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """``loss_fn`` run under the accelerator's autocast (as its training forward runs), with the
    same arguments: ``(model, batch)`` or none."""
    if autocast is None:
        return loss_fn
    if takes_model_and_batch(loss_fn):

        def loss_of(model: nn.Module, batch: Any) -> torch.Tensor:
            with autocast():
                return loss_fn(model, batch)

        return loss_of

    def loss() -> torch.Tensor:
        with autocast():
            return loss_fn()

    return loss
