"""One form of loss function everywhere: ``loss_fn(model, batch) -> scalar loss``.

The drift check and the recompute planner run the loss themselves, on the model and a batch they
choose (the patched model, a slice of the training batch); the CLI's factories and the Lightning,
Accelerate and ``transformers.Trainer`` integrations take the same form. The engine's and the
Accelerate plugin's first form, a closure ``loss_fn() -> scalar loss``, is still accepted there:
:func:`takes_model_and_batch` tells the two apart by signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

#: ``loss_fn(model, batch) -> scalar loss``.
LossFn = Callable[[nn.Module, Any], torch.Tensor]

FORMS = "loss_fn(model, batch) -> scalar loss (or a closure loss_fn() -> scalar loss)"


def takes_model_and_batch(loss_fn: Callable[..., Any]) -> bool:
    """True for ``loss_fn(model, batch)``, False for a closure ``loss_fn()``; ``TypeError`` for a
    callable that takes neither. A callable that can be called with no arguments is a closure
    (``lambda s=sample: ...`` binds its sample early)."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be {FORMS}; got {type(loss_fn).__name__}")
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return True  # no signature to read (a builtin, an extension type): the documented form
    for args, two in (((), False), ((None, None), True)):
        try:
            signature.bind(*args)
        except TypeError:
            continue
        return two
    raise TypeError(f"loss_fn must be {FORMS}; got loss_fn{signature}")


def bind_loss(
    loss_fn: Callable[..., torch.Tensor], model: nn.Module, batch: Any
) -> Callable[[], torch.Tensor]:
    """``loss_fn`` as a closure: ``loss_fn(model, batch)`` bound, or the closure as it is.

    Raises:
        TypeError: ``loss_fn(model, batch)`` with no batch to run it on (``batch`` is ``None``).
    """
    if not takes_model_and_batch(loss_fn):
        return loss_fn
    if batch is None:
        raise TypeError("loss_fn(model, batch) needs the batch: pass batch=... with it")
    return lambda: loss_fn(model, batch)
