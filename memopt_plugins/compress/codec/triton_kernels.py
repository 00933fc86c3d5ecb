"""The codec's Triton kernels, for CUDA: quantize and decode in one pass each, dropout masks.

``_quantize_kernel`` reads each group once (minimum and maximum, parameters, the flags of groups
kept exactly or constant, codes, bit packing) while it is in registers; ``_decode_kernel`` makes
one pass back. At round-to-nearest both write the reference's bytes (:mod:`.reference`): the same
float32 operations in the same order, ``div_rn``, no fused multiply-adds, bfloat16 rounding on the
bits. Stochastic rounding draws Philox noise (``tl.randint``) from ``seed`` and the element's
index, whatever the launch configuration. A program holds ``GROUPS`` groups as a
``(GROUPS, BYTE_COLS, PER_BYTE)`` tile fixed by the group size, so packing is a shift and a
sum; groups are padded to a power of two by repeating their last element. Where ``group_size``
is not a multiple of the codes per byte, :mod:`memopt_plugins.packing` packs in torch. Every
launch's constants come from :mod:`.triton_launch`, which enumerates them for
:mod:`.cuda_build`. On the CPU the kernels run in Triton's interpreter (:data:`INTERPRETED`),
which ``TRITON_INTERPRET=1`` must select before ``triton`` is first imported; this module
refuses to import when its kernels and triton's library disagree.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from ...packing import pack_bits, unpack_bits
from . import triton_launch as launches
from .triton_launch import BF16 as _BF16
from .triton_launch import F16 as _F16
from .triton_launch import F32 as _F32

DTYPES = {torch.float32: _F32, torch.bfloat16: _BF16, torch.float16: _F16}
# Group flags written by the quantize kernel.
_EXACT, _CONSTANT = 1, 2
# Half the least positive value of each element type: a float32 at or below it rounds to 0 there.
_HALF_LEAST = {_F32: 0.0, _BF16: 2.0**-134, _F16: 2.0**-25}
# Floats of each size as bits (the dropout masks' kernels read and write them so).
_BITS_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _bf16_bits_to_f32(bits):
    """float32 values of bfloat16 bit patterns (int16): the bits shifted into the high half."""
    wide = bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
    return wide.to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16_bits(value):
    """bfloat16 bits (int32 holding 16 bits) of float32 ``value``, rounded to nearest even."""
    u = value.to(tl.uint32, bitcast=True)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.int32)


@triton.jit
def _load_f32(ptr, DTYPE: tl.constexpr, mask=None):
    """Elements at ``ptr`` as float32 (``mask``: where to load; undefined elsewhere)."""
    if DTYPE == 1:
        return _bf16_bits_to_f32(tl.load(ptr, mask=mask))
    return tl.load(ptr, mask=mask).to(tl.float32)


@triton.jit
def _is_finite(v):
    return tl.abs(v) < float("inf")  # NaN compares false


@triton.jit
def _group_params(mn, mx, dtype_max, half_least, BITS: tl.constexpr, FIRST: tl.constexpr):
    """``reference.group_params`` in float32, operation for operation: (stored bfloat16 bits,
    zero point, inverse of the step, exact flag, constant flag) per group."""
    TOP: tl.constexpr = 2**BITS - 1
    finite = _is_finite(mn) & _is_finite(mx)
    constant = mn == mx
    mn = tl.where(finite, mn, 0.0)
    mx = tl.where(finite, mx, 0.0)
    nonneg = mn >= 0
    nonpos = mx <= 0
    span = tl.where(constant, 1.0, mx - mn)
    # NVIDIA's floor flushes subnormals to zero: the same floor for non-negative ones, and a
    # negative balance comes only from a non-negative group, whose zero point is 0 regardless.
    balance = tl.math.div_rn(-mn, span) * (TOP - 2 + 2 * FIRST) + (1 - FIRST)
    low_zp = tl.minimum(tl.maximum(tl.floor(balance), 1.0), TOP - 1.0)
    high_zp = tl.minimum(low_zp + 1, TOP - 1.0)
    low_step = tl.maximum(
        tl.math.div_rn(-mn, low_zp - 1 + FIRST), tl.math.div_rn(mx, TOP - low_zp - 1 + FIRST)
    )
    high_step = tl.maximum(
        tl.math.div_rn(-mn, high_zp - 1 + FIRST), tl.math.div_rn(mx, TOP - high_zp - 1 + FIRST)
    )
    higher = high_step < low_step
    zero_point = tl.where(
        nonneg, 0.0, tl.where(nonpos, TOP * 1.0, tl.where(higher, high_zp, low_zp))
    )
    one_sided = TOP - 1 + FIRST
    mixed_scale = tl.where(higher, high_step, low_step)
    scale = tl.where(
        nonneg,
        tl.math.div_rn(mx, one_sided),
        tl.where(nonpos, tl.math.div_rn(-mn, one_sided), mixed_scale),
    )
    scale = tl.where(constant, tl.math.div_rn(tl.abs(mx), FIRST), scale)
    # Rounded up to bfloat16: the nearest, or the next one up when the nearest is below.
    stored = _f32_to_bf16_bits(scale)
    stored = tl.where(_bf16_bits_to_f32(stored.to(tl.int16)) < scale, stored + 1, stored)
    step = _bf16_bits_to_f32(stored.to(tl.int16))

    # (A zero step has no inverse; dividing by 1 instead spares the interpreter's numpy a warning.)
    inverse = tl.math.div_rn(1.0, tl.where(step == 0, 1.0, step))
    invertible = (step != 0) & _is_finite(inverse)
    reach = (tl.maximum(zero_point, TOP - zero_point) - 1 + FIRST) * step
    first_nonzero = step * FIRST > half_least
    encodable = (~constant) & finite & invertible & first_nonzero & (reach <= dtype_max)
    const_by_codes = constant & finite & (step * FIRST == tl.abs(mx))
    exact = (~constant) & (~encodable)
    return (
        tl.where(exact, 0, stored),
        tl.where(exact, 0.0, zero_point),
        tl.where(invertible & (encodable | constant), inverse, 1.0),
        exact,
        constant & (~const_by_codes),
    )


@triton.jit(do_not_specialize=["seed"])
def _quantize_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    zero_point_ptr,
    flags_ptr,
    numel,
    n_groups,
    group_size,
    seed,
    dtype_max,
    half_least,
    BITS: tl.constexpr,
    FIRST: tl.constexpr,
    DTYPE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    GROUPS: tl.constexpr,
    BYTE_COLS: tl.constexpr,
    PER_BYTE: tl.constexpr,
):
    TOP: tl.constexpr = 2**BITS - 1
    LANE_BITS: tl.constexpr = 8 // PER_BYTE
    group = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    byte_col = tl.arange(0, BYTE_COLS)
    lane = tl.arange(0, PER_BYTE)
    col = byte_col[:, None] * PER_BYTE + lane[None, :]
    g3 = group[:, None, None]
    c3 = col[None, :, :]
    index = g3 * group_size + c3  # of the element in the padded tensor (the noise counter)
    # Lanes past the group repeat its last element, and elements past the tensor its last one
    # (a contiguous masked load, which the compiler can vectorize, and one element per group).
    inside = (c3 < group_size) & (index < numel)
    last = tl.minimum(tl.minimum(group, n_groups - 1) * group_size + group_size, numel) - 1
    x = tl.where(
        inside,
        _load_f32(x_ptr + index, DTYPE, inside),
        _load_f32(x_ptr + last, DTYPE)[:, None, None],
    )

    nan = tl.max(tl.max((x != x).to(tl.int32), axis=2), axis=1) > 0
    mn = tl.where(nan, float("nan"), tl.min(tl.min(x, axis=2), axis=1))
    mx = tl.where(nan, float("nan"), tl.max(tl.max(x, axis=2), axis=1))
    stored, zero_point, inverse, exact, const = _group_params(
        mn, mx, dtype_max, half_least, BITS, FIRST
    )

    # code = clamp(zp + sign(x) * (floor(max(|x * inverse| - c, 0) + u) + 1), 0, top): zp for 0
    # (and for NaN, in groups kept exactly); u = 1/2 rounds to nearest.
    zp = zero_point[:, None, None]
    q = tl.abs(x * inverse[:, None, None]) - FIRST
    q = tl.where(q > 0, q, 0.0)
    if STOCHASTIC:
        # u = (k + 1/2) / 2**16 for 16 random bits k: E[u] = 1/2 exactly, and floor(u) = 0.
        k = (tl.randint(seed, index) >> 16).to(tl.float32)
        q = q + (k * (2.0**-16) + 2.0**-17)
    else:
        q = q + 0.5
    magnitude = tl.floor(q) + 1
    code = tl.where(x > 0, zp + magnitude, tl.where(x < 0, zp - magnitude, zp))
    code = tl.minimum(tl.maximum(code, 0.0), TOP * 1.0).to(tl.int32)
    packed = tl.sum(code << (lane * LANE_BITS)[None, None, :], axis=2)

    live = group < n_groups
    byte_index = group[:, None] * (group_size // PER_BYTE) + byte_col[None, :]
    in_group = live[:, None] & (byte_col[None, :] * PER_BYTE < group_size)
    tl.store(codes_ptr + byte_index, packed.to(tl.uint8), mask=in_group)
    tl.store(scale_ptr + group, stored.to(tl.int16), mask=live)
    tl.store(zero_point_ptr + group, zero_point.to(tl.uint8), mask=live)
    flags = tl.where(exact, 1, 0) + tl.where(const, 2, 0)  # _EXACT, _CONSTANT
    tl.store(flags_ptr + group, flags.to(tl.uint8), mask=live)


@triton.jit
def _decode_kernel(
    codes_ptr,
    scale_ptr,
    zero_point_ptr,
    out_ptr,
    n_groups,
    group_size,
    BITS: tl.constexpr,
    FIRST: tl.constexpr,
    DTYPE: tl.constexpr,
    GROUPS: tl.constexpr,
    BYTE_COLS: tl.constexpr,
    PER_BYTE: tl.constexpr,
    LANE_BITS: tl.constexpr,
):
    PULL: tl.constexpr = 1 - FIRST
    TOP: tl.constexpr = 2**BITS - 1
    group = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    byte_col = tl.arange(0, BYTE_COLS)
    lane = tl.arange(0, PER_BYTE)
    live = group < n_groups
    in_group = live[:, None] & (byte_col[None, :] * PER_BYTE < group_size)
    byte_index = group[:, None] * (group_size // PER_BYTE) + byte_col[None, :]
    packed = tl.load(codes_ptr + byte_index, mask=in_group, other=0).to(tl.int32)
    code = (packed[:, :, None] >> (lane * LANE_BITS)[None, None, :]) & (2**LANE_BITS - 1)

    scale = tl.load(scale_ptr + group, mask=live, other=0)
    zp = tl.load(zero_point_ptr + group, mask=live, other=0).to(tl.float32)
    # Scale 0 with the top code as zero point: a group lost for want of side-table room (NaN).
    step = tl.where((scale == 0) & (zp == TOP), float("nan"), _bf16_bits_to_f32(scale))
    # The level (o - sign(o) * (1 - c)) * step of the offset o = code - zp.
    o = code.to(tl.float32) - zp[:, None, None]
    level = tl.where(o > 0, o - PULL, tl.where(o < 0, o + PULL, 0.0)) * step[:, None, None]

    col = byte_col[:, None] * PER_BYTE + lane[None, :]
    target = out_ptr + group[:, None, None] * group_size + col[None, :, :]
    keep = live[:, None, None] & (col[None, :, :] < group_size)
    if DTYPE == 1:
        tl.store(target, _f32_to_bf16_bits(level).to(tl.int16), mask=keep)
    elif DTYPE == 2:
        tl.store(target, level.to(tl.float16), mask=keep)
    else:
        tl.store(target, level, mask=keep)


@triton.jit
def _pack_mask_kernel(
    noise_ptr, packed_ptr, numel, n_bytes, MAGNITUDE: tl.constexpr, BYTES: tl.constexpr
):
    byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    lane = tl.arange(0, 8)
    index = byte[:, None] * 8 + lane[None, :]
    bits = tl.load(noise_ptr + index, mask=index < numel, other=0)
    nonzero = ((bits & MAGNITUDE) != 0).to(tl.int32)  # the float is nonzero (either sign)
    packed = tl.sum(nonzero << lane[None, :], axis=1)
    tl.store(packed_ptr + byte, packed.to(tl.uint8), mask=byte < n_bytes)


@triton.jit
def _unpack_mask_kernel(packed_ptr, out_ptr, numel, ONE: tl.constexpr, BLOCK: tl.constexpr):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = index < numel
    byte = tl.load(packed_ptr + index // 8, mask=live, other=0).to(tl.int32)
    bit = (byte >> (index % 8).to(tl.int32)) & 1
    tl.store(out_ptr + index, tl.where(bit != 0, ONE, 0), mask=live)


#: Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` at import).
INTERPRETED = not isinstance(_quantize_kernel, triton.runtime.JITFunction)
if INTERPRETED == isinstance(tl.randint, triton.runtime.JITFunction):
    raise ImportError(
        "TRITON_INTERPRET changed between the import of triton and of memopt's Triton kernels: "
        "set it (or not) before the process imports triton"
    )


def _device(t: torch.Tensor):
    """The tensor's CUDA device made current for a launch (Triton launches on the current one)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else nullcontext()


def _run(launch: launches.Launch, programs: int, *args) -> None:
    """Launch ``launch``'s kernel on ``programs`` programs: every launch passes here, with the
    constants, warps and options :mod:`.cuda_build` compiles ahead of time."""
    kernel = globals()[launch.kernel]
    kernel[(programs,)](
        *args, **launch.constants, num_warps=launch.num_warps, enable_fp_fusion=False
    )


def quantize(
    flat: torch.Tensor, bits: int, group_size: int, seed: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed codes, bfloat16 scale, ``uint8`` zero point, and the bool flags of the groups kept
    exactly and of the constant groups kept as one value, of contiguous 1-D ``flat`` (float32,
    bfloat16 or float16). Nothing here reads the device.

    ``seed``: stochastic rounding with noise from this seed; round-to-nearest when ``None``.
    """
    numel, dtype = flat.numel(), DTYPES[flat.dtype]
    n_groups = -(-numel // group_size)
    launch = launches.quantize_launch(bits, group_size, dtype, seed is not None)
    per_byte = launch.constants["PER_BYTE"]
    codes = flat.new_empty(-(-n_groups * group_size // per_byte), dtype=torch.uint8)
    scale = flat.new_empty(n_groups, dtype=torch.bfloat16)
    zero_point = flat.new_empty(n_groups, dtype=torch.uint8)
    flags = flat.new_empty(n_groups, dtype=torch.uint8)
    if numel == 0:
        return codes, scale, zero_point, flags.bool(), flags.bool()
    source = flat.view(torch.int16) if dtype == _BF16 else flat
    with _device(flat):
        _run(
            launch, triton.cdiv(n_groups, launch.constants["GROUPS"]),
            source, codes, scale.view(torch.int16), zero_point, flags,
            numel, n_groups, group_size, seed or 0,
            torch.finfo(flat.dtype).max, _HALF_LEAST[dtype],
        )  # fmt: skip
    if per_byte != 8 // bits:
        codes = pack_bits(codes, bits)
    return codes, scale, zero_point, (flags & _EXACT).bool(), (flags & _CONSTANT).bool()


def decode(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The levels of every group's codes, ``(groups, group_size)`` of ``dtype`` (float32,
    bfloat16 or float16): what ``reference.decode`` computes, in one pass."""
    n_groups = scale.numel()
    out = torch.empty(n_groups, group_size, dtype=dtype, device=codes.device)
    if n_groups == 0:
        return out
    code = DTYPES[dtype]
    launch = launches.decode_launch(bits, group_size, code)
    if launch.constants["PER_BYTE"] != 8 // bits:
        codes = unpack_bits(codes, bits, n_groups * group_size)
    with _device(codes):
        _run(
            launch, triton.cdiv(n_groups, launch.constants["GROUPS"]),
            codes, scale.contiguous().view(torch.int16), zero_point.contiguous(),
            out.view(torch.int16) if code == _BF16 else out, n_groups, group_size,
        )  # fmt: skip
    return out


def pack_mask(noise: torch.Tensor) -> torch.Tensor:
    """A contiguous 0/1 floating tensor as ``uint8`` bits, 8 elements per byte, low bits first
    (``pack_bits(noise.to(torch.uint8).reshape(-1), 1)`` in one pass)."""
    numel = noise.numel()
    packed = noise.new_empty(-(-numel // 8), dtype=torch.uint8)
    if numel == 0:
        return packed
    as_bits = noise.reshape(-1).view(_BITS_OF[noise.element_size()])
    launch = launches.pack_mask_launch(noise.element_size())
    programs = triton.cdiv(packed.numel(), launch.constants["BYTES"])
    with _device(noise):
        _run(launch, programs, as_bits, packed, numel, packed.numel())
    return packed


def unpack_mask(packed: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: the first ``numel`` bits as a flat 0/1 tensor of the
    floating ``dtype``."""
    out = torch.empty(numel, dtype=dtype, device=packed.device)
    if numel == 0:
        return out
    as_bits = out.view(_BITS_OF[out.element_size()])
    launch = launches.unpack_mask_launch(str(dtype).removeprefix("torch."))
    with _device(packed):
        _run(launch, triton.cdiv(numel, launch.constants["BLOCK"]), packed, as_bits, numel)
    return out
