"""Step time: the median forward + backward seconds of every method on the measurement batch.

Methods are alternated round-robin, the order rotating every round, so that load drift on the
machine hits all of them alike; a few warm-up steps of each come first. Timings are reported,
never asserted. :func:`median_seconds` times one call the same way (warm-up, then the median).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch

from .measured import Measured, Settings, sync
from .methods import Patched
from .workloads import Workload

#: The device of the studies that run on the CPU alone (nothing queued to wait for).
CPU = torch.device("cpu")


def seconds(fn: Callable[[], object], device: torch.device = CPU) -> float:
    """Wall seconds of ``fn()``, the device's queued work included."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 10) -> float:
    """Median :func:`seconds` of ``repeats`` calls of ``fn`` after an untimed one."""
    fn()
    return statistics.median(seconds(fn, device) for _ in range(repeats))


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
                times[i].append(seconds(functools.partial(step, i, p), device))
            except Exception as exc:
                measured.drop(i, exc)
    return {i: statistics.median(t) for i, t in times.items() if t and i not in measured.errors}
