"""Custom autograd functions whose backward is right to first order only.

A backward written for memory (gradients made in the forward, statistics kept as constants,
writes in place) is not a differentiable expression of its inputs: differentiated again
(gradient penalties, Hessian-vector products) it would give a wrong second derivative without a
word. :func:`first_order` refuses to build that graph instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def first_order(backward: Callable[..., Any]) -> Callable[..., Any]:
    """``backward`` of a custom autograd Function differentiable once only: called to build a
    graph (``create_graph=True``) while the Function had an input that needs a gradient, it
    raises at once. Torch's ``once_differentiable`` raises later, and only on a second backward
    that reaches its error node: ``torch.autograd.grad(..., inputs, allow_unused=True)`` prunes
    that node and returns the term as missing, and an incoming gradient that needs none (a
    penalty whose first backward starts here) sets up no error node at all."""

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled() and any(ctx.needs_input_grad):
            name = type(ctx).__name__.removesuffix("Backward")
            raise RuntimeError(
                f"memopt: {name} is differentiable once only (once_differentiable): its "
                "memory-lean backward is not a differentiable expression of its inputs, so a "
                "second derivative through it (backward with create_graph=True: gradient "
                "penalties, Hessian-vector products) would be wrong. Compute that loss without "
                "this op (ops.loss / ops.cross_entropy: none, batchnorm.mode: batch)."
            )
        return backward(ctx, *grads)

    return wrapper
