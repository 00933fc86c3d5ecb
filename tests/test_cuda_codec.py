"""The codec's Triton kernels on a CUDA GPU: the torch reference's bytes, unbiased rounding.

At round-to-nearest the Triton kernels (``MEMOPT_CODEC=triton``) must write the codes, scales,
zero points, side tables and decoded values of the torch reference, within the side tables' fixed
room (:func:`bounded_mismatches`), and the reference the same bytes on the GPU and on the CPU:
8/4/2 bits, float32/bfloat16/float16, ragged sizes, odd group sizes, and groups that take every
special path (zeros, constants, NaN/Inf, subnormals, float16's limit). Skipped without CUDA
(``tests/test_triton.py`` runs the kernels in Triton's interpreter).
"""

from __future__ import annotations

import math

import pytest
import torch

from memopt_plugins.compress.codec import ops, pack_mask, reference, unpack_mask

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: (numel, group_size): ragged, the default group, and odd sizes whose bytes straddle groups.
CASES = ((1_000_003, 256), (40_000, 256), (12_345, 100), (3_001, 7), (9, 1))
FIELDS = "codes scale zero_point exact_index exact_values const_index const_values decoded"


def hard_values(numel: int, group_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values with zeros and, one group each, every special path of the codec (CPU)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g, dtype=torch.float64) * 3
    x[torch.randint(numel, (numel // 50 + 1,), generator=g)] = 0.0
    specials = [
        lambda v: v.fill_(0.5),  # constant, decoded exactly by its codes
        lambda v: v.fill_(1e-30),  # constant the codes cannot express: side table
        lambda v: v.__setitem__(0, math.nan),  # kept exactly
        lambda v: v.__setitem__(-1, math.inf),
        lambda v: v.abs_(),  # one-signed
        lambda v: v.abs_().neg_(),
        lambda v: v.sign_().mul_(6.0e4),  # float16's limit
        lambda v: v.fill_(1e-41),  # a float32 subnormal
        lambda v: v.fill_(-math.inf),
    ]
    for i, special in enumerate(specials):
        if (i + 1) * group_size <= numel:
            special(x[i * group_size : (i + 1) * group_size])
    return x.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bit pattern (NaN and signed zeros included), on the CPU."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.cpu().view(as_int), b.cpu().view(as_int))


def codec_outputs(x: torch.Tensor, bits: int, group_size: int) -> dict[str, torch.Tensor]:
    """The quantize operator's seven outputs at round-to-nearest, then the decoded values, by
    name (:data:`FIELDS`), on the CPU."""
    packed = ops.quantize(x, bits, group_size, None)
    decoded = ops.dequantize(*packed, bits, group_size, x.numel(), x.dtype)
    return {n: t.cpu() for n, t in zip(FIELDS.split(), (*packed, decoded), strict=True)}


def bounded_mismatches(kernel: dict, spec: dict, bits: int, group_size: int) -> list[str]:
    """How the Triton kernels' outputs (:func:`codec_outputs`) differ from the reference's
    beyond what their bounded side tables allow (:func:`.reference.bounded_tables`): the same
    codes and scales; the reference's first table entries in the room of a size fixed by the
    tensor's, the rest of it unused (index: the group count); the same zero points but the top
    code for the groups left out of the room, which decode to NaN; the reference's decoded bits
    everywhere else. Empty tables may be ``None``."""
    bad = [name for name in ("codes", "scale") if not same_bits(kernel[name], spec[name])]
    n_groups = spec["scale"].numel()
    lost = torch.zeros(n_groups, dtype=torch.bool)
    for name, slots in (
        ("exact", reference.exact_slots(n_groups)),
        ("const", reference.const_slots(n_groups)),
    ):
        index, want = kernel[f"{name}_index"], spec[f"{name}_index"]
        want = torch.empty(0, dtype=torch.int64) if want is None else want
        kept = min(slots, want.numel())
        if not (
            index.shape == (slots,)
            and torch.equal(index[:kept], want[:kept])
            and (index[kept:] == n_groups).all()
            and same_bits(kernel[f"{name}_values"][:kept], spec[f"{name}_values"][:kept])
        ):
            bad.append(f"{name} table")
        left = want[slots:]
        lost[left if name == "exact" else left[spec["scale"][left] == 0]] = True
    top = torch.full_like(spec["zero_point"], 2**bits - 1)
    if not same_bits(kernel["zero_point"], torch.where(lost, top, spec["zero_point"])):
        bad.append("zero_point")
    numel = spec["decoded"].numel()
    lost_elements = lost.repeat_interleave(group_size)[:numel]
    decoded, expected = kernel["decoded"], spec["decoded"]
    if not (
        decoded[lost_elements].isnan().all()
        and same_bits(decoded[~lost_elements], expected[~lost_elements])
    ):
        bad.append("decoded")
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_triton_bytes_equal_torch_on_gpu_and_cpu(monkeypatch, bits, dtype):
    mismatches = []
    for numel, group_size in CASES:
        x = hard_values(numel, group_size, dtype, seed=numel + bits)
        monkeypatch.setattr("memopt_plugins.compress.codec.ops.REQUESTED", "triton")
        kernel = codec_outputs(x.cuda(), bits, group_size)
        monkeypatch.setattr("memopt_plugins.compress.codec.ops.REQUESTED", "torch")
        here = codec_outputs(x.cuda(), bits, group_size)
        spec = codec_outputs(x, bits, group_size)
        for name in bounded_mismatches(kernel, here, bits, group_size):
            mismatches.append(f"{numel}/{group_size} {name}: Triton vs torch")
        for name in FIELDS.split():
            if not same_bits(here[name], spec[name]):
                mismatches.append(f"{numel}/{group_size} {name}: torch on cuda vs cpu")
    assert mismatches == []


def test_triton_stochastic_rounding_is_unbiased(monkeypatch):
    """The mean of 48 Triton 4-bit decodes (seeds 0-47) is within 0.3 step of every input."""
    g = torch.Generator().manual_seed(11)
    x = torch.rand(512, generator=g) * 2.95 + 0.05  # above the first level, which values below
    x[torch.rand(512, generator=g) < 0.5] *= -1  # it round up to; both groups span [-3, 3]
    x[0], x[1], x[256], x[257] = 3.0, -3.0, 3.0, -3.0
    x = x.cuda()
    monkeypatch.setattr("memopt_plugins.compress.codec.ops.REQUESTED", "triton")
    decodes = []
    for seed in range(48):
        packed = ops.quantize(x, 4, 256, seed)
        decodes.append(ops.dequantize(*packed, 4, 256, x.numel(), x.dtype).double())
    step = packed[1].double().repeat_interleave(256)
    errors = (torch.stack(decodes) - x.double()) / step
    bias = errors.mean(0)
    assert float(errors.abs().max()) < 1  # one draw is one of the two levels around the value
    assert float(bias.abs().max()) < 0.3
    assert float(bias.mean().abs()) < 0.015


def test_triton_mask_bits_equal_torch(monkeypatch):
    noise = torch.empty(10_007, device="cuda").bernoulli_(0.3)
    monkeypatch.setattr("memopt_plugins.compress.codec.ops.REQUESTED", "triton")
    packed = pack_mask(noise)
    unpacked = unpack_mask(packed, noise.shape, noise.dtype)
    monkeypatch.setattr("memopt_plugins.compress.codec.ops.REQUESTED", "torch")
    assert torch.equal(packed, pack_mask(noise))
    assert torch.equal(unpacked, noise)
