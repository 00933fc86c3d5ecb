"""What memopt leaves on a user's modules, and what a copy of the model gets of it.

memopt patches a model in place with forward hooks and, for recompute and running-statistics
BatchNorm, ``forward`` instance attributes. Those belong to the optimizer that applied them, not to
the model: a deep copy (``copy.deepcopy``, as EMA, ``torch.optim.swa_utils.AveragedModel`` and
Lightning's ``StochasticWeightAveraging`` make) or a pickled model (``torch.save(model)``) gets a
plain model: inert hooks and each module's own ``forward``, so a copy carries none of the hooks'
thread-local state and runs its own BatchNorm parameters, never the original's. Swapped dropout
modules (``dropout.MemoryDropout`` and kin) are self-contained and exact, so copies keep them. Apply
an optimizer to the copy to patch it as well.
"""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle


def _inert(*args: Any, **kwargs: Any) -> None:
    """The hook a copy gets in place of memopt's: does nothing."""
    return None


def _inert_hook() -> Callable[..., None]:
    return _inert


class EngineHook(functools.partial):
    """A forward (pre-)hook of memopt's on a user's module; copies and pickles to :func:`_inert`.
    A ``functools.partial`` of the hook function: torch calls it with no Python frame of its own
    (it runs twice per module call)."""

    __slots__ = ()

    def __deepcopy__(self, memo: dict) -> Callable[..., None]:
        return _inert

    def __reduce__(self) -> tuple:
        return (_inert_hook, ())


def forward_pre_hook(module: nn.Module, fn: Callable[..., Any], **kwargs: Any) -> RemovableHandle:
    """``module.register_forward_pre_hook(fn, **kwargs)``, as an :class:`EngineHook`."""
    return module.register_forward_pre_hook(EngineHook(fn), **kwargs)


def forward_hook(module: nn.Module, fn: Callable[..., Any], **kwargs: Any) -> RemovableHandle:
    """``module.register_forward_hook(fn, **kwargs)``, as an :class:`EngineHook`."""
    return module.register_forward_hook(EngineHook(fn), **kwargs)


def _same(value: Any) -> Any:
    return value


def _class_forward(module: nn.Module) -> Callable[..., Any]:
    """``module``'s class ``forward`` bound to it: what an unpatched module calls."""
    return types.MethodType(type(module).forward, module)


class InstanceForward:
    """Base of the ``forward`` instance attributes memopt sets on a module.

    Subclasses set ``module`` (the patched module) and ``previous`` (its ``forward`` instance
    attribute before memopt's, or ``None``). A copy of the module gets ``previous`` back, or,
    when there was none, its class's ``forward`` bound to the copy.
    """

    module: nn.Module
    previous: Callable[..., Any] | None

    def __deepcopy__(self, memo: dict) -> Callable[..., Any]:
        if self.previous is not None:
            return copy.deepcopy(self.previous, memo)
        target = memo.get(id(self.module))
        if target is None:  # the forward copied on its own, not as part of its module
            target = copy.deepcopy(self.module, memo)
        return _class_forward(target)

    def __reduce__(self) -> tuple:
        if self.previous is not None:
            return (_same, (self.previous,))
        return (_class_forward, (self.module,))
