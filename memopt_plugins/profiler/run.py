"""``profile_model``: measure one training step of a model per module, as is and under a config.

It runs one step of ``loss_fn(model, batch)`` and records it with the measurement layer's
:class:`~memopt_plugins.measure.StepRecorder`: every storage autograd saves for backward belongs
to the innermost module running when it is first saved (a storage saved several times counts
once), and the bytes roll up to the parents, next to each module's parameters, gradients,
optimizer state and forward time. With a config it runs the step again with
:class:`~memopt_plugins.MemoryOptimizer` applied and counts once more (the compression hooks tell
the recorder what they keep), so "after" is measured, not estimated. The model, its gradients,
the optimizer state, every RNG stream and the modes are left as they were
(:func:`~memopt_plugins.measure.isolated`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..compress.hooks import PackObserver
from ..config import MemOptConfig, load_config
from ..engine import MemoryOptimizer, patched_by
from ..logs import quiet
from ..measure.isolate import isolated
from ..measure.step import Measurement, SavedStorage, StepRecorder
from ..measure.timeline import StepTimeline, record_step
from ..select import layer_kind, parent_fqns
from ..tree import slice_batch, tensors_in
from .meter import MemoryReading
from .report import LOSS_ROW, ModuleProfile, PerSample, ProfileReport, StepMemory


def _add_up(rows: dict[str, ModuleProfile], owner: str, attr: str, nbytes: int) -> None:
    for fqn in (owner, *parent_fqns(owner)):
        row = rows[fqn]
        setattr(row, attr, getattr(row, attr) + nbytes)


def _roll_up_saved(
    rows: dict[str, ModuleProfile], storages: Iterable[SavedStorage], after: bool
) -> None:
    total, own = ("saved_after", "self_saved_after") if after else ("saved", "self_saved")
    for row in rows.values():
        setattr(row, total, 0)
        setattr(row, own, 0)
    for s in storages:
        owner = LOSS_ROW if s.owner is None else s.owner
        setattr(rows[owner], own, getattr(rows[owner], own) + s.nbytes)
        chain = [owner] if s.owner is None else [owner, *parent_fqns(owner)]
        for fqn in chain:
            row = rows[fqn]
            setattr(row, total, getattr(row, total) + s.nbytes)
            if not after:
                row.tensors += 1


def _timed_step(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    device: torch.device,
    optimizer: MemoryOptimizer | None,
) -> tuple[MemoryReading, StepTimeline]:
    """One forward and backward on the allocator's timeline."""
    compression = optimizer.internal.compression if optimizer is not None else None
    packed = [0]

    def forward() -> torch.Tensor:
        loss = loss_fn(model, batch)
        packed[0] = compression.stats.held_bytes if compression is not None else 0
        return loss

    timeline = record_step(model, forward, device)
    return MemoryReading(timeline.retained, timeline.peak, packed[0], str(device)), timeline


def _recorded_step(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    optimizer: MemoryOptimizer | None,
) -> Measurement:
    """One forward and backward recorded per module (a step of its own: the recorder's operation
    counter, a dispatch mode, would hide memopt's ranges from the timeline)."""
    compression = optimizer.internal.compression if optimizer is not None else None
    recorder = StepRecorder(model, tensors_in(batch))
    observer: PackObserver = recorder
    with compression.observed(observer) if compression is not None else nullcontext():
        with recorder:
            loss = loss_fn(model, batch)
            measurement = recorder.stop()
    loss.backward()
    return measurement


def _measured_step(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    device: torch.device,
    optimizer: MemoryOptimizer | None = None,
) -> StepMemory:
    """A warm-up step, the measured one, one recorded per module, and one on the first half of
    the batch."""
    loss_fn(model, batch).backward()  # gradients and lazy state exist first
    reading, timeline = _timed_step(model, batch, loss_fn, device, optimizer)
    measurement = _recorded_step(model, batch, loss_fn, optimizer)
    n = batch_size(batch)
    per_sample = None
    if n is not None and n >= 2:
        half = slice_batch(batch, n // 2)
        loss_fn(model, half).backward()
        small, _ = _timed_step(model, half, loss_fn, device, optimizer)
        samples = n - n // 2
        per_sample = PerSample(
            (n // 2, n),
            (reading.retained - small.retained) / samples,
            (reading.peak - small.peak) / samples,
        )
    return StepMemory(reading, measurement, timeline, per_sample)


def batch_size(batch: Any) -> int | None:
    """The length of dim 0 of the batch's first tensor (``None`` without one)."""
    first = next((t for t in tensors_in(batch) if t.dim() > 0), None)
    return None if first is None else first.shape[0]


def step_memory(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    config: MemOptConfig | Mapping[str, Any] | str | Path | None = None,
    *,
    device: str | torch.device | None = None,
) -> StepMemory:
    """One step on the allocator's timeline, after a warm-up, with its per-sample slope, as is or
    under ``config`` (applied, then removed); the model, its gradients and the global RNG are
    left as they were. Unlike :func:`profile_model` it never runs the model without ``config``:
    at a batch that only fits with memopt, that step would not fit."""
    device = _device_of(model, device)
    with isolated(model, devices=[device], clear_grads=True):
        if config is None:
            return _measured_step(model, batch, loss_fn, device)
        opt = MemoryOptimizer(load_config(config))
        with quiet():
            opt.apply(model)
        try:
            return _measured_step(model, batch, loss_fn, device, opt)
        finally:
            opt.remove()


def _device_of(model: nn.Module, device: str | torch.device | None) -> torch.device:
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    return torch.device(device)


def profile_model(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    config: MemOptConfig | Mapping[str, Any] | str | Path | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    device: str | torch.device | None = None,
) -> ProfileReport:
    """Measure one training step of ``loss_fn(model, batch)`` per module.

    Counts parameters, gradients, optimizer state (when ``optimizer`` is given; one ``step()`` is
    taken to create it and then undone) and the bytes each module saves for backward, next to the
    step's memory over time as the allocator saw it (:func:`~memopt_plugins.measure.timeline.
    record_step`: retained and peak bytes, where the peak is and what is alive there) and the
    per-sample slope of both from a second step on half the batch. Each measured step follows a
    warm-up step, so one-time allocations of a first step are not counted. With ``config`` the
    steps run again under :class:`MemoryOptimizer` and every module's bytes are counted again
    ("after"). The model
    must not be patched already. Its parameters, buffers, gradients, the optimizer state and the
    global RNG are as before when this returns.
    """
    if patched_by(model) is not None:
        raise RuntimeError(
            "profile_model measures the model as it is, then under the plan of `config`: call it "
            "before MemoryOptimizer.apply(model) or after remove()"
        )
    cfg = load_config(config)
    device = _device_of(model, device)
    named = list(model.named_modules())
    rows = {fqn: ModuleProfile(fqn, layer_kind(m)) for fqn, m in named}
    rows[LOSS_ROW] = ModuleProfile(LOSS_ROW, "loss")

    after: StepMemory | None = None
    plan = {}
    with isolated(model, optimizer, devices=[device], clear_grads=True):
        before = _measured_step(model, batch, loss_fn, device)
        if config is not None:
            opt = MemoryOptimizer(cfg)
            with quiet():  # a measurement's patch: its lines would read as the training one's
                opt.apply(model)
            try:
                plan = opt.plan
                after = _measured_step(model, batch, loss_fn, device, opt)
            finally:
                opt.remove()
        for name, p in model.named_parameters():
            owner = name.rpartition(".")[0]
            _add_up(rows, owner, "params", p.nbytes)
            if p.grad is not None:
                _add_up(rows, owner, "grads", p.grad.nbytes)
        if optimizer is not None:
            optimizer.step()
            for name, p in model.named_parameters():
                state = optimizer.state.get(p, {})
                nbytes = sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))
                _add_up(rows, name.rpartition(".")[0], "optimizer_state", nbytes)

    for fqn, cost in before.measurement.costs.items():
        row = rows[fqn]
        row.forward_s, row.freeable, row.kept_inputs = (
            cost.seconds,
            cost.saved_bytes,
            cost.kept_inputs,
        )
    _roll_up_saved(rows, before.measurement.storages, after=False)
    if after is not None:
        _roll_up_saved(rows, after.measurement.storages, after=True)
    for fqn, p in plan.items():
        if fqn in rows:
            rows[fqn].action, rows[fqn].bits, rows[fqn].lean = p.action, p.bits, p.lean
    modules = [rows[fqn] for fqn, _ in named]
    if rows[LOSS_ROW].saved or rows[LOSS_ROW].saved_after:
        modules.append(rows[LOSS_ROW])
    return ProfileReport(modules, before, after, cfg, optimizer is not None)
