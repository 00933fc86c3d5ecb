"""The codec inside ``torch.compile``'d graphs.

:func:`encode` and :func:`decode` are what the compression scopes' GraphModule hooks
(:mod:`memopt_plugins.compress.hooks`) put into the compiled graphs: the codes, bfloat16 scale and
zero point of :mod:`.reference` (below 8 bits packed in planes, :func:`_pack_planes`), decoded by
traceable PyTorch operations, which inductor fuses into the kernels that read them. Where the C
kernels serve (:func:`.ops.native_in_graphs`: CPU tensors) encoding is one operator opaque to
inductor (``memopt::graph_encode``), so inductor generates no encoder kernels per saved tensor
(compile times: ``benchmarks/compile_time.md``). Elsewhere (CUDA, float64, ``MEMOPT_CODEC=torch``)
it is traced too; both write the same bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .ops import graph_encode_op, graph_seed_op, native_in_graphs
from .reference import FIRST_LEVEL, graph_params, work_dtype

#: Tags of what a compiled graph saves for a compressed tensor (the first item of the tuple).
CODED, HALVED, BITS = "memopt-coded", "memopt-bfloat16", "memopt-bits"


class Coded(NamedTuple):
    """A quantized tensor inside a compiled graph: three tensors and constants.

    The graph saves it as a plain tuple (:meth:`saved`): an ``fx`` graph would build a
    NamedTuple with a call of its own, which AOTAutograd cannot place among the saved values.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    bits: int
    group_size: int
    numel: int
    dtype: torch.dtype
    shape: tuple
    stride: tuple | None  # the saved tensor's strides, when it was not contiguous

    def saved(self) -> tuple:
        return (CODED, *self)


def encode(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    seed: torch.Tensor | None = None,
    *,
    seed_source: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Codes, scale and zero point of contiguous ``x``: one operator where the C kernels serve,
    else traceable ops.

    The scale and zero point of :func:`.reference.quantize`, and its codes at round-to-nearest
    (``seed`` ``None``) for every group it encodes; with ``seed`` (an int64 scalar tensor: a value
    of the running graph, not a constant of its trace), stochastic rounding with the C kernel's
    noise (:func:`noise`), so the codes are those of :func:`.ops.quantize` with the native codec
    at that seed. ``seed_source``: the seed is drawn at every run of the graph, from that source
    of :func:`.ops.graph_seed`. The groups the codec keeps exactly get scale 0 and the top code
    as zero point (decoded as NaN, whatever their codes), and a constant group its value rounded
    up to one first level of a bfloat16 step. Below 8 bits a group's codes are packed by
    :func:`_pack_planes`, not in the reference's order.

    Written for inductor's vectorizer: the codes depend on the group only through the stored
    scale and zero point (once per group), rounding picks the sign with ``where`` and the codes
    go to ``uint8`` in one conversion.
    """
    if native_in_graphs(x.device, x.dtype):  # the C kernel, opaque to inductor
        if seed_source is not None:
            seed = graph_seed_op(x, seed_source)
        return graph_encode_op(x, bits, group_size, seed)
    top, first = 2**bits - 1, FIRST_LEVEL[bits]
    work = work_dtype(x.dtype)
    flat = x.reshape(-1)
    pad = -flat.numel() % group_size
    if pad:  # the last element repeated, as Groups.of pads
        flat = torch.cat((flat, flat[-1:].expand(pad)))
    groups = flat.view(-1, group_size).to(work)
    scale, zero_point = graph_params(groups.amin(1), groups.amax(1), bits, x.dtype)
    if seed_source is not None:
        seed = graph_seed_op(scale, seed_source)
    # The reference's inverse is 1 / step for every group it encodes; a step of 0 (a lost or an
    # all-zero group) gives NaN or +-inf here, which the comparisons send to the zero point or
    # the clamp's ends, and whose codes decode to NaN (lost) or 0 (step 0) regardless.
    scaled = groups * (1 / scale.to(work))[:, None]
    zp = zero_point.to(work)[:, None]
    above = (scaled.abs() - first).clamp_min(0)
    if seed is None:
        away = above.add(0.5).floor().add(1)
    else:  # floor(q + u), u = (k + 1/2) / 2**16, in the C kernel's 16-bit fixed point
        fixed = (above.clamp_max(1024) * 65536 + 0.5).to(torch.int32)
        away = ((fixed + noise(seed, groups.numel()).view_as(fixed)) >> 16).add(1).to(work)
    codes = torch.where(scaled > 0, zp + away, torch.where(scaled < 0, zp - away, zp))
    codes = codes.clamp(0, top).to(torch.uint8)
    if bits < 8:
        codes = _pack_planes(codes, bits)
    return codes.view(-1), scale, zero_point


_LOW32 = 0xFFFFFFFF


def _times(h: torch.Tensor, m: int) -> torch.Tensor:
    """``h * m mod 2**32`` for ``h`` in ``[0, 2**32)`` (int64) and a 32-bit ``m``, in int64
    without overflow: the product of the low and of the high 16 bits separately."""
    low = (h & 0xFFFF) * m
    high = (((h >> 16) * m) & 0xFFFF) << 16
    return (low + high) & _LOW32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 hash of 32-bit values held in int64 (the C kernel's ``mix32``)."""
    h = h ^ (h >> 16)
    h = _times(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _times(h, 0x846CA68B)
    return h ^ (h >> 16)


def noise(seed: torch.Tensor, numel: int) -> torch.Tensor:
    """The 16-bit rounding noise ``k`` (int32, ``[0, 2**16)``) of elements ``0 .. numel - 1`` from
    ``seed``, as the C kernel's ``fill_noise`` draws it: element ``e`` takes the low (even ``e``)
    or high half of ``mix32(e / 2 ^ key)``, ``key`` mixed from the seed's two halves (for fewer
    than ``2**33`` elements: the kernel mixes the index's bits above 33 in too)."""
    key = (seed & _LOW32) ^ _mix32((seed >> 32) & _LOW32)
    index = torch.arange(numel, device=seed.device, dtype=torch.int64)
    hashed = _mix32(((index >> 1) & _LOW32) ^ key)
    half = torch.where((index & 1) == 1, hashed >> 16, hashed & 0xFFFF)
    return half.to(torch.int32)


def _pack_planes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Each group's ``(n_groups, group_size)`` codes in ``group_size * bits / 8`` bytes: byte
    ``j`` holds codes ``j, j + m, j + 2m, ...`` (``m``: bytes per group), lowest bits first.

    Planes of a group, not neighbours (the reference's order): every lane is read and written
    contiguously, so inductor vectorizes packing and unpacking (with neighbour lanes it falls
    back to scalar loops).
    """
    per_byte = 8 // bits
    planes = codes.view(codes.shape[0], per_byte, -1)
    packed = planes[:, 0]
    for lane in range(1, per_byte):
        packed = packed | (planes[:, lane] << lane * bits)
    return packed


def _unpack_planes(packed: torch.Tensor, bits: int, n_groups: int) -> torch.Tensor:
    """The ``(n_groups, group_size)`` codes :func:`_pack_planes` packed."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.uint8)[:, None] * bits
    planes = (packed.view(n_groups, 1, -1) >> shifts) & (2**bits - 1)
    return planes.view(n_groups, -1)


def pack_bools(flat: torch.Tensor) -> torch.Tensor:
    """A flat bool tensor (a dropout mask) as ``uint8``, 8 elements a byte, in traceable ops
    (:func:`_pack_planes`' order at 1 bit, padded with ``False``): lossless."""
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    return _pack_planes(flat.view(1, -1).to(torch.uint8), 1).view(-1)


def unpack_bools(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` elements :func:`pack_bools` packed, flat."""
    return _unpack_planes(packed, 1, 1).reshape(-1)[:numel].bool()


def decode(c: Coded) -> torch.Tensor:
    """The tensor :func:`encode` coded, of its shape (contiguous) and dtype, in traceable ops:
    inductor fuses them into the backward's kernels that read the tensor, so each is decoded
    where it is used (an opaque operator, placed at the start of the backward graph, decoded
    them all at once, and compiled whole the step peaked as high as without memopt)."""
    top, pull = 2**c.bits - 1, 1 - FIRST_LEVEL[c.bits]
    work = work_dtype(c.dtype)
    n_groups = c.scale.numel()
    if c.bits < 8:
        codes = _unpack_planes(c.codes, c.bits, n_groups)
    else:
        codes = c.codes.view(n_groups, c.group_size)
    offset = codes.to(work) - c.zero_point.to(work)[:, None]
    levels = (offset - torch.sign(offset) * pull) * c.scale.to(work)[:, None]
    lost = (c.scale == 0) & (c.zero_point == top)
    levels = torch.where(lost[:, None], float("nan"), levels)
    return levels.reshape(-1)[: c.numel].to(c.dtype).view(c.shape)


def memory_order(t: torch.Tensor) -> list[int] | None:
    """``t``'s dims from outermost to innermost in memory, when its elements are dense in that
    order (``t.permute(order)`` is contiguous: a transposed or permuted dense tensor); else
    ``None``."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return order if t.permute(order).is_contiguous() else None
