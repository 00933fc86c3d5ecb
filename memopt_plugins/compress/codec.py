"""Activation codec: group-wise integer quantization of floating tensors.

``quantize`` turns a floating tensor into a :class:`PackedTensor` that holds only compact tensors:
codes of 8, 4 or 2 bits packed into ``uint8`` (:mod:`.bitpack`), plus a bfloat16 scale and a
``uint8`` zero point per group of ``group_size`` consecutive elements; :func:`packed_nbytes` states
that cost. ``dequantize`` restores shape and dtype. Where the fused CPU kernels of :mod:`.native`
are available they do the work; the torch path here is their specification.

Guarantees the rest of the engine builds on:

* an exact zero decodes to exactly zero, and a nonzero value decodes to a nonzero value of the
  same sign (backward formulas read the sign pattern of saved outputs, e.g. ReLU);
* stochastic rounding is unbiased: the expected decoded value is the input, except for values
  closer to zero than the first level (below), and it draws from a private generator, never from
  the global RNG;
* a constant group decodes exactly, and a group holding NaN/Inf (or a range the bfloat16 scale
  cannot express) is stored exactly, without affecting its neighbours.

The levels of a group are ``0`` and ``±(k - 1 + c)·step`` for ``k = 1, 2, ...`` codes away from
the zero point: uniformly spaced one step apart, except that the first level on each side of zero
sits at ``c·step`` (:data:`FIRST_LEVEL`). A value between 0 and the first level rounds to it, so
that the sign survives; with ``c = 1/16`` that biases only values within a sixteenth of a step of
zero, by less than that, where a first level of a whole step would bias every value within one
step (measured in ``benchmarks/gradient_bias.md``). At 2 bits four levels cannot spare the room,
and the first level is a whole step.

Integer tensors are not quantized: ``narrow_int`` / ``widen_int`` (:mod:`.narrow`, exported here
too) store them losslessly in the smallest integer type that holds their range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import native
from .bitpack import pack_bits, unpack_bits
from .narrow import NarrowedInt, narrow_int, widen_int

# The integer narrowing of :mod:`.narrow` is exported here with the codec.
__all__ = [
    "FIRST_LEVEL",
    "NarrowedInt",
    "PackedTensor",
    "codec_generator",
    "dequantize",
    "narrow_int",
    "packed_nbytes",
    "quantize",
    "tensor_nbytes",
    "widen_int",
]

_SUPPORTED_BITS = (2, 4, 8)
# The first level on each side of zero, in steps, per code width (a power of two, so that a
# constant group's value is exactly one first level of a bfloat16 step).
FIRST_LEVEL = {2: 1.0, 4: 2.0**-4, 8: 2.0**-4}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_GENERATOR_SEED = 0x6D656D6F  # fixed, so runs are reproducible; "memo" in ASCII
_GENERATORS: dict[torch.device, torch.Generator] = {}
# Elements encoded or decoded per chunk: a few MB of temporaries, in cache on the CPU.
_CHUNK_ELEMENTS_CPU = 2**18
_CHUNK_ELEMENTS_ACCELERATOR = 2**24


def tensor_nbytes(x: torch.Tensor) -> int:
    """Bytes of the elements of ``x`` (numel × element size)."""
    return x.numel() * x.element_size()


def _optional_nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(tensor_nbytes(t) for t in tensors if t is not None)


@dataclass(frozen=True, slots=True)
class PackedTensor:
    """A quantized tensor: compact tensors only, nothing full-size in full precision.

    Attributes:
        codes: ``uint8``, bit-packed codes of all groups (padding included), ``8 // bits`` per byte.
        scale: ``bfloat16`` step size per group (0 for an all-zero group).
        zero_point: ``uint8`` code that decodes to exactly 0, per group.
        exact_index: ``int64`` indices of the groups kept exactly (NaN/Inf or unrepresentable
            range), or ``None``.
        exact_values: those groups' values in the original dtype, ``(k, group_size)``, or ``None``.
        const_index: ``int64`` indices of constant groups whose value the codes cannot express
            exactly (e.g. ``1e-30``, ``inf``), or ``None``.
        const_values: one value per such group in the original dtype, or ``None``.
        shape, dtype: of the original tensor.
        bits, group_size: codec settings.
        numel: number of elements of the original tensor (the codes carry padding after it).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    exact_index: torch.Tensor | None
    exact_values: torch.Tensor | None
    const_index: torch.Tensor | None
    const_values: torch.Tensor | None
    shape: torch.Size
    dtype: torch.dtype
    bits: int
    group_size: int
    numel: int

    @property
    def nbytes(self) -> int:
        """Bytes held by all tensors inside."""
        return _optional_nbytes(
            self.codes,
            self.scale,
            self.zero_point,
            self.exact_index,
            self.exact_values,
            self.const_index,
            self.const_values,
        )


def packed_nbytes(numel: int, bits: int, group_size: int) -> int:
    """Bytes that :func:`quantize` stores for ``numel`` elements at ``bits`` per element.

    The codes of whole groups (a partial last group is padded to ``group_size``), ``8 // bits`` per
    byte, plus 3 bytes per group: the bfloat16 scale and the ``uint8`` zero point. This is
    ``quantize(x, bits, group_size).nbytes`` for any ``x`` of ``numel`` elements without groups
    kept exactly (NaN/Inf or an unrepresentable range) or constant groups kept as one value; the
    single source of truth for estimates of the codec's cost.
    """
    _check_settings(bits, group_size)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel!r}")
    groups = -(-numel // group_size)
    return -(-groups * group_size * bits // 8) + 3 * groups


def codec_generator(device: torch.device | str) -> torch.Generator:
    """The private generator that stochastic rounding uses on ``device`` when none is given.

    Created on first use and seeded with a fixed constant; the global RNG is never touched.
    Callers that must replay a computation exactly can save and restore its state
    (``get_state`` / ``set_state``).
    """
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, getattr(torch, device.type).current_device())
    generator = _GENERATORS.get(device)
    if generator is None:
        generator = torch.Generator(device=device)
        generator.manual_seed(_GENERATOR_SEED)
        _GENERATORS[device] = generator
    return generator


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True, slots=True)
class _Groups:
    """``x`` flattened into rows of ``group_size`` elements, without copying ``x``.

    ``full`` views the complete groups (a copy only when ``x`` is not contiguous). A partial last
    group is ``tail``, a one-row copy padded by repeating its last element: that element belongs
    to the group, so the group's minimum, maximum, constancy and NaN/Inf status stay the same.
    """

    full: torch.Tensor
    tail: torch.Tensor | None

    @classmethod
    def of(cls, x: torch.Tensor, group_size: int) -> _Groups:
        flat = x.reshape(-1)
        n_full = flat.numel() // group_size
        rest = flat[n_full * group_size :]
        tail = None
        if rest.numel():
            tail = torch.cat((rest, rest[-1:].expand(group_size - rest.numel())))[None]
        return cls(full=flat[: n_full * group_size].view(n_full, group_size), tail=tail)

    def __len__(self) -> int:
        return self.full.shape[0] + (self.tail is not None)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Groups ``start:stop``; a view unless the slice reaches the tail (then a copy of it)."""
        if self.tail is None or stop <= self.full.shape[0]:
            return self.full[start:stop]
        return torch.cat((self.full[start:], self.tail))

    def stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-group minimum and maximum (amin and amax separately: faster than aminmax)."""
        mins, maxs = self.full.amin(1), self.full.amax(1)
        if self.tail is not None:
            mins, maxs = torch.cat((mins, self.tail.amin(1))), torch.cat((maxs, self.tail.amax(1)))
        return mins, maxs

    def select(self, index: torch.Tensor) -> torch.Tensor:
        """Copies of the groups at ``index`` (1-D, int64)."""
        n_full = self.full.shape[0]
        if self.tail is None:
            return self.full[index]
        if n_full == 0:
            return self.tail[index]
        picked = self.full[index.clamp(max=n_full - 1)]
        picked[index == n_full] = self.tail
        return picked


def _bf16_round_up(x: torch.Tensor) -> torch.Tensor:
    """``x`` (non-negative) in bfloat16, rounded toward +inf so a step never shrinks."""
    y = x.to(torch.bfloat16)
    # For non-negative bfloat16 the bit pattern + 1 is the next value up (the largest finite
    # value goes to inf); integer arithmetic works on every backend, unlike nextafter for bf16.
    next_up = (y.view(torch.int16) + 1).view(torch.bfloat16)
    return torch.where(y.to(x.dtype) < x, next_up, y)


@dataclass(frozen=True, slots=True)
class _GroupParams:
    scale: torch.Tensor  # stored bfloat16 step, 0 for groups stored another way
    zero_point: torch.Tensor  # zero point in the work dtype (integer-valued)
    inverse: torch.Tensor  # 1 / stored step in the work dtype, 1 where the codes need none
    exact: torch.Tensor  # bool: group kept exactly
    const: torch.Tensor  # bool: constant group whose value goes in the side table


def _group_params(
    mn: torch.Tensor, mx: torch.Tensor, bits: int, dtype: torch.dtype
) -> _GroupParams:
    """Per-group scale and integer zero point from the group minimum ``mn`` and maximum ``mx``.

    The zero point is an integer code so that 0 is exactly representable. ``k`` codes above it
    reach ``(k - 1 + c)`` steps (``c``: :data:`FIRST_LEVEL`), and as many below it: a mixed-sign
    group takes whichever of the two zero points nearest the balance point needs the smaller step.
    The scale is rounded up to bfloat16, so the codes ``[0, 2**bits - 1]`` still cover
    ``[mn, mx]``.
    """
    top, c = 2**bits - 1, FIRST_LEVEL[bits]
    finite = torch.isfinite(mn) & torch.isfinite(mx)
    constant = mn == mx
    mn = torch.where(finite, mn, 0.0)
    mx = torch.where(finite, mx, 0.0)
    nonneg = mn >= 0
    nonpos = mx <= 0
    span = torch.where(constant, 1.0, mx - mn)

    def mixed_step(zp: torch.Tensor) -> torch.Tensor:
        return torch.maximum(-mn / (zp - 1 + c), mx / (top - zp - 1 + c))

    low_zp = ((-mn / span) * (top - 2 + 2 * c) + (1 - c)).floor_().clamp_(1, top - 1)
    high_zp = (low_zp + 1).clamp_(max=top - 1)
    low_step, high_step = mixed_step(low_zp), mixed_step(high_zp)
    higher = high_step < low_step
    zp_mixed = torch.where(higher, high_zp, low_zp)
    mixed_scale = torch.where(higher, high_step, low_step)
    zero_point = torch.where(nonneg, 0.0, torch.where(nonpos, float(top), zp_mixed))
    one_sided = top - 1 + c
    scale = torch.where(nonneg, mx / one_sided, torch.where(nonpos, -mn / one_sided, mixed_scale))
    # A constant v: the step |v| / c, and the code zp ± 1 decodes to v exactly when |v| / c is a
    # bfloat16.
    scale = torch.where(constant, mx.abs() / c, scale)
    stored = _bf16_round_up(scale)
    step = stored.to(mn.dtype)

    # A nonconstant group is encoded when its step has a finite inverse (values are scaled by
    # it), its decoded extremes are finite and its first level is not 0 in the output dtype;
    # NaN/Inf, a step that underflows or overflows keep it exact instead.
    info = torch.finfo(dtype)
    inverse = 1 / step
    invertible = torch.isfinite(inverse)
    reach = (torch.maximum(zero_point, top - zero_point) - 1 + c) * step
    first_nonzero = (step * c).to(dtype) != 0
    encodable = ~constant & finite & invertible & first_nonzero & (reach <= info.max)
    # A constant group decodes exactly from its codes when its first level is |v| (v = 0: step 0).
    # Any scaling below the first level gives the code zp ± 1, so an inverse of 1 serves too.
    const_by_codes = constant & finite & (step * c == mx.abs())
    exact = ~constant & ~encodable
    return _GroupParams(
        scale=torch.where(exact, 0.0, stored.to(mn.dtype)).to(torch.bfloat16),
        zero_point=torch.where(exact, 0.0, zero_point),
        inverse=torch.where(invertible & (encodable | const_by_codes), inverse, 1.0),
        exact=exact,
        const=constant & ~const_by_codes,
    )


def _chunk_rows(group_size: int, per_byte: int, device: torch.device) -> int:
    """Groups per chunk (about ``_CHUNK_ELEMENTS_*`` elements), a multiple of ``per_byte``.

    A multiple of ``per_byte`` groups holds a whole number of packed bytes, so every chunk but
    the last starts on a byte boundary.
    """
    elements = _CHUNK_ELEMENTS_CPU if device.type == "cpu" else _CHUNK_ELEMENTS_ACCELERATOR
    return max(1, elements // (group_size * per_byte)) * per_byte


def _fill_uniform(out: torch.Tensor, draws: torch.Tensor, generator: torch.Generator) -> None:
    """Fill ``out`` with noise ``u`` in ``(0, 1)`` at 16-bit resolution; ``draws`` is scratch.

    ``u = (k + 0.5) / 2**16`` for ``k`` uniform on ``[0, 2**16)``: a midpoint grid, so ``E[u]``
    is exactly 1/2 and ``u`` is exactly representable and below 1 (``floor(u) == 0``). The bits come
    from 64-bit draws (``draws``: int64, a quarter of ``out``'s elements, rounded up) split four
    ways, about 3× cheaper on CPU than ``torch.rand``.
    """
    draws.random_(-(2**63), None, generator=generator)  # the full 64-bit range
    k = draws.view(torch.int16)[: out.numel()].view(out.shape)  # k + 2**15 uniform on [0, 2**16)
    out.copy_(k).mul_(2**-16).add_(0.5 + 2**-17)


@dataclass(frozen=True, slots=True)
class _Scratch:
    """Buffers for one chunk of groups, reused from chunk to chunk."""

    values: torch.Tensor | None  # the chunk converted to the work dtype, when it is not in it
    codes: torch.Tensor  # work dtype
    sign: torch.Tensor  # work dtype
    draws: torch.Tensor | None  # int64 random bits, for stochastic rounding

    @classmethod
    def allocate(cls, like: torch.Tensor, rows: int, stochastic: bool) -> _Scratch:
        """Buffers for ``rows`` groups of ``like`` (a tensor of groups, for dtype and device)."""
        work = _work_dtype(like.dtype)
        shape = (rows, like.shape[1])
        numel = rows * like.shape[1]
        return cls(
            values=None if like.dtype == work else like.new_empty(shape, dtype=work),
            codes=like.new_empty(shape, dtype=work),
            sign=like.new_empty(shape, dtype=work),
            draws=like.new_empty(-(-numel // 4), dtype=torch.int64) if stochastic else None,
        )


def _round_to_codes(
    values: torch.Tensor,
    inverse: torch.Tensor,
    zero_point: torch.Tensor,
    bits: int,
    generator: torch.Generator | None,
    scratch: _Scratch,
) -> torch.Tensor:
    """Codes of a chunk of groups (work dtype, integer-valued in ``[0, 2**bits - 1]``).

    ``code = zp + sign(x) · (floor(max(|x · inverse| - c, 0) + u) + 1)``, so 0 for ``x == 0``
    (``inverse``: of the step):
    ``u ~ U(0, 1)`` from ``generator`` rounds ``|x|`` between the levels above and below it
    without bias, or ``u = 0.5`` without one rounds to the nearest, and ``|x|`` below the first
    level ``c·step`` rounds up to it (``c``: :data:`FIRST_LEVEL`). ``inverse`` and
    ``zero_point`` are ``(rows, 1)``. Returns a view of ``scratch.codes``.
    """
    rows = values.shape[0]
    if scratch.values is not None:
        values = scratch.values[:rows].copy_(values)
    codes = scratch.codes[:rows]
    sign = scratch.sign[:rows]
    torch.mul(values, inverse, out=codes).abs_().sub_(FIRST_LEVEL[bits]).clamp_min_(0)
    if generator is not None:
        _fill_uniform(sign, scratch.draws, generator)  # the sign buffer holds the noise first
        codes.add_(sign)
    else:
        codes.add_(0.5)
    codes.floor_().add_(1).mul_(torch.sign(values, out=sign))
    return codes.add_(zero_point).clamp_(0, 2**bits - 1)


def _encode(
    groups: _Groups,
    params: _GroupParams,
    bits: int,
    generator: torch.Generator | None,
    clear_nan: bool,
) -> torch.Tensor:
    """Packed codes of all ``groups`` (see :func:`_round_to_codes`), a chunk at a time.

    Chunking bounds the temporaries to a few MB however large the tensor, reuses them from chunk
    to chunk, and keeps them in cache on the CPU. ``clear_nan`` zeroes the (unused) codes of
    NaN groups before the integer conversion.
    """
    like = groups.full
    n_groups, size = len(groups), like.shape[1]
    per_byte = 8 // bits
    rows = max(1, min(_chunk_rows(size, per_byte, like.device), n_groups))
    scratch = _Scratch.allocate(like, rows, stochastic=generator is not None)
    packed = like.new_empty(-(-n_groups * size // per_byte), dtype=torch.uint8)
    inverse = params.inverse[:, None]
    zero_point = params.zero_point[:, None]
    for start in range(0, n_groups, rows):
        stop = min(start + rows, n_groups)
        codes = _round_to_codes(
            groups.rows(start, stop),
            inverse[start:stop],
            zero_point[start:stop],
            bits,
            generator,
            scratch,
        )
        if clear_nan:
            codes.nan_to_num_(0.0)
        chunk_bytes = pack_bits(codes.view(-1), bits)
        first = start * size // per_byte
        packed[first : first + chunk_bytes.numel()] = chunk_bytes
    return packed


def _decode(p: PackedTensor) -> torch.Tensor:
    """The levels of all groups' codes as ``(groups, group_size)`` in ``p.dtype``, by chunks:
    ``(o - sign(o)·(1 - c))·step`` for the offset ``o = code - zp`` (``c``: :data:`FIRST_LEVEL`).

    Each product is exact in the work dtype (a multiple of 1/16 below 256 times a bfloat16), so a
    code equal to the zero point decodes to exactly 0.
    """
    n_groups, size, per_byte = p.scale.numel(), p.group_size, 8 // p.bits
    device = p.codes.device
    work_dtype = _work_dtype(p.dtype)
    rows = max(1, min(_chunk_rows(size, per_byte, device), n_groups))
    out = torch.empty(n_groups, size, dtype=p.dtype, device=device)
    work = None if p.dtype == work_dtype else out.new_empty(rows, size, dtype=work_dtype)
    shift = out.new_empty(rows, size, dtype=work_dtype)
    pull = 1 - FIRST_LEVEL[p.bits]
    step = p.scale.to(work_dtype)[:, None]
    zero_point = p.zero_point.to(work_dtype)[:, None]
    for start in range(0, n_groups, rows):
        stop = min(start + rows, n_groups)
        first = start * size // per_byte
        count = (stop - start) * size
        codes = unpack_bits(p.codes[first : first + -(-count // per_byte)], p.bits, count)
        target = out[start:stop] if work is None else work[: stop - start]
        target.copy_(codes.view(stop - start, size))
        target.sub_(zero_point[start:stop])
        target.sub_(torch.sign(target, out=shift[: stop - start]).mul_(pull))
        target.mul_(step[start:stop])
        if work is not None:
            out[start:stop] = target
    return out


def _check_settings(bits: int, group_size: int) -> None:
    if bits not in _SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {_SUPPORTED_BITS}, got {bits!r}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")


def _check_args(x: torch.Tensor, bits: int, group_size: int) -> None:
    _check_settings(bits, group_size)
    if x.dtype not in _FLOAT_DTYPES:
        allowed = ", ".join(str(d) for d in _FLOAT_DTYPES)
        raise TypeError(f"quantize takes a floating tensor ({allowed}), got {x.dtype}")


def quantize(
    x: torch.Tensor,
    bits: int,
    group_size: int = 256,
    stochastic: bool = True,
    generator: torch.Generator | None = None,
) -> PackedTensor:
    """Quantize ``x`` to ``bits`` (2, 4 or 8) per element in groups of ``group_size`` elements.

    Args:
        x: a float32, bfloat16, float16 or float64 tensor of any shape and layout.
        bits: code width; 8 → one code per byte, 4 → two, 2 → four.
        group_size: consecutive elements (in row-major order) sharing a scale and zero point.
        stochastic: unbiased stochastic rounding if true, round to nearest otherwise.
        generator: source of the rounding noise; by default a private per-device generator
            (see :func:`codec_generator`), so the global RNG stream is left untouched.

    Returns:
        A :class:`PackedTensor` that references neither ``x`` nor any full-precision copy of it.
    """
    _check_args(x, bits, group_size)
    if stochastic and generator is None:
        generator = codec_generator(x.device)
    x = x.detach()
    if native.supports(x.device, x.dtype):
        return _quantize_native(x.contiguous(), bits, group_size, generator if stochastic else None)
    with torch.no_grad():
        groups = _Groups.of(x, group_size)
        work = _work_dtype(x.dtype)
        mins, maxs = groups.stats()
        params = _group_params(mins.to(work), maxs.to(work), bits, x.dtype)
        n_exact, n_const = torch.stack((params.exact.sum(), params.const.sum())).tolist()
        codes = _encode(groups, params, bits, generator if stochastic else None, n_exact > 0)
        return _packed(
            x,
            groups,
            codes,
            params.scale,
            params.zero_point.to(torch.uint8),
            params.exact if n_exact else None,
            params.const if n_const else None,
            bits,
            group_size,
        )


def _quantize_native(
    x: torch.Tensor, bits: int, group_size: int, generator: torch.Generator | None
) -> PackedTensor:
    """:func:`quantize` by the fused CPU kernels (contiguous ``x``); same bytes when nearest."""
    seed = None
    if generator is not None:  # one draw from the generator seeds the kernels' noise
        seed = int(torch.randint(2**62, (), generator=generator))
    q = native.quantize(x.view(-1), group_size, bits, FIRST_LEVEL[bits], seed)
    exact = q.exact if q.exact is not None and q.exact.any() else None
    const = q.const if q.const is not None and q.const.any() else None
    groups = _Groups.of(x, group_size) if exact is not None or const is not None else None
    return _packed(x, groups, q.codes, q.scale, q.zero_point, exact, const, bits, group_size)


def _packed(
    x: torch.Tensor,
    groups: _Groups | None,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    exact: torch.Tensor | None,
    const: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> PackedTensor:
    """The :class:`PackedTensor` of ``x``, with copies of the groups flagged ``exact`` (all
    their values) and ``const`` (one value each); ``groups`` may be ``None`` when neither is."""
    exact_index = exact_values = const_index = const_values = None
    if exact is not None:
        exact_index = exact.nonzero().view(-1)
        exact_values = groups.select(exact_index)
    if const is not None:
        const_index = const.nonzero().view(-1)
        const_values = groups.select(const_index)[:, 0].clone()  # not a view of the rows
    return PackedTensor(
        codes=codes,
        scale=scale,
        zero_point=zero_point,
        exact_index=exact_index,
        exact_values=exact_values,
        const_index=const_index,
        const_values=const_values,
        shape=x.shape,
        dtype=x.dtype,
        bits=bits,
        group_size=group_size,
        numel=x.numel(),
    )


def dequantize(p: PackedTensor) -> torch.Tensor:
    """Decode ``p`` to a contiguous tensor of its original shape and dtype.

    Nothing in ``p`` requires gradients, so neither does the result (no ``no_grad`` needed).
    """
    if native.supports(p.codes.device, p.dtype):
        out = native.decode(
            p.codes, p.bits, FIRST_LEVEL[p.bits], p.group_size, p.scale, p.zero_point, p.dtype
        )
    else:
        out = _decode(p)
    if p.const_index is not None:
        out[p.const_index] = p.const_values[:, None]
    if p.exact_index is not None:
        out[p.exact_index] = p.exact_values
    if out.numel() != p.numel:  # padding after the last element
        out = out.view(-1)[: p.numel]
    return out.view(p.shape)
