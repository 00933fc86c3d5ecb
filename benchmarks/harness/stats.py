"""Paired comparisons of held-out losses: a method against the baseline, seed by seed.

Runs on the same seed start from the same weights and see the same batches, so the seed-to-seed
noise cancels in the ratio of their final losses; :class:`Paired` summarizes those ratios with a
95% Student's t interval (``scipy.stats``, the ``bench`` extra).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass
class Paired:
    """A method's held-out loss against the baseline's on the same seeds.

    ``change``: mean over seeds of ``loss / baseline's loss - 1``; ``ci``: half-width of its 95%
    confidence interval (Student's t over the seeds); ``worse``: seeds on which the method's
    loss is higher; ``seeds``: how many seeds were compared.
    """

    change: float
    ci: float
    worse: int
    seeds: int

    @classmethod
    def of(cls, pairs: list[tuple[float, float]]) -> Paired:
        """From ``(loss, baseline's loss)`` per seed (at least two seeds)."""
        from scipy.stats import t  # here, not at the top: the memory child never loads scipy

        changes = [loss / base - 1 for loss, base in pairs]
        n = len(changes)
        ci = t.ppf(0.975, n - 1) * statistics.stdev(changes) / math.sqrt(n)
        return cls(statistics.fmean(changes), float(ci), sum(c > 0 for c in changes), n)
