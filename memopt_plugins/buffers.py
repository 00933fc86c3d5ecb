"""Tensors a backward may write its gradients into: buffers nothing else holds.

A saved tensor that memopt's hooks decode in backward is a fresh tensor made for the one node
that unpacked it; once that node has read a piece of it, the piece is dead. The lean ops
(:mod:`memopt_plugins.lean`) write their input gradients into such a buffer instead of
allocating a second one of the same size beside it: in the backward of a gated MLP that is two
of the step's widest tensors. Anything not marked here (a tensor saved as it is, which the model
or the user may still hold) is never written to.

The mark sits on the tensor's storage: autograd hands a node a new tensor object around the one
the unpack hook returned, while the storage's Python object lives as long as the storage does.
"""

from __future__ import annotations

import torch

_MARK = "_memopt_private"


def mark_private(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` (just made, referenced by nobody else) as one its consumer may overwrite."""
    setattr(t.untyped_storage(), _MARK, True)
    return t


def private(t: torch.Tensor) -> bool:
    """Whether ``t`` may be overwritten: its storage marked, ``t`` dense in row-major order, and
    outside a compiled graph (whose tensors are traced, never marked)."""
    return (
        not torch.compiler.is_compiling()
        and t.is_contiguous()
        and getattr(t.untyped_storage(), _MARK, False)
    )
