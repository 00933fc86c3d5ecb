"""A CNN's convolutions, ReLUs and max-pools with backwards that hold less beside their inputs.

PyTorch's CPU convolution backward allocates the input's gradient plus, inside the kernel, an
input-sized workspace and an input-sized contiguous copy; its ReLU backward allocates a new
gradient beside the saved output; its max-pool backward decodes the whole saved input only to
read its shape. Each op here is one autograd node with PyTorch's own forward (the same outputs
bit for bit) and a backward that holds less:

* :func:`conv` runs PyTorch's convolution backward in pieces along the batch and writes the input's
  gradient into a freshly decoded input (:func:`~memopt_plugins.buffers.private`), piece by piece;
  a leaf batch that needs no gradient is kept as it is (its caller holds it anyway);
* :func:`relu` writes its gradient into its decoded output (saved, as PyTorch saves it: the next
  layer saves the same tensor, so memopt's hooks pack it once);
* :func:`max_pool` saves only where each output's argmax sits in its window, in as few bits as the
  window needs, and scatters the gradient through it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..buffers import private
from ..compress.hooks import compact_copy
from ..packing import pack_bits, unpack_bits
from .chains import BATCH_NORM_PIECES, PIECE, _work


def _batch_pieces(x: torch.Tensor) -> list[slice]:
    """Slices of the batch (dim 0): at least :data:`BATCH_NORM_PIECES` of them, at most
    :data:`PIECE` elements each (one sample at least)."""
    n = x.shape[0]
    per_sample = max(1, x[:1].numel())
    step = max(1, min(PIECE // per_sample, -(-n // BATCH_NORM_PIECES)))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


class _Conv(torch.autograd.Function):
    """``F.conv{1,2,3}d`` saving its input and weight; its backward runs in pieces of the batch."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups: int):
        ctx.batch = None
        if x.grad_fn is None and not x.requires_grad and not torch.compiler.is_compiling():
            # The batch passed in (a leaf that needs no gradient): whoever passed it holds it
            # through the step, so a compressed copy would only add memory (and the first
            # layer's weight gradient stays exact). Kept as it is, not through the hooks.
            ctx.batch, ctx.version = x, x._version
            ctx.save_for_backward(weight)
        else:
            ctx.save_for_backward(x, weight)
        ctx.args = (stride, padding, dilation, groups)
        ctx.has_bias = bias is not None
        return _CONV[x.dim() - 2](x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, grad):
        if ctx.batch is None:
            x, weight = ctx.saved_tensors
        else:
            x, (weight,) = ctx.batch, ctx.saved_tensors
            if x._version != ctx.version:
                raise RuntimeError(
                    "memopt: the input of a lean convolution was modified in place between its "
                    "forward and backward"
                )
        stride, padding, dilation, groups = ctx.args
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = None
        if need_x:
            grad_x = x if private(x) else torch.empty_like(x)
        grad_w = torch.zeros_like(weight, dtype=_work(weight).dtype) if need_w else None
        zeros = [0] * (x.dim() - 2)
        if need_x or need_w:
            for part in _batch_pieces(x):
                gx, gw, _ = torch.ops.aten.convolution_backward(
                    grad[part], x[part], weight, None, stride, padding, dilation, False, zeros,
                    groups, [need_x, need_w, False],
                )  # fmt: skip
                if need_w:
                    grad_w += gw
                if need_x:  # this piece of x was read (for gw) before its gradient takes it
                    grad_x[part] = gx
        grad_b = None
        if need_b:
            grad_b = grad.sum([0, *range(2, grad.dim())], dtype=_work(grad).dtype)
            grad_b = grad_b.to(grad.dtype)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


def conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """``F.conv{1,2,3}d(x, weight, bias, stride, padding, dilation, groups)`` (zero padding given
    as numbers) as one node saving ``x`` and ``weight``: the same outputs; gradients within
    float rounding (the weight's is summed over pieces of the batch)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        # As autocast would: the lower-precision casts are autograd ops of their own, outside.
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(device, enabled=False):
            return _Conv.apply(x, weight, bias, stride, padding, dilation, groups)
    return _Conv.apply(x, weight, bias, stride, padding, dilation, groups)


class _ReLU(torch.autograd.Function):
    """``torch.relu`` (or ``relu_``) saving its output; its gradient goes into a decoded one.

    Where memopt's hooks compress the output, the compressed copy is held in ``ctx.box`` instead
    of autograd's saved variables, so that a lean max-pool reading this output (which saves no
    input of its own) can swap it for a 1-bit mask of ``output > 0``: all the backward needs.
    """

    @staticmethod
    def forward(ctx, x, inplace: bool):
        if inplace:
            y = x.relu_()
            ctx.mark_dirty(x)
        else:
            y = torch.relu(x)
        ctx.box, ctx.mask = compact_copy(y), None
        if ctx.box is None:
            ctx.save_for_backward(y)
        else:
            ctx.output, ctx.version = weakref.ref(y), y._version
        return y

    @staticmethod
    def backward(ctx, grad):
        if ctx.mask is not None:
            positive = unpack_bits(ctx.mask, 1, grad.numel()).view(grad.shape).bool()
            ctx.mask = None
            return torch.where(positive, grad, 0), None
        if ctx.box is not None:
            payload, unpack = ctx.box
            ctx.box = None
            y = unpack(payload)
        else:
            (y,) = ctx.saved_tensors
        if not private(y):
            return torch.ops.aten.threshold_backward(grad, y, 0), None
        # elementwise, so each element is read before its gradient overwrites it
        torch.ops.aten.threshold_backward.grad_input(grad, y, 0, grad_input=y)
        return y, None


def _relu_mask(x: torch.Tensor) -> None:
    """``x`` is read by a lean max-pool: if a lean ReLU made it and holds it compressed, give
    that ReLU a 1-bit mask of ``x > 0`` instead (exact, and 1/32 of ``x``'s fp32 bytes)."""
    if torch.compiler.is_compiling():
        return
    node = x.grad_fn
    if type(node) is not _ReLU._backward_cls or getattr(node, "box", None) is None:
        return
    if node.output() is not x or x._version != node.version:
        return
    node.mask = pack_bits((x > 0).view(-1), 1)
    node.box = None


def relu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``F.relu(x, inplace)`` as one node saving its output (the same values and gradients; in
    backward the gradient takes a decoded output's memory)."""
    return _ReLU.apply(x, inplace)


def _tuple(value: Sequence[int] | int, dims: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, Sequence) else (value,) * dims


class _Window:
    """Where in its pooling window each output's argmax sits: a code below ``kernel``'s size,
    stored in :func:`~memopt_plugins.packing.pack_bits`' 1-8 bits instead of a flat
    int64 index (the hooks would narrow that to int16 at best: 4x the bytes of 4-bit codes)."""

    def __init__(self, x: torch.Tensor, out: torch.Tensor, kernel, stride, padding, dilation):
        dims = x.dim() - 2
        self.kernel, self.stride = _tuple(kernel, dims), _tuple(stride, dims)
        self.padding, self.dilation = _tuple(padding, dims), _tuple(dilation, dims)
        self.sizes, self.out_shape = tuple(x.shape[2:]), out.shape
        size = math.prod(self.kernel)
        self.bits = next((b for b in (1, 2, 4, 8) if size <= 1 << b), None)
        # A code's flat offset from its window's first position (innermost dim fastest), and
        # each window's first flat position: index = start + offsets[code], no division.
        plane = [math.prod(self.sizes[d + 1 :]) for d in range(dims)]
        offsets = torch.zeros((), dtype=torch.int64, device=x.device)
        starts = torch.zeros((), dtype=torch.int64, device=x.device)
        for d in range(dims):
            step = torch.arange(self.kernel[d], device=x.device) * self.dilation[d] * plane[d]
            offsets = (offsets.unsqueeze(-1) + step).reshape(-1)
            starts = starts.unsqueeze(-1) + self._starts(d, x.device).reshape(-1) * plane[d]
        self.offsets = offsets.reshape(-1)
        self.first = starts.reshape(out.shape[2:])
        # Offsets are distinct where no window reaches past a row of an inner dim: then a
        # position's code is read off a table of offsets (else by division, dim by dim).
        unique = all(
            (self.kernel[d] - 1) * self.dilation[d] < self.sizes[d] for d in range(1, dims)
        )
        self.code_of = None
        if unique and self.bits is not None:
            # the last code's offset is the largest: computed, never read from the device
            reach = sum((self.kernel[d] - 1) * self.dilation[d] * plane[d] for d in range(dims))
            self.code_of = torch.zeros(reach + 1, dtype=torch.uint8, device=x.device)
            self.code_of[offsets] = torch.arange(size, device=x.device).to(torch.uint8)

    def _starts(self, d: int, device: torch.device) -> torch.Tensor:
        """The first input position of each output's window along spatial dim ``d``."""
        dims = len(self.kernel)
        shape = [1] * (dims + 2)
        shape[d + 2] = -1
        start = torch.arange(self.out_shape[d + 2], device=device) * self.stride[d]
        return (start - self.padding[d]).view(shape)

    def encode(self, indices: torch.Tensor) -> torch.Tensor:
        codes = torch.empty(indices.shape, dtype=torch.uint8, device=indices.device)
        for part in _batch_pieces(indices):
            if self.code_of is not None:
                codes[part] = torch.take(self.code_of, indices[part] - self.first)
                continue
            rest, code, scale = indices[part], torch.zeros_like(indices[part]), 1
            for d in reversed(range(len(self.kernel))):
                where = rest % self.sizes[d]
                rest = rest // self.sizes[d]
                offset = (where - self._starts(d, indices.device)) // self.dilation[d]
                code += offset * scale
                scale *= self.kernel[d]
            codes[part] = code
        return pack_bits(codes.view(-1), self.bits)

    def decode(self, packed: torch.Tensor, part: slice) -> torch.Tensor:
        """The flat input indices of the outputs of batch slice ``part``."""
        per_sample = math.prod(self.out_shape[1:])
        first, count = (part.start or 0) * per_sample, (part.stop - (part.start or 0)) * per_sample
        per_byte = 8 // self.bits
        skip = first // per_byte  # pieces start at whole samples: byte-aligned when even
        codes = unpack_bits(packed[skip:], self.bits, first - skip * per_byte + count)
        codes = codes[first - skip * per_byte :].view(-1, *self.out_shape[1:]).long()
        return torch.take(self.offsets, codes) + self.first


class _MaxPool(torch.autograd.Function):
    """``F.max_pool{1,2,3}d(..., return_indices=True)`` saving where each argmax sits in its
    window (:class:`_Window`) and the input's shape."""

    @staticmethod
    def forward(ctx, x, kernel_size, stride, padding, dilation, ceil_mode: bool):
        _relu_mask(x)
        pool = getattr(F, f"max_pool{x.dim() - 2}d")
        out, indices = pool(x, kernel_size, stride, padding, dilation, ceil_mode, True)
        window = _Window(x, out, kernel_size, stride, padding, dilation)
        ctx.save_for_backward(indices if window.bits is None else window.encode(indices))
        ctx.window = window
        ctx.shape, ctx.memory_format = x.shape, _memory_format(x)
        ctx.mark_non_differentiable(indices)
        return out, indices

    @staticmethod
    def backward(ctx, grad, _):
        (saved,) = ctx.saved_tensors
        window = ctx.window
        n, c = ctx.shape[:2]
        grad_x = grad.new_zeros(ctx.shape)
        for part in _batch_pieces(grad):
            # flat positions in each (sample, channel) plane of the input
            index = saved[part] if window.bits is None else window.decode(saved, part)
            rows = index.shape[0]
            grad_x[part].view(rows, c, -1).scatter_add_(
                2, index.reshape(rows, c, -1), grad[part].reshape(rows, c, -1)
            )
        return grad_x.contiguous(memory_format=ctx.memory_format), None, None, None, None, None


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    channels_last = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)
    if channels_last and not x.is_contiguous():
        return torch.channels_last
    return torch.contiguous_format


def max_pool(
    x: torch.Tensor,
    kernel_size: Sequence[int] | int,
    stride: Sequence[int] | int | None = None,
    padding: Sequence[int] | int = 0,
    dilation: Sequence[int] | int = 1,
    ceil_mode: bool = False,
    return_indices: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``F.max_pool{1,2,3}d`` (input with batch and channel dims) as one node saving only the
    argmax indices: the same outputs; the gradient scattered through the indices."""
    stride = kernel_size if stride is None or stride == [] else stride
    out, indices = _MaxPool.apply(x, kernel_size, stride, padding, dilation, ceil_mode)
    return (out, indices) if return_indices else out
