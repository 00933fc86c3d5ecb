"""Bit packing: 1-, 2-, 4- or 8-bit codes stored ``8 // bits`` to a ``uint8``, low bits first.

The codec packs its quantization codes with it (:mod:`.codec`), and dropout its 1-bit masks
(:mod:`memopt_plugins.dropout`).
"""

from __future__ import annotations

import torch

# Integer type holding the ``8 // bits`` codes of one packed byte as one byte each.
_LANES_DTYPE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _to_uint8(codes: torch.Tensor) -> torch.Tensor:
    """Integer-valued ``codes`` in ``[0, 255]`` as ``uint8``.

    A floating tensor goes through ``int16``: on the CPU both of those conversions are vectorized,
    about 3× faster than the direct float-to-``uint8`` one.
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
