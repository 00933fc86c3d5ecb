"""Integer narrowing: integer tensors (e.g. max-pool indices) stored losslessly in the smallest
integer type that holds their range.

The saved-tensor hooks (:mod:`.hooks`) keep integer tensors this way; they never quantize them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Candidate integer types for narrowing, smallest first.
_NARROW_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32)


@dataclass(frozen=True, slots=True)
class NarrowedInt:
    """An integer tensor stored in a smaller integer dtype, restored exactly by :func:`widen_int`.

    Attributes:
        values: the elements in the narrow dtype (contiguous, same shape).
        dtype: the original dtype.
    """

    values: torch.Tensor
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held by the narrowed values."""
        return self.values.numel() * self.values.element_size()


def narrow_int(x: torch.Tensor) -> NarrowedInt | torch.Tensor:
    """Store integer ``x`` in the smallest of uint8/int8/int16/int32 that holds ``[min, max]``.

    Returns ``x`` itself when it is empty, or when no candidate would take fewer bytes than ``x``
    holds now (its storage, so an expanded view is not blown up to full size).
    """
    if x.is_floating_point() or x.is_complex():
        raise TypeError(f"narrow_int takes an integer tensor, got {x.dtype}")
    if x.numel() == 0 or x.dtype == torch.bool:
        return x
    lo, hi = (int(v) for v in torch.aminmax(x))
    held = min(x.numel() * x.element_size(), x.untyped_storage().nbytes())
    for dtype in _NARROW_DTYPES:
        info = torch.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            if x.numel() * dtype.itemsize >= held:
                return x
            values = x.to(dtype, memory_format=torch.contiguous_format)
            return NarrowedInt(values=values, dtype=x.dtype)
    return x


def widen_int(n: NarrowedInt) -> torch.Tensor:
    """Restore the tensor that :func:`narrow_int` narrowed, in its original dtype."""
    return n.values.to(n.dtype)
