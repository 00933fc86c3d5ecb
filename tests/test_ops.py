"""The codec's PyTorch operators: schema, fake (meta) implementations, traceable by compile."""

from __future__ import annotations

import pytest
import torch

from memopt_plugins.compress.codec import dequantize, quantize
from memopt_plugins.compress.ops import dequantize_op, quantize_op

NUMEL = 1000  # three whole groups of 256 and a partial one


def _input(dtype: torch.dtype, special: bool) -> torch.Tensor:
    x = torch.randn(NUMEL).to(dtype)
    if special:  # a group kept exactly (Inf; NaN would not compare equal) and a constant one the
        x[10] = float("inf")  # codes cannot express
        x[256:512] = 1e-30 if dtype != torch.bfloat16 else 1e-38
    return x


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_and_dequantize_pass_opcheck(bits, dtype, special):
    x = _input(dtype, special)
    for seed in (None, 7):
        torch.library.opcheck(quantize_op, (x, bits, 256, seed))
    packed = quantize_op(x, bits, 256, None)
    torch.library.opcheck(dequantize_op, (*packed, bits, 256, NUMEL, dtype))


def test_the_seed_is_the_only_source_of_rounding_noise():
    x = torch.randn(NUMEL)
    a, b = quantize_op(x, 4, 256, 11), quantize_op(x, 4, 256, 11)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    other = quantize_op(x, 4, 256, 12)
    assert not torch.equal(a[0], other[0])


@pytest.mark.parametrize("special", [False, True])
def test_a_compiled_round_trip_equals_the_eager_one(special):
    x = _input(torch.float32, special)

    def round_trip(t: torch.Tensor) -> torch.Tensor:
        return dequantize_op(*quantize_op(t, 8, 256, None), 8, 256, t.numel(), t.dtype)

    compiled = torch.compile(round_trip, fullgraph=True, backend="inductor")
    eager = dequantize(quantize(x, 8, group_size=256, stochastic=False))
    assert torch.equal(compiled(x), eager)
