"""What the benchmark's phases share: how much to measure, and every method on its own model.

:class:`Settings` says how much of each measurement to take (:data:`FULL_SETTINGS` for
``make bench``, :data:`QUICK_SETTINGS` for ``--quick``). :class:`Measured` patches a copy of one
workload's model per method, for the memory child (:mod:`memory_child`), the gradient error
(:mod:`gradients`) and the step time (:mod:`timing`). The rest are small helpers for devices,
RNG state, failures and the progress log.
"""

from __future__ import annotations

import copy
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .methods import Method, Patched
from .sizes import FULL, QUICK, Sizes
from .workloads import Workload


@dataclass(frozen=True)
class Settings:
    """How much of each measurement to take."""

    sizes: Sizes
    memory_repeats: int
    warmup_steps: int
    timed_rounds: int


FULL_SETTINGS = Settings(FULL, memory_repeats=2, warmup_steps=2, timed_rounds=20)
QUICK_SETTINGS = Settings(QUICK, memory_repeats=1, warmup_steps=1, timed_rounds=3)


def describe_device(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H200)`` or ``cpu (2 threads, x86_64)``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    threads = torch.get_num_threads()
    return f"cpu ({threads} thread{'' if threads == 1 else 's'}, {platform.machine()})"


def shape_of(batch: Any) -> str:
    """``16x128``: the shape of a batch's tensor (its first one for a tuple)."""
    first = batch if isinstance(batch, torch.Tensor) else batch[0]
    return "x".join(str(s) for s in first.shape)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state and, on CUDA, the device's."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def failure(exc: BaseException) -> str:
    """``Type: first line of the message`` (shortened), for a table cell."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:160]


def log(message: str, started: float) -> None:
    """``[  12 s] message`` on stderr, the seconds counted from ``started``."""
    print(f"[{time.perf_counter() - started:6.0f} s] {message}", file=sys.stderr, flush=True)


def calibrate_batchnorm(model: nn.Module, workload: Workload, passes: int = 30) -> None:
    """Bring BatchNorm running statistics to the measurement batch's (train-mode, no-grad passes).

    Only the measured copies get this: a running-statistics mode (the conv-net preset) then
    normalizes as it would mid-training, where running and batch statistics are close, instead
    of with the fresh ``mean 0, var 1``. Batch-statistics BatchNorm ignores running statistics
    in training, so no other method's measurement changes.
    """
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return
    with torch.no_grad():
        for _ in range(passes):
            workload.loss_fn(model, workload.measure)


class Measured:
    """The methods of one workload, each on its own copy of the same (calibrated) model.

    ``each(fn)`` calls ``fn(index, patched)`` for every method still standing; one that raises
    is recorded in ``errors`` and left out from then on. ``plans``: ``{method: recomputed fqns}``
    for the planner methods to adopt instead of planning again (the planner times modules, so
    two plans of the same model can differ: memory and time must come from the same one).
    """

    def __init__(
        self,
        workload: Workload,
        methods: list[Method],
        device: torch.device,
        plans: dict[str, list[str]] | None = None,
    ):
        base = workload.build().to(device).train()
        calibrate_batchnorm(base, workload)
        self.patched: list[Patched | None] = []
        self.errors: dict[int, str] = {}
        for i, method in enumerate(methods):
            try:
                model = copy.deepcopy(base)
                adopt = (plans or {}).get(method.name)
                patched = method.apply(model, workload, workload.measure, True, adopt)
                self.patched.append(patched)
            except Exception as exc:  # a failing method is a result, not the end of the run
                self.patched.append(None)
                self.errors[i] = failure(exc)

    def each(self, fn: Callable[[int, Patched], None]) -> None:
        """``fn(index, patched)`` for every method still standing; one that raises drops out."""
        for i, p in enumerate(self.patched):
            if p is None:
                continue
            try:
                fn(i, p)
            except Exception as exc:
                self.drop(i, exc)

    def drop(self, i: int, exc: BaseException) -> None:
        """Record method ``i``'s failure and leave it out from then on."""
        self.errors[i] = failure(exc)
        self.patched[i] = None

    def close(self) -> None:
        """Remove the memopt patches and let the copies go."""
        for p in self.patched:
            if p is not None and p.optimizer is not None:
                p.optimizer.remove()
        self.patched = []
