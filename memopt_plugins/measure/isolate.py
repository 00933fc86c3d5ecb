"""Run a pass and leave the model as it was: the one isolation rule of the measuring passes.

The step recorder (the recompute planner's forward), the drift check's passes and the profiler's
steps all run the model beside training. :func:`isolated` puts back on exit everything such a pass
may change: every RNG stream a forward may draw from (torch's on the CPU and every initialized
accelerator, numpy's, Python's ``random``, and given private generators), every slot of the module
tree that holds a tensor (:class:`Slots`: a parameter, buffer or tensor attribute the pass replaced
holds its own object again) and the values of the buffers and attributes that need no gradient
(copied in place, so training finds its own tensors with its own values; one that needs a gradient
is derived from the parameters by a forward, not kept), each parameter's ``.grad`` (with
``clear_grads`` the pass runs without them), each module's train/eval mode, every torchmetrics
metric's state (not buffers: the pass's own ``training_step`` must not count its samples), and
with an ``optimizer`` the parameters and its state. It clones no parameter or gradient without an
optimizer and runs no backward itself, so a run with an isolated pass is bit for bit the run
without it.
"""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn


def accelerator_devices(
    model: nn.Module, devices: Iterable[torch.device | str] = ()
) -> dict[str, list[int]]:
    """Per accelerator type, the devices whose RNG state a pass must keep: every device of the
    type once it is initialized, otherwise the model's and ``devices``' only (none for a CPU model
    on an uninitialized CUDA, which reading a state would initialize)."""
    seen = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    seen |= {torch.device(d) for d in devices}
    types = sorted({d.type for d in seen} - {"cpu", "meta"} | {"cuda"})
    out: dict[str, list[int]] = {}
    for device_type in types:
        module = getattr(torch, device_type, None)
        if module is None or not hasattr(module, "get_rng_state"):
            continue
        initialized = getattr(module, "is_initialized", None)
        if initialized is not None and initialized():
            out[device_type] = list(range(module.device_count()))
            continue
        indices = sorted({_index(d, module) for d in seen if d.type == device_type})
        if indices:
            out[device_type] = indices
    return out


def _index(device: torch.device, module: Any) -> int:
    if device.index is not None:
        return device.index
    current = getattr(module, "current_device", None)
    return current() if current is not None and module.is_initialized() else 0


#: The value of a slot that was not there (a buffer or attribute added later).
ABSENT: Any = object()


def is_state(value: Any) -> bool:
    """A tensor a module keeps besides its parameters (a buffer or a plain attribute)."""
    return isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)


def put(table: dict[str, Any], name: str, value: Any) -> None:
    """Make ``table[name]`` hold ``value`` (:data:`ABSENT`: no entry)."""
    if value is ABSENT:
        table.pop(name, None)
    else:
        table[name] = value


class Slots:
    """Where a module tree keeps tensors, by slot, as it was when taken: each module's
    ``_buffers`` entries (and ``_parameters`` with ``parameters``) and its plain tensor attributes.

    A forward may replace a tensor instead of changing it (``self.avg = 0.9 * self.avg + ...``):
    the state is which object each slot holds, not only the values of the objects once held.
    """

    def __init__(self, model: nn.Module, *, parameters: bool = False):
        self._tables: list[tuple[dict[str, Any], dict[str, Any], bool]] = []
        for m in model.modules():
            if parameters:
                self._tables.append((m._parameters, dict(m._parameters), True))
            self._tables.append((m._buffers, dict(m._buffers), True))
            self._tables.append((vars(m), dict(vars(m)), False))

    def state(self) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
        """``(table, name, tensor)`` of every buffer and plain tensor attribute, as taken."""
        return [
            (table, name, value)
            for table, saved, _ in self._tables
            for name, value in saved.items()
            if is_state(value)
        ]

    def changes(self) -> list[tuple[dict[str, Any], str, Any]]:
        """``(table, name, value as taken)`` of every slot that holds another object now (or is
        added or gone): what :meth:`put_back` would undo."""
        out = []
        for table, saved, whole in self._tables:
            for name in saved.keys() | table.keys():
                old, new = saved.get(name, ABSENT), table.get(name, ABSENT)
                if old is not new and (whole or is_state(old) or is_state(new)):
                    out.append((table, name, old))
        return out

    def put_back(self) -> None:
        """Every slot holds the object it held when taken; entries added since are removed."""
        for table, name, value in self.changes():
            put(table, name, value)


class Isolation:
    """What a pass may change, as it was when taken; :meth:`restore` puts it back (any number of
    times: every pass of a drift check starts from the same state)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        generators: Sequence[torch.Generator] = (),
        devices: Iterable[torch.device | str] = (),
        clear_grads: bool = False,
    ):
        self.model = model
        self.optimizer = optimizer
        self.generators = list(generators)
        self._torch = torch.get_rng_state()
        self._devices = {
            device_type: [(i, getattr(torch, device_type).get_rng_state(i)) for i in indices]
            for device_type, indices in accelerator_devices(model, devices).items()
        }
        self._generators = [g.get_state() for g in self.generators]
        self._numpy = np.random.get_state()
        self._python = random.getstate()
        self._slots = Slots(model, parameters=True)
        kept = {id(t): t for _, _, t in self._slots.state() if not t.requires_grad}
        self._values = [(t, t.detach().clone()) for t in kept.values()]
        self._modes = [(m, m.training) for m in model.modules()]
        self._metrics = [(m, _metric_state(m)) for m in _metrics_in(model)]
        params = list(model.parameters())
        self._grads = [(p, p.grad) for p in params]
        self._params = [(p, p.detach().clone()) for p in params] if optimizer is not None else []
        self._optimizer = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
        if clear_grads:
            for p in params:
                p.grad = None

    def restore(self) -> None:
        """Put back every RNG stream, slot and its value, ``.grad``, mode, metric, and the
        optimizer's part."""
        torch.set_rng_state(self._torch)
        for device_type, states in self._devices.items():
            module = getattr(torch, device_type)
            for index, state in states:
                module.set_rng_state(state, index)
        for g, state in zip(self.generators, self._generators, strict=True):
            g.set_state(state)
        np.random.set_state(self._numpy)
        random.setstate(self._python)
        self._slots.put_back()
        with torch.no_grad():
            for tensor, value in (*self._values, *self._params):
                tensor.copy_(value)
        for m, training in self._modes:
            if m.training != training:
                m.training = training
        for m, state in self._metrics:
            for name, value in _metric_state(state).items():
                setattr(m, name, value)
        for p, grad in self._grads:
            if p.grad is not grad:
                p.grad = grad
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._optimizer)

    @contextmanager
    def one_pass(self) -> Iterator[None]:
        """A pass after which everything is put back (the enclosing :func:`isolated` still
        restores on its own exit)."""
        try:
            yield
        finally:
            self.restore()


#: What a torchmetrics metric changes besides its states (``_defaults``) when updated.
_METRIC_COUNTERS = ("_update_count", "_computed", "_forward_cache")


def _metrics_in(model: nn.Module) -> list[nn.Module]:
    """The torchmetrics metrics among ``model``'s modules (none unless torchmetrics is loaded)."""
    torchmetrics = sys.modules.get("torchmetrics")
    if torchmetrics is None:
        return []
    return [m for m in model.modules() if isinstance(m, torchmetrics.Metric)]


def _metric_state(source: Any) -> dict[str, Any]:
    """A copy of a metric's states and counters (from the metric, or from such a copy)."""
    if isinstance(source, nn.Module):
        names = (*source._defaults, *_METRIC_COUNTERS)
        source = {n: getattr(source, n) for n in names if hasattr(source, n)}
    return {
        n: v.clone() if isinstance(v, torch.Tensor) else copy.copy(v) for n, v in source.items()
    }


@contextmanager
def isolated(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    generators: Sequence[torch.Generator] = (),
    devices: Iterable[torch.device | str] = (),
    clear_grads: bool = False,
) -> Iterator[Isolation]:
    """Run the body and leave ``model`` as it was (see the module docstring): RNG streams,
    ``generators``, buffers, ``.grad``, modes, and with ``optimizer`` the parameters and the
    optimizer's state. ``devices``: accelerator devices whose RNG to keep besides the model's.
    Yields the :class:`Isolation`, whose :meth:`~Isolation.one_pass` restores after each pass."""
    isolation = Isolation(
        model, optimizer, generators=generators, devices=devices, clear_grads=clear_grads
    )
    try:
        yield isolation
    finally:
        isolation.restore()
