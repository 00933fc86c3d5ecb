"""The codec as PyTorch operators: ``memopt::quantize`` and ``memopt::dequantize``.

Operators (``torch.library.custom_op``) are what ``torch.compile`` can trace: each has a fake
implementation that states the shapes of its outputs, so a compiled graph can quantize a saved
activation in its forward and decode it in its backward. The real implementation is chosen per
call and device:

* CPU: the fused C kernels of :mod:`.native` where they are built (float32/bfloat16/float16), else
  the torch reference of :mod:`.reference`;
* any other device: the torch reference, until a kernel is registered for its device type in
  ``_QUANTIZE_KERNELS`` (the Triton kernels will be, for CUDA).

Eager code calls :func:`quantize` and :func:`dequantize` here, which pick the same
implementations without the operator dispatch (tens of microseconds a call, paid for every saved
tensor); compiled code calls the operators. Every implementation writes the same bytes at
round-to-nearest. Stochastic rounding draws its
noise from ``seed`` (an argument: nothing hidden in Python state inside the operator); ``seed``
``None`` rounds to nearest. Inputs are flat and contiguous; the sizes of the two side tables (the
groups kept exactly, the constant groups kept as one value) depend on the data.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import native, reference
from .reference import FIRST_LEVEL, Quantized


def _quantize_cpu(x: torch.Tensor, bits: int, group_size: int, seed: int | None) -> Quantized:
    if not native.supports(x.device, x.dtype):
        return reference.quantize(x, bits, group_size, seed)
    q = native.quantize(x, group_size, bits, FIRST_LEVEL[bits], seed)
    exact = q.exact if q.exact is not None and q.exact.any() else None
    const = q.const if q.const is not None and q.const.any() else None
    groups = reference.Groups.of(x, group_size) if exact is not None or const is not None else None
    tables = reference.side_tables(groups, exact, const, like=x, group_size=group_size)
    return (q.codes, q.scale, q.zero_point, *tables)


#: Quantize kernels by device type; the torch reference serves the others.
_QUANTIZE_KERNELS: dict[str, Callable[[torch.Tensor, int, int, int | None], Quantized]] = {
    "cpu": _quantize_cpu
}


def quantize(x: torch.Tensor, bits: int, group_size: int, seed: int | None) -> Quantized:
    """Codes, scale, zero point and side tables of flat contiguous ``x`` (see :mod:`.codec`)."""
    kernel = _QUANTIZE_KERNELS.get(x.device.type, reference.quantize)
    return kernel(x, bits, group_size, seed)


#: The operator compiled graphs call; the same function as :func:`quantize`.
quantize_op = torch.library.custom_op("memopt::quantize", quantize, mutates_args=())


@quantize_op.register_fake
def _quantize_fake(x: torch.Tensor, bits: int, group_size: int, seed: int | None) -> Quantized:
    groups = -(-x.numel() // group_size)
    ctx = torch.library.get_ctx()
    n_exact, n_const = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    index = {"dtype": torch.int64}
    return (
        x.new_empty(-(-groups * group_size * bits // 8), dtype=torch.uint8),
        x.new_empty(groups, dtype=torch.bfloat16),
        x.new_empty(groups, dtype=torch.uint8),
        x.new_empty(n_exact, **index),
        x.new_empty(n_exact, group_size),
        x.new_empty(n_const, **index),
        x.new_empty(n_const),
    )


def dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    exact_index: torch.Tensor | None,
    exact_values: torch.Tensor | None,
    const_index: torch.Tensor | None,
    const_values: torch.Tensor | None,
    bits: int,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The ``numel`` values (flat, contiguous, ``dtype``) that :func:`quantize` encoded."""
    if native.supports(codes.device, dtype):
        out = native.decode(codes, bits, FIRST_LEVEL[bits], group_size, scale, zero_point, dtype)
    else:
        out = reference.decode(codes, scale, zero_point, bits, group_size, dtype)
    if const_index is not None:
        out[const_index] = const_values[:, None]
    if exact_index is not None:
        out[exact_index] = exact_values
    out = out.view(-1)
    return out if out.numel() == numel else out[:numel].clone()


#: The operator compiled graphs call; the same function as :func:`dequantize`.
dequantize_op = torch.library.custom_op("memopt::dequantize", dequantize, mutates_args=())


@dequantize_op.register_fake
def _dequantize_fake(codes: torch.Tensor, *tables_and_settings: object) -> torch.Tensor:
    *_, numel, dtype = tables_and_settings  # the last two arguments
    return codes.new_empty(numel, dtype=dtype)
