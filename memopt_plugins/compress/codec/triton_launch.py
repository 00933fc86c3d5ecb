"""What the Triton kernels are launched with: one source of truth for their specializations.

Triton compiles one binary per set of compile-time constants (``tl.constexpr``), warps and
argument types. :mod:`.triton_kernels` builds every launch from the :class:`Launch` records made
here, and :func:`specializations` enumerates those records for a set of group sizes (every bit
width, element type, rounding and tensor size), so :mod:`.cuda_build` can compile each for a
CUDA GPU ahead of time, without one. Pure Python: nothing here imports triton or reads a device.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .reference import FIRST_LEVEL, SUPPORTED_BITS

#: Elements a program holds (a whole group when the group is larger).
TILE = 2048
#: Element types: the code the kernels switch on. bfloat16 is read and written as its bits.
F32, BF16, F16 = 0, 1, 2
#: Triton's name of the pointer type each element type is passed as.
_ELEMENT_POINTER = {F32: "*fp32", BF16: "*i16", F16: "*fp16"}
#: Dropout masks: packed bytes per program (and unpacked elements: eight times as many).
MASK_BYTES = 512
_MASK_WARPS = 4  # Triton's default
#: Triton's integer pointer type of floats of each size, as bits, and the bits of their 1.0.
_MASK_POINTER = {2: "*i16", 4: "*i32", 8: "*i64"}
_ONE_BITS = {"float16": 0x3C00, "bfloat16": 0x3F80, "float32": 0x3F800000}
_ONE_BITS["float64"] = 0x3FF0000000000000
_MASK_DTYPE_SIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_CODEC_POINTERS = {"codes_ptr": "*u8", "scale_ptr": "*i16", "zero_point_ptr": "*u8"}
# Sizes are passed as Python ints: Triton types them i32 below 2**31 (tensors beyond it launch
# an i64 variant that is not enumerated here).
_SIZES = {"numel": "i32", "n_groups": "i32", "group_size": "i32"}


@dataclass(frozen=True)
class Launch:
    """One kernel specialization: the kernel's name in :mod:`.triton_kernels`, its compile-time
    constants, its warps, and the Triton types of its other arguments. Hashable: launches that
    compile to the same binary are equal."""

    kernel: str
    constexprs: tuple[tuple[str, int | float | bool], ...]
    num_warps: int
    types: tuple[tuple[str, str], ...]

    @property
    def constants(self) -> dict[str, int | float | bool]:
        return dict(self.constexprs)

    def __str__(self) -> str:
        constants = ",".join(f"{k}={v}" for k, v in self.constexprs)
        return f"{self.kernel}[{constants},warps={self.num_warps}]"


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def per_byte(bits: int, group_size: int) -> int:
    """Codes per byte the kernels pack themselves: ``8 // bits`` unless bytes straddle groups
    (then 1, and torch packs them)."""
    codes = 8 // bits
    return codes if group_size % codes == 0 else 1


def tiling(group_size: int, packed_per_byte: int) -> tuple[int, int]:
    """(groups per program, byte columns per group) of a ``TILE``-element tile: fixed by the
    group size, whatever the tensor's size (groups past the tensor are masked), so one group
    size compiles one tile shape."""
    padded = max(_next_power_of_2(group_size), packed_per_byte)
    return max(1, TILE // padded), padded // packed_per_byte


def _warps(tile: int) -> int:
    """Warps of a program holding ``tile`` elements: 4, and more for a group beyond the tile."""
    return 4 if tile <= TILE else 8


def _launch(kernel: str, constants: dict, warps: int, types: dict[str, str]) -> Launch:
    return Launch(kernel, tuple(constants.items()), warps, tuple(sorted(types.items())))


def quantize_launch(bits: int, group_size: int, dtype: int, stochastic: bool) -> Launch:
    """The launch of ``_quantize_kernel`` for ``bits``, ``group_size``, element type ``dtype``
    (:data:`F32`, :data:`BF16`, :data:`F16`) and rounding."""
    packs = per_byte(bits, group_size)
    groups, byte_cols = tiling(group_size, packs)
    constants = dict(BITS=bits, FIRST=FIRST_LEVEL[bits], DTYPE=dtype, STOCHASTIC=stochastic)
    constants |= dict(GROUPS=groups, BYTE_COLS=byte_cols, PER_BYTE=packs)
    types = {"x_ptr": _ELEMENT_POINTER[dtype], "flags_ptr": "*u8", **_CODEC_POINTERS}
    types |= {"dtype_max": "fp32", "half_least": "fp32", **_SIZES}
    types["seed"] = "i64" if stochastic else "i32"  # drawn below 2**62; 0 at nearest
    return _launch("_quantize_kernel", constants, _warps(groups * byte_cols * packs), types)


def decode_launch(bits: int, group_size: int, dtype: int) -> Launch:
    """The launch of ``_decode_kernel`` (arguments as :func:`quantize_launch`)."""
    packs = per_byte(bits, group_size)
    groups, byte_cols = tiling(group_size, packs)
    constants = dict(BITS=bits, FIRST=FIRST_LEVEL[bits], DTYPE=dtype, GROUPS=groups)
    constants |= dict(BYTE_COLS=byte_cols, PER_BYTE=packs, LANE_BITS=8 // packs)
    types = {"out_ptr": _ELEMENT_POINTER[dtype], **_CODEC_POINTERS, **_SIZES}
    del types["numel"]
    return _launch("_decode_kernel", constants, _warps(groups * byte_cols * packs), types)


def pack_mask_launch(element_size: int) -> Launch:
    """The launch of ``_pack_mask_kernel`` for floats of ``element_size`` bytes."""
    constants = dict(MAGNITUDE=2 ** (8 * element_size - 1) - 1, BYTES=MASK_BYTES)
    types = {"noise_ptr": _MASK_POINTER[element_size], "packed_ptr": "*u8"}
    types |= {"numel": "i32", "n_bytes": "i32"}
    return _launch("_pack_mask_kernel", constants, _MASK_WARPS, types)


def unpack_mask_launch(dtype: str) -> Launch:
    """The launch of ``_unpack_mask_kernel`` writing ``dtype`` (``"float32"``, ...)."""
    constants = dict(ONE=_ONE_BITS[dtype], BLOCK=8 * MASK_BYTES)
    types = {"packed_ptr": "*u8", "out_ptr": _MASK_POINTER[_MASK_DTYPE_SIZE[dtype]]}
    types["numel"] = "i32"
    return _launch("_unpack_mask_kernel", constants, _MASK_WARPS, types)


def specializations(group_sizes: Iterable[int]) -> list[Launch]:
    """Every launch the kernels can make with these group sizes, for any tensor: 8/4/2 bits,
    float32/bfloat16/float16, stochastic and nearest rounding, quantize and decode; and the
    dropout masks' kernels for every floating type. Each once, in a stable order."""
    launches = []
    for group_size in group_sizes:
        for bits in SUPPORTED_BITS:
            for dtype in (F32, BF16, F16):
                launches += [quantize_launch(bits, group_size, dtype, s) for s in (False, True)]
                launches.append(decode_launch(bits, group_size, dtype))
    launches += [pack_mask_launch(size) for size in sorted(set(_MASK_DTYPE_SIZE.values()))]
    launches += [unpack_mask_launch(dtype) for dtype in _ONE_BITS]
    return list(dict.fromkeys(launches))
