"""Gradient error: how far each method's parameter gradients are from the unpatched model's.

One step on the measurement batch under the same RNG seed (the same dropout masks) for every
method, compared with the baseline's as ``|g - g_exact| / |g_exact|`` over all parameters.
:func:`model_gradients` takes the same step for a model and a memopt config of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memopt_plugins import MemoryOptimizer

from .measured import Measured
from .methods import Patched
from .workloads import Workload


def step_gradients(
    model: nn.Module, loss: Callable[[], torch.Tensor], seed: int = 0
) -> dict[str, torch.Tensor]:
    """Parameter gradients of ``loss().backward()`` under RNG seed ``seed``; ``.grad`` cleared."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # every device's default generator
    loss().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def gradients(patched: Patched, workload: Workload, seed: int = 0) -> dict[str, torch.Tensor]:
    """Parameter gradients of one step on the measurement batch, under RNG seed ``seed``."""
    return step_gradients(
        patched.model, lambda: patched.loss(workload.loss_fn, workload.measure), seed
    )


def model_gradients(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    config: Any = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Parameter gradients of one step of ``model`` on ``batch``, with ``MemoryOptimizer(config)``
    applied for that step (and removed after) when ``config`` is given."""
    opt = MemoryOptimizer(config) if config is not None else None
    if opt is not None:
        opt.apply(model)
    try:
        return step_gradients(model, lambda: loss_fn(model, batch), seed)
    finally:
        if opt is not None:
            opt.remove()


def rel_error(grads: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> float:
    """``|g - g_exact|_2 / |g_exact|_2`` over all parameters together."""
    num = sum(float(((grads[k] - v).double() ** 2).sum()) for k, v in exact.items())
    den = sum(float((v.double() ** 2).sum()) for v in exact.values())
    return (num / den) ** 0.5


def gradient_errors(measured: Measured, workload: Workload) -> dict[int, float]:
    """:func:`rel_error` of every method still standing against the first (the baseline).

    A method that raises is dropped from ``measured`` and has no entry.
    """
    exact = gradients(measured.patched[0], workload)
    errors: dict[int, float] = {}

    def grad_error(i: int, p: Patched) -> None:
        errors[i] = rel_error(gradients(p, workload), exact)

    measured.each(grad_error)
    return errors
