"""Storage identity: which memory a tensor lives in, and whether that is a model's own.

A saved tensor and a parameter (or a view of either) are the same memory when their storages
are: :func:`storage_key` names a storage by device and address. An address is reused as soon as
its memory is freed, so a key identifies a storage only while some tensor on it is alive; callers
that keep keys across a forward hold a weak reference and check it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

StorageKey = tuple[str, int]


def storage_key(t: torch.Tensor) -> StorageKey | None:
    """``(device, address)`` of ``t``'s storage; ``None`` for a tensor without a plain storage."""
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # e.g. a tensor subclass without storage
        return None


class ModelStorages:
    """The storages of a model's parameters and buffers (and of ``extra`` tensors, e.g. a batch).

    Read when built and at :meth:`refresh`, since parameters may move to another device or dtype
    between steps. ``t in storages`` is the one test of "``t`` is (a view of) a parameter, a
    buffer or an extra tensor": such memory is never the step's to free, so it is neither
    compressed nor counted as saved.
    """

    def __init__(self, model: nn.Module, extra: Iterable[torch.Tensor] = ()):
        self.model = model
        self.extra = tuple(extra)
        self._keys: frozenset[StorageKey] = frozenset()
        self.refresh()

    def refresh(self) -> None:
        """Read the storages again."""
        model = self.model
        tensors = (*model.parameters(), *model.buffers(), *self.extra)
        self._keys = frozenset(storage_key(t) for t in tensors if t.numel() > 0) - {None}

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count these tensors' storages as pre-existing too (e.g. the root module's inputs)."""
        self.extra += tuple(tensors)
        self.refresh()

    def __contains__(self, t: object) -> bool:
        if isinstance(t, nn.Parameter):
            return True
        return isinstance(t, torch.Tensor) and storage_key(t) in self._keys


def tensor_version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place change); ``None`` for inference tensors."""
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None
