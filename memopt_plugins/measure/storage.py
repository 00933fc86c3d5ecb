"""Storage identity: which memory a tensor lives in, and whether that is a model's own.

A saved tensor and a parameter (or a view of either) are the same memory when their storages
are: :func:`storage_key` names a storage by device and address. An address is reused as soon as
its memory is freed, so a key identifies a storage only while some tensor on it is alive; callers
that keep keys across a forward hold a weak reference and check it.

A sharded model's parameters (FSDP2) get their memory only while their module runs, so they are
read then, by :class:`RunningParameters`; :class:`ModelStorages` holds everything else. A DTensor
(tensor parallelism, FSDP2) holds this rank's memory in its local shard (:func:`local_part`).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.utils.parametrize import ParametrizationList
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from .scopes import ScopeTracker, Watch

StorageKey = tuple[torch.device, int]


def storage_key(t: torch.Tensor) -> StorageKey | None:
    """``(device, address)`` of ``t``'s storage; ``None`` for a tensor without a plain storage."""
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # e.g. a tensor subclass without storage
        return None


class ModelStorages:
    """The storages of a model's parameters and buffers (and of ``extra`` tensors, e.g. a batch).

    Read when built and at :meth:`refresh`, since parameters may move to another device or dtype
    between steps. ``t in storages`` is the one test of "``t`` is (a view of) a parameter, a
    buffer or an extra tensor": such memory is never the step's to free, so it is neither
    compressed nor counted as saved.

    Each storage is held weakly and counts only while it is alive at the address read: a
    forward that reassigns a buffer (``self.avg = 0.9 * self.avg + ...``) frees the storage read,
    and the allocator may hand its address to any tensor made next. Had the address alone been
    kept, that tensor would count as a buffer or not by how the allocator placed it.

    ``sharded``: whether any of the model's parameters and buffers was a DTensor when last read.
    """

    def __init__(self, model: nn.Module, extra: Iterable[torch.Tensor] = ()):
        self.model = model
        self.extra = tuple(extra)
        self._storages: dict[StorageKey, weakref.ref] = {}
        self.refresh()

    def refresh(self) -> None:
        """Read the storages again (at every step: one pass, no call per tensor), and whether
        any of the model's own tensors is a DTensor (:attr:`sharded`)."""
        dtensor = _dtensor_type()
        storages: dict[StorageKey, weakref.ref] = {}
        own = model_tensors(self.model)
        self.sharded = False
        for i, t in enumerate((*own, *self.extra)):
            if dtensor is not None and isinstance(t, dtensor):  # local_part, inline
                t = t._local_tensor
                self.sharded = self.sharded or i < len(own)
            if t.numel() == 0:
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # as storage_key: no plain storage
                continue
            storages[(t.device, storage.data_ptr())] = weakref.ref(storage)
        self._storages = storages

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count these tensors' storages as pre-existing too (e.g. the root module's inputs)."""
        self.extra += tuple(tensors)
        self.refresh()

    def __contains__(self, t: object) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if issubclass(type(t), nn.Parameter) or getattr(t, "_is_param", False):
            return True  # isinstance(t, nn.Parameter), without its metaclass's Python check
        key = storage_key(t)
        ref = self._storages.get(key) if key is not None else None
        storage = ref() if ref is not None else None
        # alive, allocated and at the same address: the memory read, not a reuse of its address
        return storage is not None and storage.nbytes() > 0 and storage.data_ptr() == key[1]


def model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``model`` and its submodules (a shared one may appear more
    than once): what ``parameters()`` and ``buffers()`` give, without their names or a generator
    per module (it runs at every step)."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for t in module._parameters.values():
            if t is not None:
                out.append(t)
        for t in module._buffers.values():
            if t is not None:
                out.append(t)
        for m in module._modules.values():
            if m is not None:
                stack.append(m)
    return out


def sharding_imported() -> bool:
    """Whether any tensor can be a DTensor yet (``torch.distributed.tensor`` was imported)."""
    return "torch.distributed.tensor" in sys.modules


def _dtensor_type() -> type | None:
    """The DTensor class, once ``torch.distributed.tensor`` was imported (nothing is a DTensor
    before)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_sharded(t: object) -> bool:
    """True for a DTensor: a parameter sharded by FSDP2 (``fully_shard``) or tensor parallelism."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The memory ``t`` holds on this rank: a DTensor's local shard (its wrapper has no storage
    of its own), any other tensor itself."""
    return t._local_tensor if is_sharded(t) else t


class RunningParameters:
    """The parameters of a sharded model as its modules hold them while they run.

    FSDP2 (``fully_shard``) registers sharded parameters (DTensors) on the modules and, in each
    unit's forward pre-hook, swaps in unsharded ones, all-gathered into fresh memory every forward
    and freed after the unit's forward (the storage is resized to nothing: the tensor object
    lives on, its memory does not) or after its backward. Storages read before the forward miss
    them, and an address read earlier in the forward may have been freed and reused since. So on
    a model with DTensor parameters every module that owns parameters is watched (through its
    :class:`~.scopes.ScopeTracker` scope, whose pre-hook runs after FSDP's, which FSDP prepends),
    the parameters it holds are noted when it starts, and ``t in running`` asks whether ``t``'s
    storage is one of theirs now: still allocated, at the same address. :meth:`leaf` is the tensor
    a parameter ran as (the autograd leaf its gradient reaches). A model without DTensor
    parameters is not watched, and nothing is in it.

    Call :meth:`sync` when a step begins (a model may be sharded after memopt was applied) and
    :meth:`remove` when done.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._watch: Watch | None = None
        self._storages: dict[StorageKey, weakref.ref] = {}
        self._leaves: dict[tuple[str, str], weakref.ref] = {}

    def sync(self, sharded: bool | None = None) -> None:
        """Start watching if the model's parameters are sharded now; forget freed storages.
        ``sharded``: whether any of the model's tensors is a DTensor, where the caller just read
        them (:attr:`ModelStorages.sharded`); else they are read here."""
        self._storages = {k: r for k, r in self._storages.items() if _holds(r(), k)}
        if self._watch is not None or not sharding_imported():
            return
        if sharded is None:
            sharded = any(is_sharded(t) for t in model_tensors(self.model))
        if not sharded:
            return
        owners = [
            fqn
            for fqn, module in self.model.named_modules()
            if next(module.parameters(recurse=False), None) is not None
        ]
        self._watch = ScopeTracker.of(self.model).watch(self, owners)

    def remove(self) -> None:
        """Stop watching (what was noted stays readable: :meth:`leaf` after a pass)."""
        if self._watch is not None:
            self._watch.remove()
            self._watch = None

    def enter(self, fqn: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        for name, p in module.named_parameters(recurse=False):
            if not is_sharded(p):  # a DTensor was not gathered for this module: it runs as it is
                self._leaves[(fqn, name)] = weakref.ref(p)
            # A DTensor's shard (tensor parallelism; FSDP2 + TP gathers into a DTensor on the TP
            # mesh) is parameter memory too, held through its local tensor.
            memory = local_part(p)
            key = storage_key(memory)
            if key is not None:
                self._storages[key] = weakref.ref(memory)

    def exit(self, fqn: str, module: nn.Module, args: tuple, output: Any) -> None:
        pass

    def leaf(self, fqn: str, name: str) -> torch.Tensor | None:
        """The tensor parameter ``name`` of module ``fqn`` ran as, if it ran unsharded."""
        ref = self._leaves.get((fqn, name))
        return ref() if ref is not None else None

    def __contains__(self, t: object) -> bool:
        if not self._storages or not isinstance(t, torch.Tensor):
            return False
        key = storage_key(t)
        ref = self._storages.get(key)
        return ref is not None and _holds(ref(), key)


class ComputedWeights:
    """The weights a model computes from its parameters in each forward, found when built: what
    its parametrizations give (``torch.nn.utils.parametrize``: weight_norm, orthogonal,
    spectral_norm), read from each :class:`~torch.nn.utils.parametrize.ParametrizationList`'s
    output as it is made, and what hook-style norms set on their module before its forward
    (``torch.nn.utils.spectral_norm``, ``weight_norm``), read where they set it. ``t in weights``
    asks whether ``t`` shares memory with one of them, as made last, or is a cast of a parameter
    made outside autograd (:meth:`_cast_of_a_parameter`). Call :meth:`remove` when done.
    """

    def __init__(self, model: nn.Module):
        self._set_by_hooks = [
            (weakref.ref(module), hook.name)
            for module in model.modules()
            for hook in module._forward_pre_hooks.values()
            if isinstance(hook, (SpectralNorm, WeightNorm))
        ]
        lists = [f for f, m in model.named_modules() if isinstance(m, ParametrizationList)]
        self._made: dict[str, StorageKey] = {}  # a parametrization's fqn -> its output's storage
        self._storages: dict[StorageKey, weakref.ref] = {}
        self._watch = ScopeTracker.of(model).watch(self, lists) if lists else None
        self._dtypes_of_shape: dict[torch.Size, set[torch.dtype]] = {}
        for p in model.parameters():
            if p.is_floating_point():
                self._dtypes_of_shape.setdefault(p.shape, set()).add(p.dtype)

    def enter(self, fqn: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        pass

    def exit(self, fqn: str, module: nn.Module, args: tuple, output: Any) -> None:
        key = storage_key(output) if isinstance(output, torch.Tensor) else None
        self._storages.pop(self._made.pop(fqn, None), None)  # one output per parametrization
        if key is not None:
            self._made[fqn] = key
            self._storages[key] = weakref.ref(output)

    def remove(self) -> None:
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        self._made, self._storages = {}, {}

    def __contains__(self, t: object) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if self._cast_of_a_parameter(t):
            return True
        if not (self._storages or self._set_by_hooks):
            return False
        key = storage_key(t)
        ref = self._storages.get(key)
        if ref is not None and _holds(ref(), key):
            return True
        for module, name in self._set_by_hooks:
            weight = getattr(module(), name, None)
            if isinstance(weight, torch.Tensor) and storage_key(weight) == key:
                return True
        return False

    def _cast_of_a_parameter(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (or the tensor it views: ``nn.Linear`` saves ``weight.t()``) is taken
        for a parameter cast to another floating dtype outside autograd: autocast's copy of a
        frozen weight (PEFT LoRA's base layers), made afresh at each call with no autograd
        history, as a dequantized or cast-by-hand frozen weight is. Told by its shape and dtype
        (a parameter's shape, another dtype than that parameter's) and by its having no history
        at all: an activation needs a gradient or comes from one that does, except where the
        whole input is frozen data (then one of a parameter's exact shape is kept, uncompressed
        and counted: memory, never a wrong gradient)."""
        if t.grad_fn is not None or t.requires_grad or not t.is_floating_point():
            return False
        base = t._base if t._base is not None else t
        dtypes = self._dtypes_of_shape.get(base.shape)
        return dtypes is not None and base.dtype not in dtypes


def _holds(p: torch.Tensor | None, key: StorageKey) -> bool:
    """``p`` still lives at ``key``: alive, allocated, at the same address."""
    return p is not None and p.untyped_storage().nbytes() > 0 and storage_key(p) == key


def tensor_version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place change); ``None`` for inference tensors."""
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None
