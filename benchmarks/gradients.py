"""Gradient error: how far each method's parameter gradients are from the unpatched model's.

One step on the measurement batch under the same RNG seed (the same dropout masks) for every
method, compared with the baseline's as ``|g - g_exact| / |g_exact|`` over all parameters.
"""

from __future__ import annotations

import torch
from harness import Measured
from methods import Patched
from workloads import Workload


def gradients(patched: Patched, workload: Workload, seed: int = 0) -> dict[str, torch.Tensor]:
    """Parameter gradients of one step on the measurement batch, under RNG seed ``seed``."""
    model = patched.model
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # every device's default generator
    patched.loss(workload.loss_fn, workload.measure).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


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
