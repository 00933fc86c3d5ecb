"""Convergence: every method trains the same model on the same batches, then the held-out loss.

AdamW for a fixed number of steps (:func:`lr_factor`'s warm-up and cosine decay) from the same
initial weights, the runs interleaved step by step (:func:`train_interleaved`), each with its
own RNG stream, so every run equals a standalone seeded one. Every method trains on the
workload's seeds and the baseline also on as many other seeds (the run-to-run spread); the final
losses are compared with the baseline's seed by seed (:mod:`stats`), and the CNN repeats this on
a short schedule with many more seeds (:func:`train`). BatchNorm statistics are re-estimated for
the final weights before the held-out loss (:func:`final_losses`).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .measured import failure, rng_state, set_rng_state, shape_of, sync
from .methods import BASELINE, LOSS_BARS, Method, Patched
from .records import NOISE, Row, WorkloadResult, harness_row
from .stats import Paired
from .workloads import Workload, evaluate, precise_batchnorm


def lr_factor(steps: int, warmup: int = 10, floor: float = 0.1) -> Callable[[int], float]:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``floor`` at ``steps``.

    The decay lets the final loss settle, so that runs compare on where they end up rather than
    on the noise of their last steps.
    """

    def factor(step: int) -> float:
        ramp = min(1.0, (step + 1) / warmup)
        cosine = 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))
        return ramp * (floor + (1 - floor) * cosine)

    return factor


@dataclass
class TrainingRun:
    """One method's training run, advanced a step at a time by :func:`train_interleaved`."""

    row: Row
    patched: Patched
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    batches: list[Any]
    rng: tuple[torch.Tensor, torch.Tensor | None]
    seed: int
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None


def train_interleaved(runs: list[TrainingRun], workload: Workload, device: torch.device) -> None:
    """Train every run on its batches, one step each in turn (rotating order).

    Each run keeps its own RNG state (swapped in around its step), so it draws exactly the
    dropout masks a standalone run seeded the same way would. A run that raises stops there.
    """
    steps = len(runs[0].batches)
    for step in range(steps):
        for k in range(len(runs)):
            run = runs[(step + k) % len(runs)]
            if run.error is not None:
                continue
            batch = run.batches[step]
            set_rng_state(run.rng, device)
            try:
                sync(device)
                start = time.perf_counter()
                loss = run.patched.loss(workload.loss_fn, batch)
                loss.backward()
                run.patched.after_backward(workload.loss_fn, batch, step)
                run.optimizer.step()
                run.schedule.step()
                run.optimizer.zero_grad(set_to_none=True)
                run.patched.after_step()
                run.losses.append(float(loss))
                run.seconds += time.perf_counter() - start
            except Exception as exc:
                run.error = f"step {step}: {failure(exc)}"
            run.rng = rng_state(device)


def train(
    workload: Workload,
    methods: list[Method],
    rows: list[Row],
    result: WorkloadResult,
    device: torch.device,
) -> None:
    """Convergence runs of every method on ``workload.seeds``, plus the baseline on as many other
    seeds (the run-to-run spread); fills ``rows`` with the means over seeds."""
    seeds = list(workload.seeds)
    others = [s + len(seeds) for s in seeds]
    pristine = workload.build().to(device).train()
    baseline = next(m for m in methods if m.name == BASELINE)
    noise_row = harness_row(
        NOISE, baseline.family, f"seeds {others}: other data order, dropout masks"
    )
    plan = [(m, r, seeds) for m, r in zip(methods, rows, strict=True) if r.bench.error is None]
    plan.append((baseline, noise_row, others))
    runs = start_runs(plan, workload, pristine, device)
    train_interleaved(runs, workload, device)
    losses = final_losses(runs, workload)
    for row, pairs in paired_losses(runs, losses):
        row.trained.paired = Paired.of(pairs) if len(pairs) > 1 else None
    for row in [r for _, r, _ in plan]:
        summarize_runs(row, [run for run in runs if run.row is row], losses)
    if workload.short_steps is not None:
        judged = (BASELINE, *LOSS_BARS)  # more seeds: their 1% bar needs a ~1% interval
        short_plan = [
            (m, row, list(workload.bar_seeds if m.name in judged else workload.short_seeds))
            for m, row, _ in plan[:-1]
        ]
        short = start_runs(short_plan, workload, pristine, device, workload.short_steps)
        train_interleaved(short, workload, device)
        losses = final_losses(short, workload)
        for row, pairs in paired_losses(short, losses):
            row.trained.short_loss = statistics.fmean(loss for loss, _ in pairs)
            row.trained.short_paired = Paired.of(pairs) if len(pairs) > 1 else None
        unpatch(short)
        result.short_seeds = len(workload.short_seeds)
        result.bar_seeds = len(workload.bar_seeds)
    rows.append(noise_row)
    result.train_steps = len(runs[0].batches)
    result.train_shape = shape_of(runs[0].batches[0])
    result.lr = workload.lr
    result.seeds = len(seeds)
    result.short_steps = workload.short_steps
    result.precise_bn = bool(workload.calibration)


def start_runs(
    plan: list[tuple[Method, Row, list[int]]],
    workload: Workload,
    pristine: nn.Module,
    device: torch.device,
    steps: int | None = None,
) -> list[TrainingRun]:
    """A training run per (method, seed) of ``plan``, each on a copy of ``pristine``, over the
    seed's batches (the first ``steps`` of them, with the schedule fitted to that length)."""
    runs = []
    for method, row, row_seeds in plan:
        for seed in row_seeds:
            data = workload.train_batches(seed)[:steps]
            model = copy.deepcopy(pristine)
            torch.manual_seed(seed)
            try:
                patched = method.apply(model, workload, data[0], False, None)
            except Exception as exc:
                row.trained.training = f"failed: {failure(exc)}"
                break
            adamw = torch.optim.AdamW(model.parameters(), lr=workload.lr, weight_decay=0.01)
            schedule = torch.optim.lr_scheduler.LambdaLR(adamw, lr_factor(len(data)))
            runs.append(TrainingRun(row, patched, adamw, schedule, data, rng_state(device), seed))
    return runs


def final_losses(runs: list[TrainingRun], workload: Workload) -> dict[int, tuple]:
    """``evaluate``'s (held-out loss, accuracy) of every run that finished, by ``id(run)``.

    BatchNorm statistics are re-estimated for the final weights first (:func:`precise_batchnorm`),
    except where the method froze them (memopt's running mode past its warm-up): those statistics
    are part of the function it trained, as ``FrozenBatchNorm2d``'s are.
    """
    losses = {}
    for run in runs:
        if run.error:
            continue
        if not run.patched.batchnorm_frozen:
            precise_batchnorm(run.patched.model, workload)
        losses[id(run)] = evaluate(run.patched.model, workload)
    return losses


def paired_losses(
    runs: list[TrainingRun], losses: dict[int, tuple]
) -> list[tuple[Row, list[tuple[float, float]]]]:
    """Per row, ``(loss, baseline's loss)`` on each seed both finished: the same initial
    weights and batches, so seed-to-seed noise cancels in the comparison."""
    baseline = {run.seed: losses.get(id(run)) for run in runs if run.row.method == BASELINE}
    rows: dict[int, tuple[Row, list]] = {}
    for run in runs:
        base = baseline.get(run.seed)
        if id(run) in losses and base is not None:
            rows.setdefault(id(run.row), (run.row, []))[1].append((losses[id(run)][0], base[0]))
    return list(rows.values())


def unpatch(runs: list[TrainingRun]) -> None:
    """Remove the memopt patches of finished runs."""
    for run in runs:
        if run.patched.optimizer is not None:
            run.patched.optimizer.remove()


def summarize_runs(row: Row, runs: list[TrainingRun], losses: dict[int, tuple]) -> None:
    """Means over the seeds of one method (loss, accuracy, speed) from its runs and their
    :func:`final_losses`; any failure fails the row."""
    trained = row.trained
    errors = [run.error for run in runs if run.error is not None]
    if errors:
        trained.training = f"failed at {errors[0]}"
        trained.paired = None
    elif runs and not trained.training.startswith("failed"):
        tail = max(1, len(runs[0].losses) // 10)
        finals = [losses[id(run)] for run in runs]
        held_out = [loss for loss, _ in finals]
        trained.val_loss = statistics.fmean(held_out)
        trained.val_spread = (max(held_out) - min(held_out)) / 2 if len(held_out) > 1 else None
        trained.accuracy = None if finals[0][1] is None else statistics.fmean(a for _, a in finals)
        trained.train_loss = statistics.fmean(sum(run.losses[-tail:]) / tail for run in runs)
        trained.train_seconds = sum(run.seconds for run in runs) / sum(len(r.losses) for r in runs)
        trained.training = runs[0].patched.training_summary()  # the first seed's
        bits = [run.patched.mean_bits() for run in runs]
        trained.mean_bits = None if None in bits else statistics.fmean(bits)
    unpatch(runs)
