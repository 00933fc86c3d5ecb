"""Samples per second read apart from any other work: each reading its own fresh process.

A study's child process builds one method's model at its batch, runs :func:`timed_steps` (a
warm-up, then timed steps) and hands the seconds back; the parent repeats that in separate
processes and keeps the :class:`Spread` of their samples per second. A fresh process per reading
keeps one method's allocator state, caches and threads out of another's time, and the spread
between processes says how far a figure can be trusted.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from .timing import seconds


def timed_steps(step: Callable[[], object], warmup: int, steps: int) -> list[float]:
    """Wall seconds of each of ``steps`` calls of ``step`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    return [seconds(step) for _ in range(steps)]


@dataclass(frozen=True)
class Spread:
    """The median of a few readings and their range (each reading one process's)."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    def __str__(self) -> str:
        return f"{self.median:.1f} ({self.low:.1f}–{self.high:.1f})"
