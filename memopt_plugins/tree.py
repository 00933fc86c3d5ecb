"""The one tensor-tree helper: find, map and slice the tensors inside nested Python values.

Containers are those :mod:`torch.utils._pytree` knows (tuples, named tuples, lists, dicts,
``OrderedDict``, Hugging Face ``ModelOutput``) plus any other ``Mapping`` (``BatchEncoding``) and
dataclass instance, rebuilt as their own type where their constructor allows it. Anything else
(ints, strings, ``None``, a KV cache object) is a leaf and kept as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree


def _open(leaf: Any) -> dict[str, Any] | None:
    """The fields of a container pytree does not know (a Mapping, a dataclass), else None."""
    if isinstance(leaf, Mapping):
        return dict(leaf)
    if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
        return {f.name: getattr(leaf, f.name) for f in dataclasses.fields(leaf) if f.init}
    return None


def _rebuild(leaf: Any, fields: dict[str, Any]) -> Any:
    if isinstance(leaf, Mapping):
        try:
            return type(leaf)(fields)
        except TypeError:
            return fields
    return dataclasses.replace(leaf, **fields)


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor inside ``tree``, in order (a tensor appearing twice is listed twice)."""
    found: list[torch.Tensor] = []
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        else:
            fields = _open(leaf)
            if fields is not None:
                found.extend(tensors_in(list(fields.values())))
    return found


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with every tensor ``t`` replaced by ``fn(t)``, containers rebuilt."""

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return fn(value)
        fields = _open(value)
        if fields is None:
            return value
        return _rebuild(value, {k: map_tensors(fn, v) for k, v in fields.items()})

    return pytree.tree_map(leaf, tree)


def batch_size_of(batch: Any) -> int | None:
    """Samples in ``batch``: dim 0 of its first tensor of one dimension or more (``None``: no
    such tensor)."""
    return next((t.shape[0] for t in tensors_in(batch) if t.dim() > 0), None)


def slice_batch(batch: Any, n: int) -> Any:
    """The first ``n`` samples of ``batch``: tensors are cut along dim 0, containers rebuilt.

    0-dim tensors and non-tensor leaves are kept as they are; a batch of fewer than ``n``
    samples is returned whole. Integrations take a ``slicer`` argument for batches this cannot
    cut.
    """
    return map_tensors(lambda t: t[:n] if t.dim() > 0 else t, batch)
