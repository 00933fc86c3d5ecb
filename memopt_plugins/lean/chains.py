"""Activation and norm chains that save their inputs only.

Written as Python expressions (Hugging Face's ``LlamaMLP``: ``act(gate) * up``; ``LlamaRMSNorm``:
an fp32 upcast, a mean of squares, a reciprocal square root and two products), each op of a chain
saves its own operands for backward: several tensors of the layer's width, every one decoded in
backward with a gradient beside it. Each function here is one autograd node that saves its
inputs and recomputes the rest in backward, piece by piece (:data:`PIECE` elements), so that its
backward holds its inputs, their gradients and a piece's temporaries. Where an input comes back
from memopt's hooks as a freshly decoded buffer (:func:`~memopt_plugins.buffers.private`), its
gradient is written into it, piece by piece as each piece is read: the backward then holds the
inputs and nothing of their size beside them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..buffers import private
from ..derived import derive
from ..first_order import first_order

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _work(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or in fp64 when it is fp64: the precision the chains compute in."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


#: Elements per piece of a chain's backward: its temporaries are a piece's size, not the layer's.
PIECE = 1 << 20


def _pieces(rows: int, width: int = 1) -> list[slice]:
    """Slices of ``rows`` rows of ``width`` elements, about :data:`PIECE` elements each."""
    step = max(1, PIECE // max(width, 1))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _gelu_tanh(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tanh-GELU of ``x`` and its derivative, with at most four layer-wide temporaries (the
    backward's peak is what these ops are for)."""
    t = x.pow(3).mul_(0.044715).add_(x).mul_(_SQRT_2_OVER_PI).tanh_()
    value = t.add(1).mul_(x).mul_(0.5)
    slope = t.add(1).mul_(0.5)
    inner = x.square().mul_(3 * 0.044715).add_(1).mul_(_SQRT_2_OVER_PI)
    slope.add_(t.square_().neg_().add_(1).mul_(inner).mul_(x).mul_(0.5))
    return value, slope


def _silu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of ``x`` and its derivative ``s * (1 + x * (1 - s))``, three temporaries at most."""
    s = torch.sigmoid(x)
    value = x * s
    slope = torch.sub(1, s).mul_(x).add_(1).mul_(s)
    return value, slope


def _grad_buffer(saved: torch.Tensor) -> torch.Tensor:
    """Where the gradient of ``saved`` goes: into ``saved`` itself when nothing else holds it."""
    if private(saved):
        return saved
    return torch.empty_like(saved, memory_format=torch.contiguous_format)


def _graph_gradients(reference, inputs: tuple, needs: tuple, grad: torch.Tensor) -> tuple:
    """Where a backward builds a graph (``create_graph=True``: gradient penalties, Hessian-vector
    products), the gradients of ``reference(*inputs)``, the plain torch ops over the saved
    inputs: its higher derivatives are then torch's own, where the memory-lean backward keeps
    statistics as constants and writes in place. ``None`` where no gradient is wanted.

    The reference runs on fresh aliases of the inputs (``view_as``: one graph edge each back to
    the input), and the gradients are taken at those aliases: they are this node's partial
    derivatives only. Taken at the inputs themselves, an input that also made another (a weight
    shared by two calls of one module, the second call's input made from the first's output)
    would get the path through that other input too, and the first call's backward would run
    inside this one."""
    local = tuple(t.view_as(t) if isinstance(t, torch.Tensor) else t for t in inputs)
    wanted = [t for t, need in zip(local, needs, strict=True) if need and t is not None]
    grads = iter(torch.autograd.grad(reference(*local), wanted, grad, create_graph=True))
    return tuple(
        next(grads) if need and t is not None else None
        for t, need in zip(inputs, needs, strict=True)
    )


class _Gelu(torch.autograd.Function):
    """``F.gelu(x, approximate)`` saving ``x``; its gradient goes into a decoded ``x``."""

    @staticmethod
    def forward(ctx, x, approximate: str):
        ctx.save_for_backward(x)
        ctx.approximate = approximate
        return torch.nn.functional.gelu(x, approximate=approximate)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        if not private(x):
            return torch.ops.aten.gelu_backward(grad, x, approximate=ctx.approximate), None
        # elementwise, so each element is read before its gradient overwrites it
        torch.ops.aten.gelu_backward.grad_input(grad, x, approximate=ctx.approximate, grad_input=x)
        return x, None


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(x, approximate=approximate)`` as one node saving ``x`` (the same values and
    gradients; in backward the gradient takes a decoded ``x``'s memory)."""
    return _Gelu.apply(x, approximate)


class _GeluMlp(torch.autograd.Function):
    """``F.linear(F.gelu(F.linear(x, w_in, b_in), approximate), w_out, b_out)`` saving ``x`` and
    the weights: the widened tensor and its activation, each four times as wide as ``x`` in a
    GPT-2 MLP, are recomputed in backward (the up projection once more) instead of saved. The
    matmuls run in the output gradient's dtype (autocast's)."""

    @staticmethod
    def forward(ctx, x, w_in, b_in, w_out, b_out, approximate: str):
        ctx.save_for_backward(x, w_in, b_in, w_out)
        ctx.approximate = approximate
        ctx.out_bias_dtype = b_out.dtype if b_out is not None else None
        h = F.gelu(F.linear(x, w_in, b_in), approximate=approximate)
        return F.linear(h, w_out, b_out)

    @staticmethod
    def backward(ctx, grad):
        x, w_in, b_in, w_out = ctx.saved_tensors
        if torch.is_grad_enabled():
            # the output bias (not saved) only shifts the output: a zero one has its gradients
            b_out = None
            if ctx.needs_input_grad[4]:
                b_out = grad.new_zeros(w_out.shape[0], dtype=ctx.out_bias_dtype).requires_grad_()

            def mlp(x, w_in, b_in, w_out, b_out):
                h = F.gelu(F.linear(x, w_in, b_in), approximate=ctx.approximate)
                return F.linear(h, w_out, b_out)

            inputs = (x, w_in, b_in, w_out, b_out)
            return *_graph_gradients(mlp, inputs, ctx.needs_input_grad[:5], grad), None
        want_x, want_w_in, want_b_in, want_w_out, want_b_out = ctx.needs_input_grad[:5]
        dtype = grad.dtype
        g = grad.reshape(-1, grad.shape[-1])
        rows = x.reshape(-1, x.shape[-1]).to(dtype)
        bias = b_in.to(dtype) if b_in is not None else None
        h = F.linear(rows, w_in.to(dtype), bias)  # the up projection, again
        grads: list[torch.Tensor | None] = [None] * 6
        if want_w_out:
            grads[3] = (g.t() @ F.gelu(h, approximate=ctx.approximate)).to(w_out.dtype)
        if want_b_out:
            grads[4] = g.sum(0).to(ctx.out_bias_dtype)
        if want_x or want_w_in or want_b_in:
            grad_h = g @ w_out.to(dtype)
            # elementwise: each element of h is read before its gradient takes its place
            torch.ops.aten.gelu_backward.grad_input(
                grad_h, h, approximate=ctx.approximate, grad_input=h
            )
            if want_w_in:
                grads[1] = (h.t() @ rows).to(w_in.dtype)
            if want_b_in:
                grads[2] = h.sum(0).to(b_in.dtype)
            if want_x:
                grads[0] = (h @ w_in.to(dtype)).view(x.shape).to(x.dtype)
        return tuple(grads)


def gelu_mlp(
    x: torch.Tensor,
    w_in: torch.Tensor,
    b_in: torch.Tensor | None,
    w_out: torch.Tensor,
    b_out: torch.Tensor | None,
    approximate: str = "none",
) -> torch.Tensor:
    """A GPT-2 MLP, ``F.linear(F.gelu(F.linear(x, w_in, b_in), approximate), w_out, b_out)``, as
    one node saving ``x`` (and the weights): the same values and gradients, with the up
    projection done again in backward instead of its widened output and the GELU's kept."""
    return _GeluMlp.apply(x, w_in, b_in, w_out, b_out, approximate)


def _tiled_mlp_forward(
    x: torch.Tensor,
    w_in: torch.Tensor,
    b_in: torch.Tensor | None,
    w_out: torch.Tensor,
    b_out: torch.Tensor | None,
    approximate: str,
    chunk: int,
) -> torch.Tensor:
    """The GELU MLP of ``x``'s rows, ``chunk`` rows at a time."""
    rows = x.reshape(-1, x.shape[-1])
    out = rows.new_empty(rows.shape[0], w_out.shape[0])
    for start in range(0, rows.shape[0], chunk):
        part = slice(start, start + chunk)
        h = F.gelu(F.linear(rows[part], w_in, b_in), approximate=approximate)
        out[part] = F.linear(h, w_out, b_out)
    return out.view(*x.shape[:-1], w_out.shape[0])


def _tiled_mlp_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    w_in: torch.Tensor,
    b_in: torch.Tensor | None,
    w_out: torch.Tensor,
    approximate: str,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`_tiled_mlp_forward` (``x``, both weights, both biases; a bias
    that is ``None`` gets an empty one), ``chunk`` rows at a time: the up projection done again
    and its gradient in its place, the weights' gradients summed in place."""
    rows = x.reshape(-1, x.shape[-1])
    g_rows = grad.reshape(-1, grad.shape[-1])
    grad_x = torch.empty_like(rows)
    grad_w_in, grad_w_out = torch.zeros_like(w_in), torch.zeros_like(w_out)
    grad_b_in = torch.zeros_like(w_in[:, 0]) if b_in is not None else w_in.new_empty(0)
    grad_b_out = torch.zeros_like(w_out[:, 0])
    for start in range(0, rows.shape[0], chunk):
        part = slice(start, start + chunk)
        r, g = rows[part], g_rows[part]
        h = F.linear(r, w_in, b_in)
        grad_w_out.addmm_(g.t(), F.gelu(h, approximate=approximate))
        grad_b_out += g.sum(0)
        # elementwise: each element of h is read before its gradient takes its place
        torch.ops.aten.gelu_backward.grad_input(g @ w_out, h, approximate=approximate, grad_input=h)
        grad_w_in.addmm_(h.t(), r)
        if b_in is not None:
            grad_b_in += h.sum(0)
        torch.mm(h, w_in, out=grad_x[part])
    return grad_x.view(x.shape), grad_w_in, grad_b_in, grad_w_out, grad_b_out


_tiled_forward_op = torch.library.custom_op(
    "memopt::tiled_gelu_mlp_forward", _tiled_mlp_forward, mutates_args=()
)
_tiled_backward_op = torch.library.custom_op(
    "memopt::tiled_gelu_mlp_backward", _tiled_mlp_backward, mutates_args=()
)


@_tiled_forward_op.register_fake
def _(x, w_in, b_in, w_out, b_out, approximate, chunk):
    return x.new_empty(*x.shape[:-1], w_out.shape[0])


@_tiled_backward_op.register_fake
def _(grad, x, w_in, b_in, w_out, approximate, chunk):
    bias = w_in.new_empty(w_in.shape[0] if b_in is not None else 0)
    return (
        x.new_empty(x.shape), torch.empty_like(w_in), bias, torch.empty_like(w_out),
        w_out.new_empty(w_out.shape[0]),
    )  # fmt: skip


class _TiledGeluMlp(torch.autograd.Function):
    """:func:`tiled_gelu_mlp`: one operator each way, so that a compiled graph saves ``x`` alone
    and its backward holds one chunk's widened tensors. Traced chunk by chunk, inductor ran every
    chunk's matmuls before their gradients were summed, and held the whole widened tensor."""

    @staticmethod
    def forward(ctx, x, w_in, b_in, w_out, b_out, approximate: str, chunk: int):
        ctx.save_for_backward(x, w_in, b_in, w_out)
        ctx.args = (approximate, chunk, b_out is not None)
        return torch.ops.memopt.tiled_gelu_mlp_forward(
            x, w_in, b_in, w_out, b_out, approximate, chunk
        )

    @staticmethod
    @first_order
    def backward(ctx, grad):
        x, w_in, b_in, w_out = ctx.saved_tensors
        approximate, chunk, out_bias = ctx.args
        grads = torch.ops.memopt.tiled_gelu_mlp_backward(
            grad.contiguous(), x, w_in, b_in, w_out, approximate, chunk
        )
        grad_x, grad_w_in, grad_b_in, grad_w_out, grad_b_out = grads
        return (
            grad_x, grad_w_in, grad_b_in if b_in is not None else None, grad_w_out,
            grad_b_out if out_bias else None, None, None,
        )  # fmt: skip


def tiled_gelu_mlp(
    x: torch.Tensor,
    w_in: torch.Tensor,
    b_in: torch.Tensor | None,
    w_out: torch.Tensor,
    b_out: torch.Tensor | None,
    approximate: str,
    chunk: int,
) -> torch.Tensor:
    """:func:`gelu_mlp` over chunks of ``chunk`` tokens as one operator each way, for compiled
    graphs (weights and ``x`` in one dtype): the graph saves ``x``; the backward does each
    chunk's up projection again and sums the weights' gradients in place."""
    return _TiledGeluMlp.apply(x, w_in, b_in, w_out, b_out, approximate, chunk)


def _tiled_gated_forward(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    tanh_gelu: bool,
    chunk: int,
) -> torch.Tensor:
    """A bias-free gated MLP of ``x``'s rows, ``down(act(gate(x)) * up(x))``, ``chunk`` rows at
    a time (``act``: SiLU, or tanh-GELU)."""
    rows = x.reshape(-1, x.shape[-1])
    out = rows.new_empty(rows.shape[0], w_down.shape[0])
    for start in range(0, rows.shape[0], chunk):
        part = slice(start, start + chunk)
        r = rows[part]
        gate = r @ w_gate.t()
        h = F.gelu(gate, approximate="tanh") if tanh_gelu else F.silu(gate)
        torch.mm(h.mul_(r @ w_up.t()), w_down.t(), out=out[part])
    return out.view(*x.shape[:-1], w_down.shape[0])


def _tiled_gated_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    tanh_gelu: bool,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`_tiled_gated_forward` (``x`` and the three weights), ``chunk``
    rows at a time: each chunk's projections done again, the weights' gradients summed in
    place."""
    grad_x = torch.empty_like(x.reshape(-1, x.shape[-1]))
    sums = tuple(torch.zeros_like(w) for w in (w_gate, w_up, w_down))
    _gated_rows_backward(grad, x, (w_gate, w_up, w_down), tanh_gelu, chunk, grad_x, sums)
    return grad_x.view(x.shape), *sums


def _gated_rows_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    tanh_gelu: bool,
    chunk: int,
    grad_x: torch.Tensor,
    sums: tuple[torch.Tensor, ...],
) -> None:
    """A bias-free gated MLP's backward over ``chunk`` rows at a time, in the weights' dtype:
    each chunk's projections done again, ``x``'s gradient written into ``grad_x`` (rows of
    ``x``'s width; it may be ``x`` itself: a chunk's rows are read before its gradient is
    written) and the weights' gradients added into ``sums`` (gate, up, down)."""
    w_gate, w_up, w_down = weights
    sum_gate, sum_up, sum_down = sums
    rows = x.reshape(-1, x.shape[-1])
    g_rows = grad.reshape(-1, grad.shape[-1])
    act = _gelu_tanh if tanh_gelu else _silu
    for start in range(0, rows.shape[0], chunk):
        part = slice(start, start + chunk)
        r, g = rows[part].to(w_gate.dtype), g_rows[part].to(w_gate.dtype)
        up = r @ w_up.t()
        value, slope = act(r @ w_gate.t())
        _add_product(sum_down, g.t(), value * up)
        grad_h = g @ w_down
        grad_gate = slope.mul_(up).mul_(grad_h)  # up is read before its gradient takes it
        grad_up = up.copy_(value.mul_(grad_h))
        _add_product(sum_gate, grad_gate.t(), r)
        _add_product(sum_up, grad_up.t(), r)
        grad_r = torch.mm(grad_gate, w_gate).addmm_(grad_up, w_up)
        grad_x[part] = grad_r  # the chunk's rows of x were last read above


def _add_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b``, in place where the dtypes agree."""
    if total.dtype == a.dtype:
        total.addmm_(a, b)
    else:
        total.add_(a @ b)


_tiled_gated_forward_op = torch.library.custom_op(
    "memopt::tiled_gated_mlp_forward", _tiled_gated_forward, mutates_args=()
)
_tiled_gated_backward_op = torch.library.custom_op(
    "memopt::tiled_gated_mlp_backward", _tiled_gated_backward, mutates_args=()
)


@_tiled_gated_forward_op.register_fake
def _(x, w_gate, w_up, w_down, tanh_gelu, chunk):
    return x.new_empty(*x.shape[:-1], w_down.shape[0])


@_tiled_gated_backward_op.register_fake
def _(grad, x, w_gate, w_up, w_down, tanh_gelu, chunk):
    return (
        x.new_empty(x.shape), torch.empty_like(w_gate), torch.empty_like(w_up),
        torch.empty_like(w_down),
    )  # fmt: skip


class _TiledGatedMlp(torch.autograd.Function):
    """:func:`tiled_gated_mlp`: one operator each way (see :class:`_TiledGeluMlp`)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, tanh_gelu: bool, chunk: int):
        ctx.save_for_backward(x, w_gate, w_up, w_down)
        ctx.args = (tanh_gelu, chunk)
        return torch.ops.memopt.tiled_gated_mlp_forward(x, w_gate, w_up, w_down, tanh_gelu, chunk)

    @staticmethod
    @first_order
    def backward(ctx, grad):
        x, w_gate, w_up, w_down = ctx.saved_tensors
        grads = torch.ops.memopt.tiled_gated_mlp_backward(
            grad.contiguous(), x, w_gate, w_up, w_down, *ctx.args
        )
        return (*grads, None, None)


def tiled_gated_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    tanh_gelu: bool,
    chunk: int,
) -> torch.Tensor:
    """A bias-free gated MLP (Llama's SwiGLU; Gemma's tanh-GELU with ``tanh_gelu``) over chunks
    of ``chunk`` tokens as one operator each way, for compiled graphs (weights and ``x`` in one
    dtype): the graph saves ``x``; the backward does each chunk's projections again and sums the
    weights' gradients in place. Traced chunk by chunk, the graph saved every chunk's gate and up
    projections: the whole widened tensors."""
    return _TiledGatedMlp.apply(x, w_gate, w_up, w_down, tanh_gelu, chunk)


class _GatedMlp(torch.autograd.Function):
    """``F.linear(act(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)`` (bias-free; ``act``
    SiLU, or tanh-GELU) saving ``x`` and the weights only: the gate and up projections and their
    product, each as wide as the MLP, are made again in backward instead of saved. Both ways run
    over chunks of ``chunk`` rows, so one chunk's wide tensors exist at a time; the backward's
    matmuls run in the output gradient's dtype (autocast's)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, tanh_gelu: bool, chunk: int):
        ctx.save_for_backward(x, w_gate, w_up, w_down)
        ctx.tanh_gelu, ctx.chunk = tanh_gelu, chunk
        rows = x.reshape(-1, x.shape[-1])
        out = None
        for start in range(0, rows.shape[0], chunk):
            part = slice(start, start + chunk)
            h = _gated_product_of(F.linear(rows[part], w_gate), tanh_gelu)
            y = F.linear(h.mul_(F.linear(rows[part], w_up)), w_down)
            if out is None:  # the dtype autocast gave the first chunk
                out = y.new_empty(rows.shape[0], w_down.shape[0])
            out[part] = y
        return out.view(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, w_gate, w_up, w_down = ctx.saved_tensors
        needs = ctx.needs_input_grad[:4]
        if torch.is_grad_enabled():

            def mlp(x, w_gate, w_up, w_down):
                h = _gated_product_of(F.linear(x, w_gate), ctx.tanh_gelu)
                return F.linear(h * F.linear(x, w_up), w_down)

            inputs = (x, w_gate, w_up, w_down)
            return *_graph_gradients(mlp, inputs, needs, grad), None, None
        dtype = grad.dtype
        weights = tuple(w.to(dtype) for w in (w_gate, w_up, w_down))
        grad_x = _grad_buffer(x) if needs[0] else torch.empty_like(x)
        sums = tuple(torch.zeros(w.shape, dtype=_work(w).dtype, device=w.device) for w in weights)
        rows = grad_x.view(-1, x.shape[-1])
        _gated_rows_backward(grad, x, weights, ctx.tanh_gelu, ctx.chunk, rows, sums)
        own = (w_gate, w_up, w_down)
        grads = [grad_x.view(x.shape)] + [s.to(w.dtype) for s, w in zip(sums, own, strict=True)]
        return *(g if need else None for g, need in zip(grads, needs, strict=True)), None, None


def _gated_product_of(gate: torch.Tensor, tanh_gelu: bool) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") if tanh_gelu else F.silu(gate)


def gated_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    tanh_gelu: bool = False,
    chunk: int | None = None,
) -> torch.Tensor:
    """A bias-free gated MLP (Llama's SwiGLU; Gemma's tanh-GELU with ``tanh_gelu``),
    ``down(act(gate(x)) * up(x))``, as one node saving ``x`` (and the weights): the same values
    and gradients, with the projections done again in backward over chunks of ``chunk`` tokens
    (``None``: as many as ``x``'s width) instead of the widened tensors kept."""
    return _GatedMlp.apply(x, w_gate, w_up, w_down, tanh_gelu, chunk or x.shape[-1])


class _GatedProduct(torch.autograd.Function):
    """``act(gate) * up`` saving ``gate`` and ``up``."""

    @staticmethod
    def forward(ctx, gate, up, tanh_gelu: bool):
        ctx.save_for_backward(gate, up)
        ctx.tanh_gelu = tanh_gelu
        if tanh_gelu:  # in place: the activation's buffer becomes the product's
            return torch.nn.functional.gelu(gate, approximate="tanh").mul_(up)
        return torch.nn.functional.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        if torch.is_grad_enabled():

            def product(gate, up):
                if ctx.tanh_gelu:
                    return F.gelu(gate, approximate="tanh") * up
                return F.silu(gate) * up

            return *_graph_gradients(product, (gate, up), ctx.needs_input_grad[:2], grad), None
        act = _gelu_tanh if ctx.tanh_gelu else _silu
        grad_gate, grad_up = _grad_buffer(gate), _grad_buffer(up)
        flat = [t.reshape(-1) for t in (gate, up, grad, grad_gate, grad_up)]
        for part in _pieces(gate.numel()):
            gate_p, up_p, grad_p, grad_gate_p, grad_up_p = (t[part] for t in flat)
            value, slope = act(_work(gate_p))
            g = _work(grad_p)
            slope.mul_(_work(up_p)).mul_(g)  # up's piece is read before its gradient takes it
            grad_up_p.copy_(value.mul_(g))
            grad_gate_p.copy_(slope)
        return grad_gate, grad_up, None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` (Llama's MLP) as one node saving ``gate`` and ``up``."""
    return _GatedProduct.apply(gate, up, False)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.gelu(gate, approximate="tanh") * up`` (Gemma's MLP) as one node saving its inputs."""
    return _GatedProduct.apply(gate, up, True)


class _LayerNorm(torch.autograd.Function):
    """``F.layer_norm`` (PyTorch's kernels both ways) saving its input, weight and bias, with
    one mean and one inverse deviation per row kept as they are. Its output is marked as made
    again from the input (:func:`~memopt_plugins.derived.derive`), so a projection that saves
    it beside the compressed input adds no second copy."""

    @staticmethod
    def forward(ctx, x, shape: tuple[int, ...], weight, bias, eps: float):
        out, mean, rstd = torch.ops.aten.native_layer_norm(x, shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias)
        ctx.stats, ctx.shape = (mean, rstd), shape
        derive(out, x, lambda decoded: _layer_norm_from(decoded, mean, rstd, weight, bias))
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        mean, rstd = ctx.stats
        wanted = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2],
                  bias is not None and ctx.needs_input_grad[3]]  # fmt: skip
        grad_x, grad_w, grad_b = torch.ops.aten.native_layer_norm_backward(
            grad, x, ctx.shape, mean, rstd, weight, bias, wanted
        )
        return grad_x, None, grad_w, grad_b, None


def _layer_norm_from(x, mean, rstd, weight, bias) -> torch.Tensor:
    """A layer norm's output from its (decoded) input and the forward's statistics."""
    out = (_work(x) - mean).mul_(rstd)
    if weight is not None:
        out.mul_(weight)
    if bias is not None:
        out.add_(bias)
    return out.to(x.dtype)


def layer_norm(
    x: torch.Tensor,
    shape: tuple[int, ...],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.layer_norm(x, shape, weight, bias, eps)`` as one node saving ``x`` (and the weight
    and bias): the same values and gradients; a later save of its output by memopt's hooks is a
    recipe over ``x``'s compressed copy."""
    return _LayerNorm.apply(x, tuple(shape), weight, bias, eps)


class _RMSNorm(torch.autograd.Function):
    """Llama's RMSNorm saving its input and weight, with one inverse root mean square per row
    kept as it is. Its output is marked as made again from the input
    (:func:`~memopt_plugins.derived.derive`), so the projections that save it (attention's
    q/k/v, the MLP) add no second copy beside the compressed input."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        xf = _work(x)
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight)
        ctx.rstd = rstd  # one value per row, kept as it is: an error in it scales the row
        ctx.eps = eps
        out = _rms_norm_from(x, rstd, weight)
        derive(out, x, lambda decoded: _rms_norm_from(decoded, rstd, weight))
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        if torch.is_grad_enabled():

            def norm(x, weight):
                return _rms_norm_reference(x, weight, ctx.eps)

            return *_graph_gradients(norm, (x, weight), ctx.needs_input_grad[:2], grad), None
        width = x.shape[-1]
        rows = [x.reshape(-1, width), grad.reshape(-1, width), ctx.rstd.reshape(-1, 1)]
        grad_x = _grad_buffer(x).view(-1, width)
        grad_w = torch.zeros(width, dtype=_work(weight).dtype, device=weight.device)
        w = _work(weight)
        for part in _pieces(rows[0].shape[0], width):
            x_p, grad_p, rstd = (t[part] for t in rows)
            normed = _work(x_p) * rstd
            g = _work(grad_p)
            # the weight multiplied ``normed`` rounded to x's dtype in the forward
            grad_w += torch.mul(g, _work(normed.to(x.dtype))).sum(0)
            gn = g * w
            dot = (gn * normed).mean(-1, keepdim=True)
            grad_x[part] = gn.sub_(normed.mul_(dot)).mul_(rstd)
        return grad_x.view(x.shape), grad_w.to(weight.dtype), None


def _rms_norm_from(x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """An RMSNorm's output from its (decoded) input and the forward's statistics, by the
    forward's own ops: from the exact input, the forward's output bit for bit."""
    return weight * (_work(x) * rstd).to(x.dtype)


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`_RMSNorm`'s forward in plain torch ops."""
    xf = _work(x)
    return weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm (``weight * (x * rsqrt(mean(x^2) + eps))``, computed in fp32 and cast
    back before the weight) as one node saving ``x`` and ``weight``."""
    return _RMSNorm.apply(x, weight, eps)


#: A batch norm's backward reads its input in at least this many pieces along the batch, so that
#: its temporaries stay a fraction of the layer's size even below :data:`PIECE` elements.
BATCH_NORM_PIECES = 8


class _BatchNorm(torch.autograd.Function):
    """Training-mode batch norm (batch statistics) saving its input, the weight and one mean and
    one inverse deviation per channel. The forward is PyTorch's own kernel (outputs and running
    statistics bit for bit); the backward writes the input's gradient into a decoded input, where
    PyTorch's CPU kernel holds two input-sized buffers beside it (one it allocates and drops)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum: float, eps: float):
        out, mean, invstd = torch.ops.aten.native_batch_norm(
            x, weight, bias, running_mean, running_var, True, momentum, eps
        )
        ctx.save_for_backward(x, weight)
        ctx.stats = (mean, invstd)  # one value per channel, kept as they are
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        if torch.is_grad_enabled():
            # the bias (not saved) only shifts the output: a zero one has its gradients
            bias = None
            if ctx.needs_input_grad[2]:
                dtype = weight.dtype if weight is not None else x.dtype
                bias = x.new_zeros(x.shape[1], dtype=dtype).requires_grad_()

            def norm(x, weight, bias):
                return F.batch_norm(x, None, None, weight, bias, True, 0.0, ctx.eps)

            inputs, needs = (x, weight, bias), ctx.needs_input_grad[:3]
            return *_graph_gradients(norm, inputs, needs, grad), None, None, None, None
        mean, invstd = ctx.stats
        channels = x.shape[1]
        shape = [1, channels] + [1] * (x.dim() - 2)
        count = x.numel() // channels
        # Pieces of the batch bound the work-dtype temporaries (bfloat16 and float16 inputs);
        # in the work dtype itself nothing below is input-sized, so the tensor is one piece.
        step = max(1, min(PIECE // max(x[0].numel(), 1), -(-x.shape[0] // BATCH_NORM_PIECES)))
        if x.dtype == grad.dtype == mean.dtype:
            step = x.shape[0]
        parts = [slice(i, min(i + step, x.shape[0])) for i in range(0, x.shape[0], step)]
        # Per channel, the sums of the gradient and of the gradient times x-hat: PyTorch's own
        # kernel, one pass a piece (accumulated in fp32, or fp64 for fp64).
        sum_g = sum_gx = 0
        for part in parts:
            g, xs = grad[part], x[part]
            if g.dtype != xs.dtype:
                g, xs = _work(g), _work(xs)
            _, gx, gs = torch.ops.aten.native_batch_norm_backward(
                g, xs, None, None, None, mean, invstd, True, ctx.eps, [False, True, True]
            )
            sum_g, sum_gx = sum_g + gs, sum_gx + gx
        sum_g, sum_gx = sum_g.view(shape), sum_gx.view(shape)
        mean, invstd = mean.view(shape), invstd.view(shape)
        scale = invstd if weight is None else invstd * _work(weight).view(shape)
        grad_x = None
        if ctx.needs_input_grad[0]:
            # (g - mean(g) - x-hat * mean(g * x-hat)) * scale, x-hat from (x - mean) as the
            # forward's (no cancellation of x * c against mean * c): four passes a piece,
            # in place where the gradient takes the decoded x's memory in the work dtype.
            grad_x = x if private(x) else torch.empty_like(x)
            neg_coef = -(scale * invstd * (sum_gx / count))
            shift = scale * (sum_g / count)
            for part in parts:  # each piece of x is read before its gradient overwrites it
                out = grad_x[part]
                same = out.dtype == mean.dtype
                work = torch.sub(x[part], mean, out=out) if same else _work(x[part]) - mean
                work.mul_(neg_coef).addcmul_(_work(grad[part]), scale).sub_(shift)
                if not same:
                    out.copy_(work)
        grad_w = sum_gx.view(-1).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_b = sum_g.view(-1).to(weight.dtype) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None


def batch_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    momentum: float,
    eps: float,
) -> torch.Tensor:
    """``F.batch_norm(..., training=True)`` as one node saving ``x`` and ``weight`` (the same
    outputs and running statistics; in backward the input's gradient takes a decoded ``x``'s
    memory)."""
    return _BatchNorm.apply(x, weight, bias, running_mean, running_var, momentum, eps)
