"""``MemOptSession``: what a training loop does with memopt, for every framework alike.

The Lightning callback, the ``transformers.Trainer`` callback and the Accelerate plugin are thin
adapters of their framework's events over one session, which holds the
:class:`~memopt_plugins.MemoryOptimizer` (``session.memopt``) and owns:

* the state while the model is unpatched (what a finished fit learned, or state loaded before the
  model is patched), which :meth:`apply` lays on the patch;
* the optimizer step: :meth:`due` (a check is due and none ran in this step yet), :meth:`check`,
  :meth:`end_step` (count the step; hand the ``memopt/*`` metrics to the framework's logger);
* the console: the plan when training starts, the memory the first step kept, each check.

What belongs to a framework is injected: :attr:`log_metrics` (where metrics go), :attr:`is_main`
(which process writes the console lines), and :attr:`reduce_max` (the drift decision's reduce
over ranks). The metrics themselves are the engine's (:meth:`MemoryOptimizer.metrics`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .config import MemOptConfig
from .distributed import is_rank_zero, max_over_ranks
from .engine import COMPRESS, KEEP, DriftReport, MemoryOptimizer
from .loss_fn import takes_model_and_batch
from .tree import slice_batch

__all__ = ["MemOptSession", "SessionAdapter"]

log = logging.getLogger("memopt")

_MIB = 1024 * 1024
#: Bytes kept as they are get a line of their own from this share of all the step kept.
_LARGE_SHARE = 0.1


class MemOptSession:
    """One model's memopt across a training loop: patch, steps, checks, logs and kept state.

    Args:
        config: a preset's name (``"int4_drift"``), a path to a YAML file, a
            dict in the YAML schema, a ``MemOptConfig`` or ``None``
            (the defaults, which change nothing). A bad config fails here.

    Attributes:
        memopt: the :class:`~memopt_plugins.MemoryOptimizer`.
        log_metrics: ``log_metrics(metrics, step)`` sends a row of ``memopt/*`` values to the
            framework's loggers; ``None``: nothing is logged.
        is_main: ``is_main() -> bool``, True in the process that writes the console lines
            (default: rank 0 of torch.distributed).
        reduce_max: ``reduce_max(t) -> t``, a tensor's element-wise max over all ranks, which
            the drift check decides by so that every rank keeps the same bits (default: an
            all-reduce over torch.distributed when it is initialized, else the identity).
    """

    def __init__(
        self, config: str | os.PathLike[str] | Mapping[str, Any] | MemOptConfig | None = None
    ) -> None:
        self.memopt = MemoryOptimizer(config)
        self.log_metrics: Callable[[dict[str, float], int], None] | None = None
        self.is_main: Callable[[], bool] = is_rank_zero
        self.reduce_max: Callable[[torch.Tensor], torch.Tensor] = max_over_ranks
        self._internal = self.memopt.internal
        self._internal.speaks = lambda: self.is_main()  # the checks' lines: the main process's
        self._internal.reduce_max = lambda t: self.reduce_max(t)
        self._held: dict[str, Any] | None = None  # state waiting for the (next) patch
        self._report: DriftReport | None = None  # the check of the current step, to log
        self._checked = False  # a check ran in the current step
        self._told_memory = False
        self._told_plan = False

    # ----------------------------------------------------------------- what it holds
    @property
    def config(self) -> MemOptConfig:
        """The validated config."""
        return self.memopt.config

    @property
    def model(self) -> nn.Module | None:
        """The patched model, or ``None``."""
        return self._internal.model

    @property
    def steps(self) -> int:
        """Optimizer steps counted (:meth:`end_step`; restored with the state)."""
        return self._internal.steps

    @property
    def recomputes(self) -> bool:
        """True when the config recomputes modules (``recompute.modules``, ``types`` or ``auto``):
        integrations refuse a framework's own activation checkpointing on top of it."""
        rc = self.config.recompute
        return bool(rc.modules or rc.types or rc.auto is not None)

    @property
    def bits(self) -> dict[str, int]:
        """``{fqn: bits}`` of every compressed module; while unpatched, those of the kept state
        (what the last fit ended with, or a loaded checkpoint), which the next patch starts from."""
        if self._held is not None:
            return dict(self._held.get("bits", {}))
        return self.memopt.bits

    @property
    def drift_active(self) -> bool:
        """True when the config checks drift: ``drift.enabled`` and something below 32 bits."""
        cfg = self.config
        compresses = cfg.quantize.bits < 32 or any(b < 32 for b in cfg.quantize.overrides.values())
        return cfg.drift.enabled and compresses

    # ----------------------------------------------------------------- patch and state
    def apply(self, model: nn.Module) -> nn.Module:
        """Patch ``model`` with the kept state on top; a no-op when it is patched already, and a
        patch on another model moves (``model_init`` builds one per ``train()``)."""
        if self.model is model:
            return model
        self.remove()
        self.memopt.apply(model)
        self._report, self._checked, self._told_memory = None, False, False
        self._told_plan = False
        self.restore()
        return model

    def remove(self) -> None:
        """Undo the patch (the model is exactly as before) and keep its state for the next."""
        if self.model is None:
            return
        self._held = self.memopt.state_dict()
        self.memopt.remove()

    def hold(self, state: Mapping[str, Any]) -> None:
        """Keep ``state`` until :meth:`restore` or the next :meth:`apply` (Lightning loads a
        callback's state after ``setup`` and it must act from ``on_fit_start``)."""
        self._held = dict(state)

    def restore(self) -> None:
        """Lay the kept state on the patched model now (kept when it does not load)."""
        if self._held is not None and self.model is not None:
            self.memopt.load_state_dict(self._held)
            self._held = None

    def state_dict(self) -> dict[str, Any]:
        """Bits, step counter, drift history and planner choice (plain Python types)."""
        return dict(self._held) if self._held is not None else self.memopt.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved: now when patched, else at the next patch."""
        if self.model is None:
            self.hold(state)
        else:
            self.memopt.load_state_dict(state)

    # ----------------------------------------------------------------- the optimizer step
    def due(self, step: int | None = None) -> bool:
        """True when a drift check is due at optimizer step ``step`` (default: the steps counted)
        and none ran in this step yet (several optimizers, several calls)."""
        return self.model is not None and not self._checked and self._internal.should_check(step)

    def check(
        self,
        loss_fn: Callable[..., torch.Tensor],
        *,
        batch: Any = None,
        step: int | None = None,
        batch_size: int | None = None,
        if_due: bool = False,
    ) -> DriftReport | None:
        """Run the drift check on ``loss_fn()`` now (every rank together); its INFO line says
        what it found and changed.

        ``loss_fn`` runs the patched model itself (not a DDP wrapper) on a small batch cut from
        a training batch of ``batch_size`` samples; or, with ``batch`` (that small batch),
        ``loss_fn(model, batch)``, which the check may run on pieces of ``batch``. The
        arguments are :meth:`MemoryOptimizer.check_drift`'s, in its order; ``if_due=True``
        checks only when :meth:`due`, else returns ``None``.
        """
        if if_due and not self.due(step):
            return None
        self._tell_plan()
        report = self.memopt.check_drift(loss_fn, batch=batch, step=step, batch_size=batch_size)
        self._report, self._checked = report, True
        return report

    def end_step(self, step: int, log_due: bool) -> dict[str, float] | None:
        """Count the optimizer step just taken and log its metrics when ``log_due`` (the
        framework's logging step) or a check ran in it; drift values only then. Returns the
        metrics logged, or ``None``."""
        self._tell_plan()
        self.memopt.count_step()
        self.log_memory()  # the first step's line, once its peak is known
        report, self._report, self._checked = self._report, None, False
        if self.log_metrics is None or (report is None and not log_due):
            return None
        metrics = self.memopt.metrics(drift=report is not None)
        self.log_metrics(metrics, step)
        return metrics

    # ----------------------------------------------------------------- the console
    def _tell_plan(self) -> None:
        """The plan's line before the first check or step of a patch, where the integration did
        not say it when training started (then any state loaded meanwhile is laid)."""
        if not self._told_plan:
            self.log_plan()

    def log_plan(self) -> None:
        """One line: how many modules each action takes (at the bits in force now: after a
        resume, the checkpoint's), dropout, batchnorm and drift."""
        if self.model is None or not self.is_main():
            return
        self._told_plan = True
        plan = self.memopt.plan
        actions: dict[str, int] = {}
        for entry in plan.values():
            if entry.action == KEEP:
                continue
            key = f"{COMPRESS}@{entry.bits}" if entry.action == COMPRESS else entry.action
            actions[key] = actions.get(key, 0) + 1
        summary = ", ".join(f"{n} {a}" for a, n in sorted(actions.items())) or "nothing to do"
        cfg = self.config
        drift = cfg.drift
        log.info(
            "memopt: plan for %d modules: %s; dropout %s, batchnorm %s; drift %s",
            len(plan),
            summary,
            cfg.dropout.mode,
            cfg.batchnorm.mode,
            f"{drift.metric} <= {drift.threshold} every {drift.check_every} steps"
            if self.drift_active
            else "off",
        )

    def measure_afresh(self) -> None:
        """Measure the next training step as the first after the patch (``memopt/peak_bytes``,
        ``memopt/batch_fits_x``, the memory line): forwards run outside the training loop's
        steps (a batch-size finder's trials) are not its."""
        self._internal.measure_afresh()

    def log_memory(self) -> None:
        """At the end of the first optimizer step after a patch (:meth:`end_step`): one line with
        what the hooks kept for backward against the bytes of what they were handed (every
        save in a compression scope over ``min_numel``, parameters left out: not the profile's
        count of the distinct storages the whole model saves), what of it they kept as it is,
        and how many times larger a batch fits (the figure ``memopt/batch_fits_x`` logs for
        the same step)."""
        compression = self._internal.compression
        if self._told_memory or compression is None or not self.is_main():
            return
        stats = compression.stats
        if not stats.saved_original:
            return
        self._told_memory = True
        fits = self._internal.batch_fits()
        log.info(
            "memopt: first training step kept %.2f MiB for backward of the %.2f MiB its hooks "
            "were handed (%.1fx less; %.2f MiB of it kept as it is)%s",
            stats.saved_stored / _MIB,
            stats.saved_original / _MIB,
            stats.forward_ratio,
            stats.kept_as_is / _MIB,
            "" if fits is None else f"; a batch {fits:.1f}x as large fits",
        )
        for line in self._kept_whole_lines():
            log.info("memopt: %s", line)

    def _kept_whole_lines(self) -> list[str]:
        """A line for each scope's dtype whose bytes kept as they are make a large share of what
        the first step kept (:attr:`.SavedStats.kept_whole`): why that scope barely shrank."""
        stats = self._internal.compression.stats
        named = dict(self.model.named_modules())
        lines = []
        ranked = sorted(stats.kept_whole.items(), key=lambda item: -item[1][1])
        for (scope, dtype), (tensors, nbytes) in ranked:
            if nbytes < _LARGE_SHARE * stats.saved_stored:
                break
            module = named.get(scope)
            label = scope or "<root>"
            if isinstance(module, nn.RNNBase) and dtype == "uint8":
                what = f"the {type(module).__name__}'s oneDNN workspace in {label}"
                why = "oneDNN keeps its gates there as raw bytes, which the codec cannot read"
            elif dtype == "bool":
                what, why = f"bool tensors in {label}", "masks are stored as they are"
            else:
                what = f"{dtype} tensors in {label}"
                why = "the codec keeps integer tensors exactly"
            lines.append(
                f"{what} ({dtype}, {tensors} tensor{'s' if tensors > 1 else ''}, "
                f"{nbytes / _MIB:.1f} MiB) is kept as it is: {why}; memopt/kept_as_is_bytes "
                "counts it"
            )
        return lines


class SessionAdapter:
    """What every framework's adapter (Lightning, ``transformers.Trainer``, Accelerate) shows of
    its one :class:`MemOptSession`: the optimizer, the config and the bits, read through to it.

    Attributes:
        session: the :class:`MemOptSession`, made by :meth:`_open_session`.
        slicer: ``slicer(batch, n) -> batch`` that keeps ``n`` samples for the drift check.
    """

    session: MemOptSession
    slicer: Callable[[Any, int], Any]

    def _open_session(
        self,
        config: str | os.PathLike[str] | Mapping[str, Any] | MemOptConfig | None,
        slicer: Callable[[Any, int], Any] | None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        """The session of ``config`` and the drift check's slicer (default: dim 0 of every
        tensor). A bad config, or a ``loss_fn`` of neither form, fails here, at construction."""
        self.session = MemOptSession(config)
        if loss_fn is not None:
            takes_model_and_batch(loss_fn)
        self.slicer = slicer or slice_batch

    @property
    def memopt(self) -> MemoryOptimizer:
        """The :class:`~memopt_plugins.MemoryOptimizer` the adapter drives."""
        return self.session.memopt

    @property
    def config(self) -> MemOptConfig:
        """The validated config."""
        return self.session.config

    @property
    def bits(self) -> dict[str, int]:
        """``{fqn: bits}`` of every compressed module (fqns within the model the adapter
        patched); between runs, those the last run ended with (or restored from a checkpoint),
        which the next run starts from."""
        return self.session.bits
