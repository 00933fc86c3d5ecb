"""Lossless packing of integer tensors, below the codec and beside it.

* Bit packing: 1-, 2-, 4- or 8-bit codes stored ``8 // bits`` to a ``uint8``, low bits first.
  The codec packs its quantization codes and dropout's 1-bit masks with it (:mod:`.compress.codec`),
  the lean ReLU and max-pool their masks and argmax positions (:mod:`.lean.conv`).
* Integer narrowing: integer tensors (e.g. max-pool indices) stored in the smallest integer type
  that holds their range; the compression hooks keep integer tensors this way, never quantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Integer type holding the ``8 // bits`` codes of one packed byte as one byte each.
_LANES_DTYPE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _to_uint8(codes: torch.Tensor) -> torch.Tensor:
    """Integer-valued ``codes`` in ``[0, 255]`` as ``uint8``.

    A floating tensor goes through ``int16``: on the CPU both of those conversions are vectorized,
    the direct float-to-``uint8`` one is not.
    """
    if codes.is_floating_point():
        codes = codes.to(torch.int16)
    return codes.to(torch.uint8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack 1-D integer-valued codes (any dtype) of ``bits`` bits into ``uint8``, low bits first.

    ``bits`` is 1, 2, 4 or 8 (1: dropout masks). The codes of one packed byte, one byte each, are
    read as one wider integer and shifted together (``x | x >> (8 - bits) | ...``; the low byte is
    the packed byte): a few whole-tensor integer ops instead of strided per-lane ones. Tensor
    views follow the machine's byte order, taken to be little-endian (as on every platform
    PyTorch ships wheels for).
    """
    codes = _to_uint8(codes)
    if bits == 8:
        return codes
    per_byte = 8 // bits
    pad = -codes.numel() % per_byte
    if pad:
        codes = torch.cat((codes, codes.new_zeros(pad)))
    lanes = codes.view(_LANES_DTYPE[per_byte])  # codes < 2**bits: no sign bit set
    packed = lanes.clone()
    for lane in range(1, per_byte):
        packed.bitwise_or_(lanes >> (lane * (8 - bits)))
    return packed.to(torch.uint8)  # the low byte (conversion wraps modulo 256)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` codes as 1-D ``uint8``."""
    if bits == 8:
        return packed[:count]
    per_byte = 8 // bits
    wide = packed.to(_LANES_DTYPE[per_byte])
    lanes = wide.clone()
    for lane in range(1, per_byte):
        lanes.bitwise_or_(wide << (lane * (8 - bits)))  # code ``lane`` to byte ``lane``
    lanes.bitwise_and_(sum((2**bits - 1) << (8 * lane) for lane in range(per_byte)))
    return lanes.view(torch.uint8)[:count]


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
