"""Step time: the median forward + backward seconds of every method on the measurement batch.

Methods are alternated round-robin, the order rotating every round, so that load drift on the
machine hits all of them alike; a few warm-up steps of each come first. Timings are reported,
never asserted.
"""

from __future__ import annotations

import statistics
import time

import torch
from harness import Measured, Settings, sync
from methods import Patched
from workloads import Workload


def time_steps(
    measured: Measured, workload: Workload, settings: Settings, device: torch.device
) -> dict[int, float]:
    """Median forward + backward seconds of each method, round-robin with a rotating order.

    ``settings.warmup_steps`` untimed steps of each method first, then
    ``settings.timed_rounds`` rounds; a method that raises is dropped from ``measured``.
    """

    def step(i: int, p: Patched) -> None:
        p.model.zero_grad(set_to_none=True)
        p.loss(workload.loss_fn, workload.measure).backward()

    for _ in range(settings.warmup_steps):
        measured.each(step)
    times: dict[int, list[float]] = {i: [] for i in range(len(measured.patched))}
    n = len(measured.patched)
    for r in range(settings.timed_rounds):
        for i in [(r + k) % n for k in range(n)]:
            p = measured.patched[i]
            if p is None:
                continue
            try:
                sync(device)
                start = time.perf_counter()
                step(i, p)
                sync(device)
                times[i].append(time.perf_counter() - start)
            except Exception as exc:
                measured.drop(i, exc)
    return {i: statistics.median(t) for i, t in times.items() if t and i not in measured.errors}
