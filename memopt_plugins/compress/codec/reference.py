"""The codec's torch implementation: its specification, run where no kernel serves.

Every kernel (the C kernel of :mod:`.native`, Triton on CUDA) writes the same bytes as this code
at round-to-nearest; :mod:`.ops` chooses which one runs. Levels and rounding are described in
:mod:`memopt_plugins.compress.codec`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...packing import pack_bits, unpack_bits

SUPPORTED_BITS = (2, 4, 8)
# The first level on each side of zero, in steps, per code width (a power of two, so that a
# constant group's value is exactly one first level of a bfloat16 step).
FIRST_LEVEL = {2: 1.0, 4: 2.0**-4, 8: 2.0**-4}
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Elements encoded or decoded per chunk: a few MB of temporaries, in cache on the CPU.
CHUNK_ELEMENTS_CPU = 2**18
CHUNK_ELEMENTS_ACCELERATOR = 2**24

#: What quantizing returns: codes, scale, zero point, and the side tables of the groups kept
#: exactly (index, values) and of the constant groups kept as one value (index, value).
Quantized = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True, slots=True)
class Groups:
    """``x`` flattened into rows of ``group_size`` elements, without copying ``x``.

    ``full`` views the complete groups (a copy only when ``x`` is not contiguous). A partial last
    group is ``tail``, a one-row copy padded by repeating its last element: that element belongs
    to the group, so the group's minimum, maximum, constancy and NaN/Inf status stay the same.
    """

    full: torch.Tensor
    tail: torch.Tensor | None

    @classmethod
    def of(cls, x: torch.Tensor, group_size: int) -> Groups:
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
        return torch.where((index == n_full)[:, None], self.tail, picked)  # no mask: no sync


def bf16_round_up(x: torch.Tensor) -> torch.Tensor:
    """``x`` (non-negative, float32 or float64) in bfloat16, rounded toward +inf so a step
    never shrinks.

    By the float32 bits: a bfloat16 is a float32 whose low 16 bits are 0, so adding ``0xFFFF``
    and clearing them is the ceiling (the largest finite value goes to inf). Integer arithmetic
    works on every backend, unlike ``nextafter`` for bfloat16, and survives ``torch.compile``:
    inductor drops the round trip of a comparison ``x.to(bfloat16).to(x.dtype) < x`` (it keeps
    low-precision intermediates in float32), which rounded the step to nearest instead.
    """
    if x.dtype == torch.float64:  # first to the float32 at or above x
        down = x.to(torch.float32)
        x = torch.where(
            down.to(x.dtype) < x, torch.nextafter(down, down.new_tensor(torch.inf)), down
        )
    bits = x.view(torch.int32)
    return ((bits + 0xFFFF) & -0x10000).view(torch.float32).to(torch.bfloat16)


@dataclass(frozen=True, slots=True)
class GroupParams:
    scale: torch.Tensor  # stored bfloat16 step, 0 for groups stored another way
    zero_point: torch.Tensor  # zero point in the work dtype (integer-valued)
    inverse: torch.Tensor  # 1 / stored step in the work dtype, 1 where the codes need none
    exact: torch.Tensor  # bool: group kept exactly
    const: torch.Tensor  # bool: constant group whose value goes in the side table


def group_params(mn: torch.Tensor, mx: torch.Tensor, bits: int, dtype: torch.dtype) -> GroupParams:
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
    stored = bf16_round_up(scale)
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
    # A constant group decodes exactly from its codes when its first level is |v| (v = 0: step 0);
    # any other finite constant decodes from them to |v| rounded up to a bfloat16 step (scaled by
    # the inverse, |v| sits at or below the first level, so it takes the code zp ± 1), and exactly
    # from the side table that holds it.
    const_by_codes = constant & finite & (step * c == mx.abs())
    exact = ~constant & ~encodable
    return GroupParams(
        scale=torch.where(exact, 0.0, stored.to(mn.dtype)).to(torch.bfloat16),
        zero_point=torch.where(exact, 0.0, zero_point),
        inverse=torch.where(invertible & (encodable | constant), inverse, 1.0),
        exact=exact,
        const=constant & ~const_by_codes,
    )


def graph_params(
    mn: torch.Tensor, mx: torch.Tensor, bits: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 scale and uint8 zero point that compiled graphs store
    (:func:`.traced.encode`): :func:`group_params`'s, except that a group kept exactly
    here (or a constant that is not finite) gets scale 0 and the top code, which decode to
    NaN."""
    params = group_params(mn, mx, bits, dtype)
    lost = params.exact | (params.const & ~torch.isfinite(mx))
    scale = torch.where(lost, 0.0, params.scale.to(mn.dtype)).to(torch.bfloat16)
    zero_point = torch.where(lost, float(2**bits - 1), params.zero_point).to(torch.uint8)
    return scale, zero_point


def _chunk_rows(group_size: int, per_byte: int, device: torch.device) -> int:
    """Groups per chunk (about ``_CHUNK_ELEMENTS_*`` elements), a multiple of ``per_byte``.

    A multiple of ``per_byte`` groups holds a whole number of packed bytes, so every chunk but
    the last starts on a byte boundary.
    """
    elements = CHUNK_ELEMENTS_CPU if device.type == "cpu" else CHUNK_ELEMENTS_ACCELERATOR
    return max(1, elements // (group_size * per_byte)) * per_byte


def _fill_uniform(out: torch.Tensor, draws: torch.Tensor, generator: torch.Generator) -> None:
    """Fill ``out`` with noise ``u`` in ``(0, 1)`` at 16-bit resolution; ``draws`` is scratch.

    ``u = (k + 0.5) / 2**16`` for ``k`` uniform on ``[0, 2**16)``: a midpoint grid, so ``E[u]``
    is exactly 1/2 and ``u`` is exactly representable and below 1 (``floor(u) == 0``). The bits come
    from 64-bit draws (``draws``: int64, a quarter of ``out``'s elements, rounded up) split four
    ways: one draw serves four elements, where ``torch.rand`` makes a float32 of each.
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
        work = work_dtype(like.dtype)
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


def encode(
    groups: Groups,
    params: GroupParams,
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


def decode(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The levels of all groups' codes as ``(groups, group_size)`` in ``dtype``, by chunks:
    ``(o - sign(o)·(1 - c))·step`` for the offset ``o = code - zp`` (``c``: :data:`FIRST_LEVEL`).

    Each product is exact in the work dtype (a multiple of 1/16 below 256 times a bfloat16), so a
    code equal to the zero point decodes to exactly 0. A group with scale 0 and the top code as
    zero point is lost (its values belonged in a side table that had no room,
    :func:`bounded_tables`) and decodes to NaN.
    """
    n_groups, size, per_byte = scale.numel(), group_size, 8 // bits
    device = codes.device
    work = work_dtype(dtype)
    rows = max(1, min(_chunk_rows(size, per_byte, device), n_groups))
    out = torch.empty(n_groups, size, dtype=dtype, device=device)
    scratch = None if dtype == work else out.new_empty(rows, size, dtype=work)
    shift = out.new_empty(rows, size, dtype=work)
    pull = 1 - FIRST_LEVEL[bits]
    lost = (scale == 0) & (zero_point == 2**bits - 1)
    step = torch.where(lost, float("nan"), scale.to(work))[:, None]
    zero_point = zero_point.to(work)[:, None]
    for start in range(0, n_groups, rows):
        stop = min(start + rows, n_groups)
        first = start * size // per_byte
        count = (stop - start) * size
        chunk = unpack_bits(codes[first : first + -(-count // per_byte)], bits, count)
        target = out[start:stop] if scratch is None else scratch[: stop - start]
        target.copy_(chunk.view(stop - start, size))
        target.sub_(zero_point[start:stop])
        target.sub_(torch.sign(target, out=shift[: stop - start]).mul_(pull))
        target.mul_(step[start:stop])
        if scratch is not None:
            out[start:stop] = target
    return out


def side_tables(
    groups: Groups | None,
    exact: torch.Tensor | None,
    const: torch.Tensor | None,
    *,
    like: torch.Tensor,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copies of the groups flagged ``exact`` (all their values) and ``const`` (one value each),
    with their indices; empty tables (of ``like``'s dtype and device) where nothing is flagged
    (``None``; ``groups`` is needed only when something is)."""
    exact_index = torch.empty(0, dtype=torch.int64, device=like.device)
    const_index = torch.empty(0, dtype=torch.int64, device=like.device)
    exact_values, const_values = like.new_empty(0, group_size), like.new_empty(0)
    if exact is not None:
        exact_index = exact.nonzero().view(-1)
        exact_values = groups.select(exact_index)
    if const is not None:
        const_index = const.nonzero().view(-1)
        const_values = groups.select(const_index)[:, 0].clone()  # not a view of the rows
    return exact_index, exact_values, const_index, const_values


def exact_slots(n_groups: int) -> int:
    """Rows of the table of groups kept exactly that :func:`bounded_tables` reserves for a
    tensor of ``n_groups`` groups: one, and one more per 1024 groups."""
    return torch.sym_min(n_groups, 1 + n_groups // 1024)  # symbolic sizes too


def const_slots(n_groups: int) -> int:
    """Entries of the table of constant groups that :func:`bounded_tables` reserves: 16, and one
    more per 64 groups (an index and a value each)."""
    return torch.sym_min(n_groups, 16 + n_groups // 64)


def _bounded(flagged: torch.Tensor, slots: int, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices of the first ``slots`` groups ``flagged`` (bool per group), padded with
    ``n_groups`` (no group), and the flags of the groups left out; from device operations only."""
    arange = torch.arange(n_groups, device=flagged.device)
    slot = flagged.cumsum(0) - 1
    kept = flagged & (slot < slots)
    index = torch.full((slots + 1,), n_groups, dtype=torch.int64, device=flagged.device)
    index.scatter_(0, torch.where(kept, slot, slots), arange)  # the rest to a spare last entry
    return index[:slots], flagged & ~kept


def bounded_tables(
    groups: Groups,
    exact: torch.Tensor,
    const: torch.Tensor,
    scale: torch.Tensor,
    *,
    like: torch.Tensor,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """Side tables of sizes known without reading the device (:func:`exact_slots`,
    :func:`const_slots`): what a GPU fills without the host waiting for it at every tensor.

    The first groups flagged ``exact`` and ``const`` (bool per group) go in, in order; unused
    entries have index ``len(groups)`` (:func:`apply_tables` skips them). Returns the tables and
    the groups lost for want of room: those kept exactly, and the constant ones that are not
    finite (``scale`` 0); a finite constant left out decodes from its codes to its value rounded
    up to a bfloat16 step instead (:func:`group_params`).
    """
    n_groups = len(groups)
    exact_index, exact_left = _bounded(exact, exact_slots(n_groups), n_groups)
    const_index, const_left = _bounded(const, const_slots(n_groups), n_groups)
    # Unused entries read the last group (a valid row); a Python bound copies nothing to the device.
    exact_values = groups.select(exact_index.clamp(max=n_groups - 1))
    const_values = groups.select(const_index.clamp(max=n_groups - 1))[:, 0].clone()
    lost = exact_left | (const_left & (scale == 0))
    return (exact_index, exact_values, const_index, const_values), lost


def apply_tables(
    out: torch.Tensor,
    exact_index: torch.Tensor | None,
    exact_values: torch.Tensor | None,
    const_index: torch.Tensor | None,
    const_values: torch.Tensor | None,
) -> None:
    """Write the side tables' groups into decoded ``out`` (``(groups, group_size)``), skipping
    entries whose index is past the last group (unused room of :func:`bounded_tables`), without
    reading the device: the skipped entries write again what the first entry writes (or row 0
    what it holds), so no index has two different values."""
    if const_index is not None:
        _put_rows(out, const_index, const_values[:, None].expand(-1, out.shape[1]))
    if exact_index is not None:
        _put_rows(out, exact_index, exact_values)


def _put_rows(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    used = index < out.shape[0]
    first_used = used[:1]
    spare_index = torch.where(first_used, index[:1], 0)
    spare_row = torch.where(first_used[:, None], rows[:1], out.index_select(0, spare_index))
    out.index_put_(
        (torch.where(used, index, spare_index),), torch.where(used[:, None], rows, spare_row)
    )


def quantize(x: torch.Tensor, bits: int, group_size: int, seed: int | None) -> Quantized:
    """Quantize contiguous ``x`` (see :mod:`memopt_plugins.compress.codec`); stochastic rounding
    with noise from a generator seeded with ``seed``, round-to-nearest when ``None``."""
    generator = None
    if seed is not None:
        generator = torch.Generator(device=x.device)
        generator.manual_seed(seed)
    groups = Groups.of(x, group_size)
    work = work_dtype(x.dtype)
    mins, maxs = groups.stats()
    params = group_params(mins.to(work), maxs.to(work), bits, x.dtype)
    n_exact, n_const = torch.stack((params.exact.sum(), params.const.sum())).tolist()
    codes = encode(groups, params, bits, generator, n_exact > 0)
    flagged = (params.exact if n_exact else None, params.const if n_const else None)
    tables = side_tables(groups, *flagged, like=x, group_size=group_size)
    return (codes, params.scale, params.zero_point.to(torch.uint8), *tables)
