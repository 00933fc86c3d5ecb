"""The codec's Triton kernels on a CUDA GPU: the torch reference's bytes, unbiased rounding.

At round-to-nearest the Triton kernels (``MEMOPT_CODEC=triton``) must write the codes, scales,
zero points, side tables and decoded values of the torch reference, on the same GPU and on the
CPU (the specification): 8/4/2 bits, float32/bfloat16/float16, ragged sizes, odd group sizes,
and groups that take every special path (zeros, constants, NaN/Inf, subnormals, float16's
limit). Skipped without CUDA (``tests/test_triton.py`` runs the kernels in Triton's interpreter).
"""

from __future__ import annotations

import math

import pytest
import torch

from memopt_plugins.compress.codec import ops, pack_mask, unpack_mask

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


def codec_outputs(x: torch.Tensor, bits: int, group_size: int) -> list[torch.Tensor]:
    """The quantize operator's seven outputs at round-to-nearest, then the decoded values."""
    packed = ops.quantize(x, bits, group_size, None)
    return [*packed, ops.dequantize(*packed, bits, group_size, x.numel(), x.dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_triton_bytes_equal_torch_on_gpu_and_cpu(monkeypatch, bits, dtype):
    mismatches = []
    for numel, group_size in CASES:
        x = hard_values(numel, group_size, dtype, seed=numel + bits)
        monkeypatch.setenv("MEMOPT_CODEC", "triton")
        kernel = codec_outputs(x.cuda(), bits, group_size)
        monkeypatch.setenv("MEMOPT_CODEC", "torch")
        here = codec_outputs(x.cuda(), bits, group_size)
        spec = codec_outputs(x, bits, group_size)
        for name, k, h, s in zip(FIELDS.split(), kernel, here, spec, strict=True):
            if not same_bits(k, h):
                mismatches.append(f"{numel}/{group_size} {name}: Triton vs torch")
            if not same_bits(h, s):
                mismatches.append(f"{numel}/{group_size} {name}: torch on cuda vs cpu")
    assert mismatches == []


def test_triton_stochastic_rounding_is_unbiased(monkeypatch):
    """The mean of 48 Triton 4-bit decodes (seeds 0-47) is within 0.3 step of every input."""
    g = torch.Generator().manual_seed(11)
    x = torch.rand(512, generator=g) * 2.95 + 0.05  # above the first level, which values below
    x[torch.rand(512, generator=g) < 0.5] *= -1  # it round up to; both groups span [-3, 3]
    x[0], x[1], x[256], x[257] = 3.0, -3.0, 3.0, -3.0
    x = x.cuda()
    monkeypatch.setenv("MEMOPT_CODEC", "triton")
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
    monkeypatch.setenv("MEMOPT_CODEC", "triton")
    packed = pack_mask(noise)
    unpacked = unpack_mask(packed, noise.shape, noise.dtype)
    monkeypatch.setenv("MEMOPT_CODEC", "torch")
    assert torch.equal(packed, pack_mask(noise))
    assert torch.equal(unpacked, noise)
