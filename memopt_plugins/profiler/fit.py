"""What fits: a config for a budget on the step's peak (or an absolute cap), verified by running it,
and the largest batch that fits under a cap; ``memopt plan`` reads this.

The peak of a step decides the batch that fits, and it is more than the bytes saved for backward:
the backward adds gradients in flight and workspaces on top of what is still saved (``transient``
below), and a recompute region re-creates its activations. :func:`plan_peak` turns the peak target
into a target on the saved bytes (the target less the baseline's transient), lets
:func:`~.plan.suggest_config` choose for it, then runs a step under the config on the allocator's
timeline; when the measured peak is over, it bisects the saved-bytes target for the largest one
whose measured peak meets the peak target (or says none does).

An absolute cap (``memory``) covers the whole step: what is allocated before it (parameters,
gradients, optimizer state, the batch) plus the step's peak. The largest batch under it is read on
the whole training (:func:`fitting_batch` over :mod:`.training`'s readings, drift checks included);
without a way to build the model again, on the step alone (:func:`largest_batch`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import OFF_BITS, MemOptConfig
from ..tree import tensors_in
from .plan import Suggestion, suggest_config
from .report import ProfileReport, StepMemory, fits_line, step_fits
from .run import batch_size, profile_model, step_memory
from .training import Training, resize_batch, training_peak
from .units import human_bytes

#: Bisection steps of :func:`plan_peak` (each runs one config) and tries of :func:`largest_batch`.
TRIES = 5
#: The least share of the saved bytes :func:`plan_peak` asks the planner for.
MIN_SHARE = 1e-3
#: Readings of a whole training :func:`fitting_batch` takes at most.
READINGS = 6
#: The share of the cap a whole training's reading leaves free: a process read another way (a
#: training loop written a little differently, other imports before it starts) reads a few
#: percent more or less.
MARGIN = 0.05


@dataclass(frozen=True)
class PeakPlan:
    """A config for a peak target, with what was measured running it."""

    suggestion: Suggestion
    baseline_peak: int  # the step's peak without memopt (above what is allocated before it)
    target_peak: int  # the most the step's peak may be
    peak: int  # measured under the config
    held_before: int  # parameters, gradients, optimizer state and the batch
    batch: int | None  # the factory's batch size
    largest_batch: int | None = None  # under ``memory``, verified by a step at that size
    largest_batch_total: int | None = None  # held before + peak, measured at that size
    memory: int | None = None
    baseline_batch: int | None = None  # the largest without memopt, verified the same way
    optimizer: str | None = None  # the optimizer whose state is counted, as named to the plan
    steps: int | None = None  # whole-training readings: steps each ran (None: the step alone)
    step_without: StepMemory | None = None  # the baseline's step at the factory's batch
    step_with: StepMemory | None = None  # the same under this config (``peak`` is its peak)

    @property
    def met(self) -> bool:
        return self.peak <= self.target_peak * 1.05

    @property
    def fits(self) -> float | None:
        """How many times larger a batch fits with this config, from the two steps' per-sample
        peaks (:func:`~.report.step_fits`: the profile report's and ``memopt/batch_fits_x``'s
        figure); ``None`` without both steps or their per-sample slopes."""
        if self.step_without is None:
            return None
        return step_fits(self.step_without, self.step_with)

    def to_yaml(self) -> str:
        """The config with a commented header of the peak figures."""
        lines = [
            f"# memopt plan for the step's peak: {human_bytes(self.target_peak)} at most "
            f"({self.target_peak / self.baseline_peak:.0%} of the baseline's "
            f"{human_bytes(self.baseline_peak)}; batch {self.batch})",
            f"# measured with this config: peak {human_bytes(self.peak)} "
            f"({self.peak / self.baseline_peak:.0%})"
            + ("" if self.met else " - over the target: no config of these options reaches it"),
        ]
        fits = None if self.step_without is None else fits_line(self.step_without, self.step_with)
        if fits is not None:
            lines.append(f"# {fits}")
        if self.memory is not None:
            lines += self._batch_lines()
        return "\n".join(lines) + "\n" + self.suggestion.to_yaml()

    def _batch_lines(self) -> list[str]:
        """The largest batches under ``memory``: without memopt, with this config, and what
        drift checks can do to the latter."""
        memory = human_bytes(self.memory)
        baseline = "none" if self.baseline_batch is None else str(self.baseline_batch)
        state = f"{self.optimizer} state" if self.optimizer else "no optimizer state"
        lines = [
            f"# under {memory} for the whole {'step' if self.steps is None else 'training'} "
            f"({state} counted): largest batch without "
            f"memopt {baseline}, with this config "
            + ("none" if self.largest_batch is None else str(self.largest_batch)),
        ]
        if self.largest_batch is None:
            return lines
        config = self.suggestion.config
        if self.steps is None:
            lines.append(
                f"#   with this config: measured {human_bytes(self.largest_batch_total)} at batch "
                f"{self.largest_batch} (parameters, gradients, optimizer state and the batch of "
                f"{self.batch}: {human_bytes(self.held_before)} held before the step; the step "
                "alone, without drift checks)"
            )
        else:
            lines.append(
                f"#   with this config: measured {human_bytes(self.largest_batch_total)} at batch "
                f"{self.largest_batch} ({self.largest_batch_total / self.memory:.0%} of the cap): "
                f"{self.steps} training steps in a fresh process, above its "
                "idle memory - model, gradients, optimizer state, batch, activations, a drift "
                "check on every step (where the config checks) and the code a first step loads"
            )
        lines.append(
            f"#   at the bits below ({_bits_of(config)}). Drift checks may raise bits later: "
            + (
                "quantize.budget/memory holds them at its bytes, and the batch after the guard "
                f"is {self.largest_batch} if it holds the starting bits (its expected steady state)"
                if config.quantize.targets_memory
                else "without quantize.budget or quantize.memory they can climb to 32, down to "
                f"the batch without memopt ({baseline}); either guards the batch"
            )
        )
        return lines


def _bits_of(config: Any) -> str:
    quantize = config.quantize
    widths = sorted({quantize.bits, *quantize.overrides.values()} - {32})
    return "/".join(str(b) for b in widths) + " bits" if widths else "no compression"


def model_bytes(report: ProfileReport) -> int:
    """Parameters, gradients and optimizer state: held before a step, whatever the batch."""
    root = report.modules[0]
    return root.params + root.grads + root.optimizer_state


def batch_bytes(batch: Any) -> int:
    return sum(t.nbytes for t in tensors_in(batch))


def plan_peak(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    budget: float | None = None,
    memory: int | None = None,
    bits: int | None = None,
    base: MemOptConfig | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    device: str | torch.device | None = None,
    optimizer_name: str | None = None,
    training: Training | None = None,
) -> PeakPlan:
    """A config keeping the step's peak within ``budget`` of the baseline's peak, or the whole
    step within ``memory`` bytes (both given: the tighter), verified by running it. The state of
    ``optimizer`` (created by one step, then undone) counts as held before the step; under
    ``memory`` the largest batch that fits is found with the config and without memopt.

    With ``training`` (how to build the model again, and its optimizer), that batch is the
    largest whose whole training fits: read in fresh processes (:mod:`.training`), drift checks
    and all, as a user reads it. Without it, the step alone on the allocator's timeline.
    ``bits=None`` takes ``base``'s ``quantize.bits`` where it compresses: a config asks for them.
    """
    if budget is None and memory is None:
        raise ValueError("plan_peak needs a budget, a memory cap, or both")
    if bits is None and base is not None and base.quantize.bits < OFF_BITS:
        bits = base.quantize.bits
    report = profile_model(model, batch, loss_fn, optimizer=optimizer, device=device)
    baseline_peak, baseline_saved = report.reading.peak, report.saved_total
    fixed = model_bytes(report) + batch_bytes(batch)
    targets = []
    if budget is not None:
        targets.append(budget * baseline_peak)
    if memory is not None:
        targets.append(memory - fixed)
    target = max(min(targets), 1)
    transient = max(baseline_peak - report.reading.retained, 0)
    first = (target - transient) / baseline_saved if baseline_saved else 1.0
    share = min(max(first, MIN_SHARE), 1.0)

    def attempt(share: float) -> tuple[Suggestion, StepMemory]:
        suggestion = suggest_config(report, share, base=base, bits=bits)
        return suggestion, step_memory(model, batch, loss_fn, suggestion.config, device=device)

    # The largest share of the saved bytes whose measured peak meets the target, by bisection
    # from the estimate (the peak grows with what is kept, not exactly in proportion).
    best = tried = attempt(share)
    if best[1].reading.peak > target:
        low, high = MIN_SHARE, share
        for _ in range(TRIES):
            share = (low + high) / 2
            tried = attempt(share)
            if tried[1].reading.peak <= target:
                best, low = tried, share
            else:
                high = share
        if best[1].reading.peak > target:  # nothing met it: the lowest share tried
            best = tried if tried[1].reading.peak < best[1].reading.peak else best
    suggestion, step = best
    plan = PeakPlan(
        suggestion,
        baseline_peak,
        int(target),
        step.reading.peak,
        fixed,
        batch_size(batch),
        optimizer=optimizer_name or (type(optimizer).__name__ if optimizer else None),
        step_without=report.step,
        step_with=step,
    )
    if memory is None:
        return plan
    plan = dataclasses.replace(plan, memory=memory)
    return _with_largest_batches(plan, model, batch, loss_fn, report, step, training, device)


def _with_largest_batches(
    plan: PeakPlan,
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    report: ProfileReport,
    step: StepMemory,
    training: Training | None,
    device: str | torch.device | None,
) -> PeakPlan:
    """``plan`` with the largest batches that fit ``plan.memory``, with its config and without
    memopt: by the step alone on the allocator's timeline, or with ``training``, by whole
    training runs read in fresh processes."""
    memory, config = plan.memory, plan.suggestion.config
    if training is None:
        held = model_bytes(report)
        found = largest_batch(model, batch, loss_fn, config, memory, step, held, device)
        baseline = largest_batch(model, batch, loss_fn, None, memory, report.step, held, device)
    else:
        n = batch_size(batch)
        found = fitting_batch(
            lambda size: training_peak(training, config, size), n, _per_sample(step, batch), memory
        )
        baseline = fitting_batch(
            lambda size: training_peak(training, None, size),
            n,
            _per_sample(report.step, batch),
            memory,
        )
    plan = dataclasses.replace(
        plan,
        baseline_batch=None if baseline is None else baseline[0],
        steps=None if training is None else training.steps,
    )
    if found is None:
        return plan
    size, total = found
    return dataclasses.replace(plan, largest_batch=size, largest_batch_total=total)


def largest_batch(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    config: MemOptConfig | None,
    memory: int,
    step: StepMemory,
    fixed: int,
    device: str | torch.device | None = None,
) -> tuple[int, int] | None:
    """The largest batch whose whole step (``fixed`` model bytes, the batch, the step's peak)
    fits in ``memory`` under ``config`` (``None``: without memopt), from the per-sample slope of
    ``step`` (measured under it), verified by a step at that size (over: the next size from the
    slope between ``step``'s batch and that size): ``(size, measured bytes)``, or ``None`` when
    not even one sample fits."""
    n = batch_size(batch)
    if n is None or step.per_sample is None or step.per_sample.peak <= 0:
        return None
    per_sample = step.per_sample.peak + batch_bytes(batch) / n
    total_now = fixed + batch_bytes(batch) + step.reading.peak
    size = n + math.floor((memory - total_now) / per_sample)
    for _ in range(TRIES):
        if size < 1:
            return None
        bigger = resize_batch(batch, size)
        measured = step_memory(model, bigger, loss_fn, config, device=device)
        total = fixed + batch_bytes(bigger) + measured.reading.peak
        if total <= memory:
            return size, total
        if size > n and total > total_now:  # the slope between the two measured sizes
            per_sample = (total - total_now) / (size - n)
            size = min(size - 1, n + math.floor((memory - total_now) / per_sample))
        else:
            size = min(size - 1, math.floor(size * memory / total))
    return None


def _per_sample(step: StepMemory, batch: Any) -> float | None:
    """Bytes one more sample adds to ``step``'s whole step: its peak's slope and its batch."""
    n = batch_size(batch)
    if n is None or step.per_sample is None or step.per_sample.peak <= 0:
        return None
    return step.per_sample.peak + batch_bytes(batch) / n


def fitting_batch(
    read: Callable[[int], int], n: int | None, per_sample: float | None, memory: int
) -> tuple[int, int] | None:
    """The largest batch size whose reading ``read(size)`` (a whole training's bytes) is at
    most ``memory`` less :data:`MARGIN`, and that reading, from at most :data:`READINGS`
    readings starting at ``n``; ``None`` when not even one sample fits. Each next size is where
    the slope between two readings (``per_sample``, the step's own slope, before there are two)
    meets the cap, and the search ends when one more sample would cross it."""
    if n is None or per_sample is None:
        return None
    limit = memory * (1 - MARGIN)
    readings: dict[int, int] = {}
    size: int | None = n
    for _ in range(READINGS):
        if size is None:
            break
        readings[size] = read(size)
        size = _next_size(readings, per_sample, limit)
    fits = [size for size, total in readings.items() if total <= limit]
    return (max(fits), readings[max(fits)]) if fits else None


def _next_size(readings: dict[int, int], per_sample: float, limit: float) -> int | None:
    """The size to read next (``None``: none is left that could fit better than the largest
    read within ``limit``)."""
    fits = [size for size, total in readings.items() if total <= limit]
    fit = max(fits) if fits else None
    overs = [size for size, total in readings.items() if total > limit and (fit or 0) < size]
    over = min(overs) if overs else None
    # the slope between the readings on either side of the limit, else the two nearest it
    pair = [fit, over] if fit and over else sorted(readings, key=lambda s: abs(readings[s] - limit))
    a, b = sorted(pair[:2]) if len(pair) >= 2 else (0, 0)
    slope = (readings[b] - readings[a]) / (b - a) if b > a else 0.0
    slope = slope if slope > 0 else per_sample
    if fit is not None:
        if readings[fit] + slope > limit:
            return None  # one more sample crosses the limit
        guess = fit + max(1, math.floor((limit - readings[fit]) / slope))
    else:
        assert over is not None
        guess = max(1, over - max(1, math.ceil((readings[over] - limit) / slope)))
    if over is not None:
        guess = min(guess, over - 1)
    if guess < 1 or guess in readings or (fit is not None and guess <= fit):
        return None
    return guess
