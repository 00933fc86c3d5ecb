"""Codec: error bounds, bytes held, exactness guarantees, RNG isolation, integer narrowing.

Every test runs twice: on the fused CPU kernels (``native``) and on the torch ops (``torch``).
"""

import gc
import math
import weakref

import pytest
import torch

from memopt_plugins.compress.codec import (
    PackedTensor,
    codec_generator,
    dequantize,
    native,
    packed_nbytes,
    quantize,
    reference,
    tensor_nbytes,
)
from memopt_plugins.compress.codec.reference import FIRST_LEVEL
from memopt_plugins.packing import NarrowedInt, narrow_int, pack_bits, unpack_bits, widen_int

BITS = (2, 4, 8)
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@pytest.fixture(autouse=True, params=["native", "torch"])
def codec_path(request, monkeypatch) -> str:
    """Run the test on the fused kernels, then on the torch path (the kernels switched off)."""
    if request.param == "native":
        if native.library() is None:
            pytest.skip("the codec kernels cannot be built here (no C compiler?)")
    else:
        monkeypatch.setitem(native._state, "lib", None)
    return request.param


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _step_per_element(p: PackedTensor) -> torch.Tensor:
    """The decode step of each original element (its group's scale), flat, float64."""
    return p.scale.cpu().double().repeat_interleave(p.group_size)[: p.numel]


def _errors(x: torch.Tensor, p: PackedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(|decoded - x|, step) per element, flat, float64, on the CPU."""
    decoded = dequantize(p).cpu().double()
    return (decoded - x.cpu().double()).reshape(-1).abs(), _step_per_element(p)


@pytest.mark.parametrize("bits", BITS)
def test_stochastic_error_is_below_one_step(bits: int) -> None:
    x = torch.randn(50, 301, generator=_generator(1)) * 3  # 15050 elements: last group partial
    p = quantize(x, bits, group_size=256, generator=_generator(2))
    err, step = _errors(x, p)
    assert (err < step).all(), f"max error / step = {(err / step).max():.3f}"


@pytest.mark.parametrize("bits", BITS)
def test_nearest_error_is_half_a_step_except_below_the_first_level(bits: int) -> None:
    x = torch.randn(50, 301, generator=_generator(1)) * 3
    p = quantize(x, bits, group_size=256, stochastic=False)
    err, step = _errors(x, p)
    first = step * FIRST_LEVEL[bits]
    tiny = x.reshape(-1).double().abs() < first  # rounded up to the first level: sign kept
    assert (err[~tiny] <= step[~tiny] * (0.5 + 1e-6)).all()
    assert (err[tiny] < first[tiny]).all()
    assert (~tiny).sum() > 100  # the half-step bound was exercised


def test_codes_never_pass_the_top_level_at_the_range_end() -> None:
    # The top level is 254 + 1/16 steps: noise just below 1 rounds 254 + u up to 255 in float32,
    # a code of 256 that must be clamped (uint8 would wrap it to 0). ~2**20 draws hit it about
    # 16 times.
    x = torch.full((4096, 256), 254.0625)
    x[:, 0] = 0.0  # range [0, 254.0625] at 8 bits: step exactly 1
    p = quantize(x, 8, generator=_generator(4))
    assert torch.equal(p.scale, torch.ones(4096, dtype=torch.bfloat16))
    err, step = _errors(x, p)
    assert err.max() < 1.0


@pytest.mark.parametrize("bits", BITS)
def test_lopsided_mixed_sign_group_is_quantized_not_kept_exact(bits: int) -> None:
    x = torch.rand(4, 256, generator=_generator(15)) + 0.5
    x[:2, 0] = -1e-3  # one tiny negative among positives: a zero point near 0, not 0
    x[2:] *= -1
    x[2:, 0] = 1e-3  # one tiny positive among negatives: a zero point near the top
    p = quantize(x, bits, generator=_generator(16))
    assert p.exact_index is None and p.const_index is None
    # Zero point 1 would fit the negative within the first level (1/16 step at 8 and 4 bits):
    # at 8 bits a second code down needs the smaller step.
    zp = 2 if bits == 8 else 1
    assert p.zero_point.tolist() == [zp, zp, 2**bits - 1 - zp, 2**bits - 1 - zp]
    err, step = _errors(x, p)
    assert (err < step).all()
    assert torch.equal(dequantize(p).sign(), x.sign())


@pytest.mark.parametrize("bits", BITS)
def test_nearest_codes_match_reference_rounding(bits: int) -> None:
    x = torch.randn(4096, generator=_generator(3)).double()
    x[::7] = 0.0
    p = quantize(x, bits, group_size=128, stochastic=False)
    # Each group's levels: 0 and (k - 1 + c) steps for k = 1, 2, ... codes from the zero point.
    offset = torch.arange(2**bits).double() - p.zero_point.double()[:, None]
    pull = offset.sign() * (1 - FIRST_LEVEL[bits])
    levels = ((offset - pull) * p.scale.double()[:, None]).repeat_interleave(128, dim=0)
    # The nearest level of the value's own sign (0 for 0 only).
    distance = (levels - x[:, None]).abs()
    distance[levels.sign() != x.sign()[:, None]] = math.inf
    reference = levels.gather(1, distance.argmin(1, keepdim=True)).view(-1)
    assert torch.equal(dequantize(p), reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", BITS)
def test_chunked_coding_matches_one_chunk(bits: int, dtype: torch.dtype, monkeypatch) -> None:
    x = (torch.randn(7, 1001, generator=_generator(17)) * 5).to(dtype)  # 7007: partial last group
    x[3, 100:400] = 0.0
    whole = quantize(x, bits, group_size=63, stochastic=False)
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS_CPU", 500)  # a few odd-sized groups per chunk
    chunked = quantize(x, bits, group_size=63, stochastic=False)
    assert torch.equal(chunked.codes, whole.codes)
    assert torch.equal(dequantize(chunked), dequantize(whole))
    err, step = _errors(x, quantize(x, bits, group_size=63, generator=_generator(18)))
    rounding = x.double().abs().reshape(-1) * 2**-8  # of the decoded value into bfloat16
    assert ((err < step + rounding) | (err == 0)).all()  # (all-zero groups have step 0)


@pytest.mark.parametrize(("bits", "min_ratio"), [(8, 3.9), (4, 7.7), (2, 15.0)])
def test_packed_bytes_match_formula_and_ratio(bits: int, min_ratio: float) -> None:
    n = 256 * 64
    x = torch.randn(n)
    p = quantize(x, bits)
    assert p.nbytes == n * bits // 8 + 3 * n // 256  # codes + bf16 scale + uint8 zero point
    assert tensor_nbytes(x) / p.nbytes >= min_ratio


@pytest.mark.parametrize("bits", BITS)
def test_packed_bytes_with_partial_last_group(bits: int) -> None:
    n, group = 1001, 64  # 16 groups, the last one 41 elements + padding
    p = quantize(torch.randn(n), bits, group_size=group)
    groups = math.ceil(n / group)
    assert p.nbytes == math.ceil(groups * group * bits / 8) + 3 * groups


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(
    ("numel", "group"),
    [(256, 256), (4096, 256), (300, 256), (1001, 64), (999, 128), (37, 7), (0, 64)],
)
def test_packed_nbytes_states_what_quantize_holds(bits: int, numel: int, group: int) -> None:
    # Finite random values, and every group (a partial last one too) holds 2 or more of them:
    # no group is kept exactly or as one constant value.
    x = torch.randn(numel, generator=_generator(19))
    assert packed_nbytes(numel, bits, group) == quantize(x, bits, group_size=group).nbytes


def test_packed_nbytes_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="bits"):
        packed_nbytes(10, 3, 64)
    with pytest.raises(ValueError, match="group_size"):
        packed_nbytes(10, 8, 0)
    with pytest.raises(ValueError, match="numel"):
        packed_nbytes(-1, 8, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_tensor_holds_only_compact_tensors_and_no_reference_to_input(dtype) -> None:
    x = torch.randn(64, 256, dtype=dtype)
    x[3, 7] = math.nan  # an exact group
    x[5] = math.inf  # a constant group kept as one value
    ref = weakref.ref(x)
    p = quantize(x, 8)
    assert p.exact_index.tolist() == [3] and p.const_index.tolist() == [5]
    held = [getattr(p, name) for name in PackedTensor.__slots__]
    tensors = [t for t in held if isinstance(t, torch.Tensor)]
    assert len(tensors) == 7
    for t in tensors:
        assert t.untyped_storage().nbytes() == tensor_nbytes(t)  # no hidden larger storage
    assert p.nbytes == 64 * 256 + 3 * 64 + (8 + 256 * x.element_size()) + (8 + x.element_size())
    del x
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    "make",
    [
        lambda g, dt: torch.randn((), generator=g).to(dt),  # 0-dim
        lambda g, dt: torch.randn(1, generator=g).to(dt),
        lambda g, dt: torch.randn(3, 5, 7, generator=g).to(dt),  # odd numel
        lambda g, dt: torch.randn(40, 33, generator=g).to(dt).t(),  # transposed
        lambda g, dt: torch.randn(30, 64, generator=g).to(dt)[::3, 1::2],  # strided slice
        lambda g, dt: torch.randn(1, 70, generator=g).to(dt).expand(9, 70),  # stride 0
        lambda g, dt: torch.randn(0, 4, generator=g).to(dt),  # empty
    ],
    ids=["scalar", "one", "odd", "transposed", "strided", "expanded", "empty"],
)
def test_any_shape_layout_and_dtype_round_trips(make, dtype: torch.dtype) -> None:
    x = make(_generator(5), dtype)
    p = quantize(x, 4, group_size=32, generator=_generator(6))
    y = dequantize(p)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    err, step = _errors(x, p)
    # Plus the rounding of the decoded value into a 16-bit dtype (half a unit in the last place).
    half_ulp = torch.finfo(dtype).eps / 2 * (x.double().abs().reshape(-1) + step)
    assert (err <= step + half_ulp).all()


def test_input_requiring_grad_is_quantized_without_a_graph() -> None:
    x = torch.randn(300, requires_grad=True)
    y = dequantize(quantize(x, 8))
    assert not y.requires_grad and y.grad_fn is None
    assert (y - x.detach()).abs().max() < 0.05


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("value", [0.0, 1.5, -3.25, 1e-30, 0.1, -7e3, math.inf, -math.inf])
def test_constant_group_decodes_exactly(value: float, dtype: torch.dtype, bits: int) -> None:
    x = torch.full((3, 100), value, dtype=dtype)  # 300 elements: groups of 64, last one partial
    p = quantize(x, bits, group_size=64)
    assert torch.equal(dequantize(p), x)
    assert p.exact_index is None  # a constant never needs its group kept in full
    if float(x[0, 0]) in (0.0, 1.5, -3.25):  # |c| is a bfloat16 number: codes alone decode it
        assert p.const_index is None
        assert p.nbytes == math.ceil(320 * bits / 8) + 3 * 5


def test_unrepresentable_constant_costs_one_value_per_group() -> None:
    x = torch.full((1024,), 1e-30)
    p = quantize(x, 8)
    assert p.const_index.tolist() == [0, 1, 2, 3]
    assert p.nbytes == 1024 + 3 * 4 + 4 * 8 + 4 * 4  # + int64 index + fp32 value per group


@pytest.mark.parametrize("bits", BITS)
def test_nan_inf_groups_are_exact_and_neighbours_unaffected(bits: int) -> None:
    clean = torch.randn(8 * 256, generator=_generator(7))
    x = clean.clone()
    x[2 * 256 + 17] = math.nan
    x[5 * 256 + 3] = math.inf
    x[6 * 256 + 200] = -math.inf
    x[6 * 256 + 201] = math.nan
    p = quantize(x, bits, generator=_generator(8))
    q = quantize(clean, bits, generator=_generator(8))
    assert p.exact_index.tolist() == [2, 5, 6]
    y, reference = dequantize(p).view(8, 256), dequantize(q).view(8, 256)
    special = [2, 5, 6]
    kept = x.view(8, 256)[special]
    assert torch.equal(y[special].isnan(), kept.isnan())
    assert torch.equal(y[special].nan_to_num(0.0), kept.nan_to_num(0.0))
    others = [0, 1, 3, 4, 7]
    assert torch.equal(y[others], reference[others])  # bit for bit the clean tensor's decode


def test_nan_in_the_partial_last_group_is_restored_from_a_small_copy() -> None:
    x = torch.randn(1000, generator=_generator(19))  # 3 full groups of 256 and a tail of 232
    x[100] = math.nan
    x[-5] = math.inf
    groups = reference.Groups.of(x, 256)
    assert groups.full.data_ptr() == x.data_ptr() and groups.tail.numel() == 256  # no full copy
    p = quantize(x, 4)
    assert p.exact_index.tolist() == [0, 3]
    y = dequantize(p)
    for group in (slice(0, 256), slice(768, 1000)):
        assert torch.equal(y[group].nan_to_num(0.0), x[group].nan_to_num(0.0))
        assert torch.equal(y[group].isnan(), x[group].isnan())
    step = p.scale[1:3].float().repeat_interleave(256)
    assert ((y[256:768] - x[256:768]).abs() < step).all()  # the groups between are quantized


def test_fp16_group_near_the_dtype_limit_never_decodes_to_inf() -> None:
    x = torch.linspace(-65504, 65504, 512).to(torch.float16)
    for bits in BITS:
        y = dequantize(quantize(x, bits, group_size=64))
        assert torch.isfinite(y).all()
        err, step = _errors(x, quantize(x, bits, group_size=64, stochastic=False))
        assert (err <= step + 32).all()  # fp16 spacing is 32 near the limit


@pytest.mark.parametrize("bits", BITS)
def test_a_step_without_a_finite_inverse_keeps_its_group_exact(bits: int) -> None:
    # Values are scaled by 1 / step: a step under 2**-128 (subnormal groups) has none in float32.
    x = torch.randn(1024, generator=_generator(21))
    x[256:512] *= 1e-39  # float32 subnormals: step about 1e-41
    p = quantize(x, bits, stochastic=False)
    assert p.exact_index.tolist() == [1]
    y = dequantize(p)
    assert torch.equal(y[256:512], x[256:512])
    assert (y[:256] - x[:256]).abs().max() < p.scale[0].float()  # the neighbours: quantized


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("bits", BITS)
def test_zero_stays_zero_and_sign_survives(bits: int, stochastic: bool, dtype: torch.dtype) -> None:
    g = _generator(9)
    big = torch.randn(4096, generator=g) * 100
    tiny = torch.randn(4096, generator=g) * 1e-6
    subnormal = torch.randn(4096, generator=g).sign() * 1e-41
    x = torch.where(torch.rand(4096, generator=g) < 0.5, big, tiny)
    x = torch.where(torch.rand(4096, generator=g) < 0.05, subnormal, x)
    x[torch.rand(4096, generator=g) < 0.2] = 0.0
    x[256:512] = subnormal[256:512]  # a group of subnormals only: a subnormal bf16 step
    x[512:768] = 1e-45 * subnormal[512:768].sign()  # step underflows to 0: group kept exact
    x[512:768:3] = 0.0
    x[768:1024] = 1e-7 * x[768:1024].sign()  # float16 subnormals: a first level under its least
    x = x.to(dtype)
    assert (x == 0).sum() > 500 and (x.abs() < 1e-5).sum() > 1500
    y = dequantize(quantize(x, bits, stochastic=stochastic, generator=_generator(10)))
    assert torch.equal(y == 0, x == 0)
    assert torch.equal(y.sign(), x.sign())


@pytest.mark.parametrize(("bits", "signed"), [(2, False), (4, True), (8, True)])
def test_stochastic_rounding_is_unbiased_and_nearest_is_not(bits: int, signed: bool) -> None:
    g = _generator(11)
    # At 8 and 4 bits |x| in [0.05, 3): values under one step too, but none under the first
    # level (1/16 of a step of about 0.2 or 0.02), which they would round up to. At 2 bits the
    # first level is a whole step, so |x| in [1, 3); and 2 bits with both signs would have a
    # single negative level, so only positives there.
    low = 1.0 if bits == 2 else 0.05
    base = torch.rand(512, generator=g) * (3 - low) + low
    if signed:
        base[torch.rand(512, generator=g) < 0.5] *= -1
        base[1], base[257] = -3.0, -3.0
    base[0], base[256] = 3.0, 3.0  # the same range in both groups
    copies = 2000
    x = base.repeat(copies)  # each copy spans whole groups: same scales, fresh noise
    p = quantize(x, bits, generator=_generator(12))
    step = p.scale[:2].double().repeat_interleave(256)
    assert torch.equal(p.scale.view(copies, 2), p.scale[:2].expand(copies, 2))
    bias = (dequantize(p).double().view(copies, 512).mean(0) - base.double()) / step
    # Each decode has std <= step/2, so the mean of 2000 has std <= 0.0112 steps.
    assert bias.abs().max() < 0.06
    assert bias.mean().abs() < 0.003
    nearest = (dequantize(quantize(base, bits, stochastic=False)).double() - base.double()) / step
    assert nearest.abs().mean() > 0.15  # ~0.25 steps on values spread over the step


def test_global_rng_is_untouched() -> None:
    x = torch.randn(10_000)
    state = torch.get_rng_state()
    quantize(x, 4)
    quantize(x, 2, generator=_generator(0))
    assert torch.equal(torch.get_rng_state(), state)


def test_generator_controls_the_noise() -> None:
    x = torch.randn(10_000)
    a = quantize(x, 4, generator=_generator(1)).codes
    b = quantize(x, 4, generator=_generator(1)).codes
    c = quantize(x, 4, generator=_generator(2)).codes
    assert torch.equal(a, b)
    assert (a != c).float().mean() > 0.3
    # The private default generator advances: two calls draw different noise.
    before = codec_generator("cpu").get_state()
    d, e = quantize(x, 4).codes, quantize(x, 4).codes
    assert (d != e).float().mean() > 0.3
    codec_generator("cpu").set_state(before)
    assert torch.equal(quantize(x, 4).codes, d)  # and its state can be replayed


def test_scale_is_the_smallest_bfloat16_not_below_the_exact_step() -> None:
    g = _generator(20)
    powers = 10.0 ** torch.randint(-40, 38, (10_000,), generator=g)  # subnormal to near max
    exact = torch.cat((torch.rand(10_000, generator=g) * powers, torch.tensor([0.0, 1.0, 3.39e38])))
    rounded = reference.bf16_round_up(exact)
    assert (rounded.float() >= exact).all()
    below = (rounded.view(torch.int16) - 1).view(torch.bfloat16).float()  # the bf16 just under
    assert ((below < exact) | (rounded == 0)).all()
    assert rounded[-3:-1].tolist() == [0.0, 1.0] and rounded[-1].isinf()  # past the max: inf


@pytest.mark.parametrize("bits", (1, 2, 4, 8))  # 1: dropout masks
@pytest.mark.parametrize("count", [1, 7, 64, 1001])
def test_bit_packing_round_trips(bits: int, count: int) -> None:
    codes = torch.randint(0, 2**bits, (count,), dtype=torch.uint8, generator=_generator(13))
    packed = pack_bits(codes, bits)
    assert packed.numel() == math.ceil(count * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, count), codes)


def test_bad_arguments_raise() -> None:
    x = torch.randn(10)
    with pytest.raises(ValueError, match="bits"):
        quantize(x, 3)
    with pytest.raises(ValueError, match="group_size"):
        quantize(x, 8, group_size=0)
    with pytest.raises(TypeError, match="floating"):
        quantize(torch.arange(10), 8)
    with pytest.raises(TypeError, match="integer"):
        narrow_int(x)


@pytest.mark.parametrize(
    ("lo", "hi", "expected"),
    [
        (0, 255, torch.uint8),
        (-128, 127, torch.int8),
        (-1, 200, torch.int16),
        (0, 256, torch.int16),
        (-32768, 32767, torch.int16),
        (0, 65535, torch.int32),
        (-(2**31), 2**31 - 1, torch.int32),
        (-5, 2**40, torch.int64),  # nothing smaller fits: returned as is
    ],
)
def test_narrow_int_picks_the_smallest_dtype_losslessly(lo: int, hi: int, expected) -> None:
    x = torch.randint(lo, hi, (500,), generator=_generator(14))
    x[0], x[1] = lo, hi
    n = narrow_int(x)
    if expected == torch.int64:
        assert n is x
        return
    assert isinstance(n, NarrowedInt) and n.values.dtype == expected
    assert n.nbytes == 500 * expected.itemsize
    restored = widen_int(n)
    assert restored.dtype == torch.int64 and torch.equal(restored, x)


def test_narrow_int_keeps_shape_layout_and_source_dtype() -> None:
    x = torch.arange(-50, 50, dtype=torch.int32).view(10, 10).t()
    n = narrow_int(x)
    assert n.values.dtype == torch.int8 and n.values.is_contiguous()
    assert torch.equal(widen_int(n), x) and widen_int(n).dtype == torch.int32


@pytest.mark.parametrize(
    "x",
    [
        torch.empty(0, dtype=torch.int64),
        torch.arange(10, dtype=torch.uint8),
        torch.ones(4, dtype=torch.bool),
        torch.arange(8).expand(1000, 8),  # 64 bytes held; narrowing would allocate 8000
    ],
    ids=["empty", "uint8", "bool", "expanded"],
)
def test_narrow_int_returns_input_when_nothing_is_saved(x: torch.Tensor) -> None:
    assert narrow_int(x) is x


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_keeps_guarantees_and_rng() -> None:
    x = torch.randn(4096, 33, device="cuda")
    x[0, :5] = 0.0
    x[1, 0] = math.nan
    state = torch.cuda.get_rng_state()
    for bits in BITS:
        p = quantize(x, bits)
        y = dequantize(p)
        assert y.device == x.device and y.shape == x.shape
        assert torch.equal(torch.cuda.get_rng_state(), state)
        err, step = _errors(x, p)
        finite = torch.isfinite(x.cpu().reshape(-1))
        assert (err[finite] < step[finite]).all()
        assert torch.equal(y == 0, x == 0) and y.isnan().sum() == 1


def test_a_traced_stochastic_quantize_breaks_no_graph_at_its_seed_and_draws_one_per_run():
    """Traced by torch.compile, ``quantize`` draws its rounding seed inside an operator when the
    graph runs: no graph break at the draw (once a ``Tensor.item`` of a generator's draw, then a
    generator made in the region), and each run rounds with a fresh seed from the generator."""
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))

    def codes(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return quantize(x * 2, 8, 256, generator=generator).codes

    for gen in (None, generator):
        explained = torch._dynamo.explain(codes)(x, gen)
        assert [b.reason for b in explained.break_reasons] == []
    compiled = torch.compile(codes, backend="eager")
    first, second = compiled(x, generator), compiled(x, generator)
    assert not torch.equal(first, second)  # a seed per run, not one baked into the trace
    torch._dynamo.reset()


def _room_nbytes(numel: int, group_size: int, dtype: torch.dtype) -> int:
    """Bytes of the side tables' fixed room (:func:`.reference.exact_slots` rows of a group's
    values, :func:`.reference.const_slots` values, an int64 index each) for ``numel`` elements."""
    groups = -(-numel // group_size)
    size = torch.empty((), dtype=dtype).element_size()
    exact, const = reference.exact_slots(groups), reference.const_slots(groups)
    return exact * (8 + group_size * size) + const * (8 + size)


@pytest.mark.parametrize("bits", BITS)
def test_a_traced_round_trip_compiles_as_one_graph_with_room_fixed_by_the_size(bits):
    """Traced by torch.compile with dynamo's default settings, ``quantize`` and ``dequantize`` are
    one graph (``fullgraph``: no break at the side tables, whose sizes once depended on the data):
    the side tables have room fixed by the tensor's size, counted in ``nbytes``, and the round trip
    decodes what eager decodes, NaN/Inf and constant groups included while they fit the room."""
    torch._dynamo.reset()
    x = torch.randn(4096 + 100, generator=torch.Generator().manual_seed(0))
    x[256:512], x[600], x[1024:1280] = 1e-30, float("nan"), float("inf")

    def round_trip(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        packed = quantize(x, bits, 256, stochastic=False)
        return dequantize(packed), packed.nbytes

    compiled = torch.compile(round_trip, backend="eager", fullgraph=True)
    got, nbytes = compiled(x)
    want, _ = round_trip(x)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan()[600]
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert nbytes == packed_nbytes(x.numel(), bits, 256) + _room_nbytes(x.numel(), 256, x.dtype)
    torch._dynamo.reset()


def test_a_traced_quantize_loses_to_nan_what_its_room_cannot_hold():
    """Past the room of the table of groups kept exactly, a compiled ``quantize`` decodes such a
    group as NaN (never as a wrong finite value), as the CUDA kernels do; the groups that fit
    decode exactly."""
    torch._dynamo.reset()
    x = torch.randn(2048)
    x[::256] = float("nan")  # 8 groups to keep exactly, room for 1
    round_trip = torch.compile(
        lambda x: dequantize(quantize(x, 8, 256, stochastic=False)), backend="eager", fullgraph=True
    )
    got = round_trip(x).view(8, 256)
    assert torch.equal(got[0].nan_to_num(), x[:256].nan_to_num())  # the first fits: exact
    assert got[1:].isnan().all()
    torch._dynamo.reset()
