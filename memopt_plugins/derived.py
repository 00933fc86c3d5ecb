"""Outputs that a lean op can make again from its own saved input, cheaply.

A layer norm's output is saved by the projection after it, beside the input the norm saves for
its own backward. Where memopt's hooks compress that input, a later save of the output (whole
and unchanged) is kept as a recipe over the input's compressed copy instead of a second one: at
unpack the output is made again from the decoded input, lossy only as that input is. The input
itself need not outlive the forward (a block's output is dropped once normalized): the hooks note
its compressed copy when they make it, in a :class:`Source` the output's mark holds. Marks sit on
storages, as :mod:`.buffers`' do.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

_OUTPUT, _SOURCE = "_memopt_derived", "_memopt_derived_source"


class Source:
    """An input outputs are made from: its layout, and its compressed copy once made (and at
    how many bits)."""

    __slots__ = ("shape", "stride", "version", "packed", "bits")

    def __init__(self, t: torch.Tensor):
        self.shape, self.stride, self.version = t.shape, t.stride(), t._version
        self.packed: weakref.ref | None = None
        self.bits = 0


def derive(out: torch.Tensor, source: torch.Tensor, remake: Callable[[torch.Tensor], torch.Tensor]):
    """Mark ``out`` (just made, contiguous) as ``remake(source)``."""
    if torch.compiler.is_compiling() or not out.is_contiguous():
        return
    cell = Source(source)
    setattr(source.untyped_storage(), _SOURCE, cell)
    setattr(out.untyped_storage(), _OUTPUT, (cell, remake, out._version, out.numel()))


def note_packed(t: torch.Tensor, packed: object, bits: int) -> None:
    """The hooks compressed ``t`` into ``packed`` at ``bits``: where ``t`` is a marked source as
    it was marked (the same view, unchanged), outputs made from it may refer to ``packed``."""
    cell = getattr(t.untyped_storage(), _SOURCE, None)
    if cell is None or torch.compiler.is_compiling():
        return
    if (t.shape, t.stride(), t._version) == (cell.shape, cell.stride, cell.version):
        cell.packed, cell.bits = weakref.ref(packed), bits


def derivation(
    t: torch.Tensor, bits: int
) -> tuple[object, Callable[[torch.Tensor], torch.Tensor]] | None:
    """``(packed, remake)`` where ``t`` is a whole, unchanged, contiguous view of a marked
    output whose source was compressed into ``packed`` at ``bits`` or more (``remake`` of the
    decoded source gives the output, contiguous), else ``None``: an output saved at more bits
    than its source is not made from a coarser copy."""
    mark = getattr(t.untyped_storage(), _OUTPUT, None)
    if mark is None or torch.compiler.is_compiling():
        return None
    cell, remake, version, numel = mark
    packed = cell.packed() if cell.packed is not None else None
    whole = t.is_contiguous() and t.storage_offset() == 0 and t.numel() == numel
    if packed is None or not whole or t._version != version or cell.bits < bits:
        return None
    return packed, remake
