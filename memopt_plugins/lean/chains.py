"""Activation and norm chains that save their inputs only.

Written as Python expressions (Hugging Face's ``LlamaMLP``: ``act(gate) * up``; ``LlamaRMSNorm``:
an fp32 upcast, a mean of squares, a reciprocal square root and two products), each op of a chain
saves its own operands for backward: several tensors of the layer's width, every one decoded in
backward with a gradient beside it. Each function here is one autograd node that saves its
inputs and recomputes the rest in backward.
"""

from __future__ import annotations

import math

import torch

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _work(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or in fp64 when it is fp64: the precision the chains compute in."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _gelu_tanh(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tanh-GELU of fp32 ``x`` and its derivative."""
    inner = _SQRT_2_OVER_PI * (x + 0.044715 * x.pow(3))
    t = torch.tanh(inner)
    value = 0.5 * x * (1 + t)
    slope = 0.5 * (1 + t) + 0.5 * x * (1 - t.square()) * _SQRT_2_OVER_PI * (
        1 + 3 * 0.044715 * x.square()
    )
    return value, slope


def _silu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.sigmoid(x)
    return x * s, s * (1 + x * (1 - s))


class _GatedProduct(torch.autograd.Function):
    """``act(gate) * up`` saving ``gate`` and ``up``."""

    @staticmethod
    def forward(ctx, gate, up, tanh_gelu: bool):
        ctx.save_for_backward(gate, up)
        ctx.tanh_gelu = tanh_gelu
        if tanh_gelu:
            return torch.nn.functional.gelu(gate, approximate="tanh") * up
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        value, slope = (_gelu_tanh if ctx.tanh_gelu else _silu)(_work(gate))
        g = _work(grad)
        grad_gate = (g * _work(up) * slope).to(gate.dtype)
        grad_up = (g * value).to(up.dtype)
        return grad_gate, grad_up, None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` (Llama's MLP) as one node saving ``gate`` and ``up``."""
    return _GatedProduct.apply(gate, up, False)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.gelu(gate, approximate="tanh") * up`` (Gemma's MLP) as one node saving its inputs."""
    return _GatedProduct.apply(gate, up, True)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        xf = _work(x)
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        normed = (xf * rstd).to(x.dtype)
        ctx.save_for_backward(x, weight)
        ctx.rstd = rstd  # one value per row, kept as it is: an error in it scales the row
        return weight * normed

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        rstd = ctx.rstd
        normed = _work(x) * rstd
        g = _work(grad)
        grad_w = (g * _work(normed.to(x.dtype))).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        gn = g * _work(weight)
        grad_x = rstd * (gn - normed * (gn * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm (``weight * (x * rsqrt(mean(x^2) + eps))``, computed in fp32 and cast
    back before the weight) as one node saving ``x`` and ``weight``."""
    return _RMSNorm.apply(x, weight, eps)
