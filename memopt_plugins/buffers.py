"""Tensors a backward may write its gradients into: buffers nothing else holds.

A saved tensor that memopt's hooks decode in backward is a fresh tensor made for the one node
that unpacked it; once that node has read a piece of it, the piece is dead. The lean ops
(:mod:`memopt_plugins.lean`) write their input gradients into such a buffer instead of
allocating a second one of the same size beside it: in the backward of a gated MLP that is two
of the step's widest tensors. Anything not marked here (a tensor saved as it is, which the model
or the user may still hold) is never written to.

A decode that several consecutive nodes read (:meth:`..compress.saved._Saved.value`) is held
for the later ones; the first to ask whether it may write into it takes it over
(:func:`shared_until_written`), and the later nodes decode their own.

The mark sits on the tensor's storage: autograd hands a node a new tensor object around the one
the unpack hook returned, while the storage's Python object lives as long as the storage does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_MARK = "_memopt_private"
_LET_GO = "_memopt_let_go"


def mark_private(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` (just made, referenced by nobody else) as one its consumer may overwrite."""
    setattr(t.untyped_storage(), _MARK, True)
    return t


def private(t: torch.Tensor) -> bool:
    """Whether ``t`` may be overwritten: its storage marked, ``t`` dense in row-major order,
    outside a compiled graph (whose tensors are traced, never marked), and in a backward that
    builds no graph (with ``create_graph=True`` the second derivative reads ``t`` again)."""
    if torch.compiler.is_compiling() or torch.is_grad_enabled() or not t.is_contiguous():
        return False
    storage = t.untyped_storage()
    let_go = getattr(storage, _LET_GO, None)
    if let_go is not None:
        delattr(storage, _LET_GO)
        if let_go() and sole_holder(t):
            mark_private(t)
    return getattr(storage, _MARK, False)


def shared_until_written(t: torch.Tensor, let_go: Callable[[], bool]) -> None:
    """``t`` is held for further readers; :func:`private` asked of it first calls ``let_go``
    (whether its holder let go of it), and a sole holder may then overwrite it."""
    setattr(t.untyped_storage(), _LET_GO, let_go)


def sole_holder(t: torch.Tensor) -> bool:
    """Whether ``t`` is the only tensor on its storage: no earlier reader holds it still."""
    storage = t.untyped_storage()
    holders = 2 if t._base is None else 3  # ``t``, ``storage`` and the base ``t`` views
    return torch._C._storage_Use_Count(storage._cdata) == holders
