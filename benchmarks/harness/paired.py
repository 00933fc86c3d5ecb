"""Paired step times: the baseline and memopt on the same weights in ONE process, interleaved.

Every round runs each method's training step once (forward, backward, AdamW step), the order
rotating per round, so all of them see the same load of the machine; a method's ratio in a round
is its step over the baseline step of that round, read in thread CPU time (what this thread ran,
not what it waited for) and in wall time. Reports give the median and quartiles of the rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from memopt_plugins import MemoryOptimizer


@dataclass
class TrainStep:
    """One model's training step on a fixed batch: ``loss_fn(model, batch)`` inside
    ``context()``, backward, AdamW on the trainable parameters; memopt's step counted."""

    model: torch.nn.Module
    batch: Any
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    context: Callable[[], AbstractContextManager] = nullcontext
    opt: MemoryOptimizer | None = None
    optimizer: torch.optim.Optimizer = field(init=False)

    def __post_init__(self) -> None:
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=1e-4)

    def __call__(self) -> None:
        with self.context():
            loss = self.loss_fn(self.model, self.batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.opt is not None:
            self.opt.count_step()


def timed(step: Callable[[], object]) -> tuple[float, float]:
    """(thread CPU seconds, wall seconds) of one ``step()``."""
    cpu, wall = time.thread_time(), time.perf_counter()
    step()
    return time.thread_time() - cpu, time.perf_counter() - wall


def interleaved(steps: list[Callable[[], object]], rounds: int) -> list[list[tuple[float, float]]]:
    """``rounds`` rounds of one :func:`timed` step of each, the order rotating per round:
    ``out[r][i]`` is step ``i``'s (cpu, wall) in round ``r``."""
    out = []
    n = len(steps)
    for r in range(rounds):
        row: list[tuple[float, float]] = [(0.0, 0.0)] * n
        for i in [(r + k) % n for k in range(n)]:
            row[i] = timed(steps[i])
        out.append(row)
    return out


def ratios(times: list[list[tuple[float, float]]], i: int, base: int = 0) -> dict[str, list]:
    """Step ``i``'s ratio to step ``base`` in each round, in CPU and in wall time."""
    return {
        "cpu": [row[i][0] / row[base][0] for row in times],
        "wall": [row[i][1] / row[base][1] for row in times],
    }


def quartiles(values: list[float]) -> str:
    """The median and the quartiles of ``values``, as ratios."""
    q = statistics.quantiles(values, n=4)
    return f"{statistics.median(values):.3f}× ({q[0]:.3f}–{q[2]:.3f})"
