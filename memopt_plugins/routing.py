"""Route chosen PyTorch functions to replacements while a model's modules run.

:class:`RoutingMode` is a ``TorchFunctionMode`` that sends each function in its routes to the
replacement; :class:`ModelRouting` enters a fresh one at the outermost module call of a model on
each thread and leaves it with that call, so functional calls made inside the model's forward
are routed and calls outside it are not. Functional dropout (:mod:`.dropout`) and the lean
cross-entropy (:mod:`.lean.entropy`) are routed this way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.overrides import TorchFunctionMode

from .measure.scopes import ScopeTracker, Watch


class RoutingMode(TorchFunctionMode):
    """Calls ``routes[func]`` instead of ``func`` for the functions it names."""

    def __init__(self, routes: Mapping[Callable[..., Any], Callable[..., Any]]) -> None:
        super().__init__()
        self.routes = routes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        route = self.routes.get(func, func)
        return route(*args, **(kwargs or {}))


class ModelRouting:
    """Enters ``make_mode()`` while any module of the model it is applied to runs."""

    def __init__(self, make_mode: Callable[[], TorchFunctionMode]) -> None:
        self.make_mode = make_mode
        self._watch: Watch | None = None
        self._local = threading.local()

    def apply(self, model: nn.Module) -> None:
        self._watch = ScopeTracker.of(model).watch(self)

    def remove(self) -> None:
        if self._watch is not None:
            self._watch.remove()
            self._watch = None

    @contextmanager
    def active(self) -> Iterator[None]:
        """Route inside this block (if not already routed on this thread): for code that runs
        parts of the model without calling its modules, e.g. a recompute replay."""
        self.enter("", None, (), {})
        try:
            yield
        finally:
            self.exit("", None, (), None)

    # The mode is entered by the outermost module call on this thread and left by the same call.
    @property
    def _entered(self) -> list[TorchFunctionMode | None]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def enter(self, fqn: str, module: nn.Module | None, args: tuple, kwargs: dict) -> None:
        stack = self._entered
        mode = None
        if not stack:  # the outermost call enters; the calls inside it find the mode active
            mode = self.make_mode()
            mode.__enter__()
        stack.append(mode)

    def exit(self, fqn: str, module: nn.Module | None, args: tuple, output: object) -> None:
        stack = self._entered
        if stack:
            mode = stack.pop()
            if mode is not None:
                mode.__exit__(None, None, None)
