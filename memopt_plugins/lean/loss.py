"""The loss head and the cross-entropy in chunks of tokens: the full logits are never alive.

``F.cross_entropy(F.linear(hidden, weight, bias), target)`` keeps the logits (tokens x vocabulary,
in fp32 for a Hugging Face model) for backward, and its backward holds three tensors of that size
at once: the peak of a language model's step. :func:`linear_cross_entropy` computes the same loss
chunk by chunk, so a chunk of logits and its gradient is the most it holds:

* a mean or a sum, in eager training: each chunk's logits give its losses and, at once, its share
  of the gradients of ``hidden``, ``weight`` and ``bias``, which the backward only scales by the
  loss's gradient (so a second backward through one loss is an error). Nothing is saved, and no
  head matmul is done twice.
* per-token losses (``reduction="none"``) and compiled graphs: the forward keeps only its inputs
  and one fp32 log-sum-exp per token; the backward recomputes each chunk's logits. ``hidden`` is
  saved as autograd saves any tensor, so memopt compresses it; the log-sum-exp is kept as it is
  (an error in it would bias every probability).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..buffers import private
from ..first_order import first_order

#: The integer type that holds a float's bits (how the log-sum-exp is kept).
_BITS_OF = {torch.float32: torch.int32, torch.float64: torch.int64}
#: Per chunk, logits about this many times the hidden size (Liger-Kernel's choice).
_CHUNK_TARGET = 1


def default_chunk_size(tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk so that a chunk's logits are about as large as the hidden states: a
    power of two, at least 1 and at most ``tokens``."""
    chunks = max(1, math.ceil(vocab / max(hidden, 1)) * _CHUNK_TARGET)
    size = 1 << max(0, math.ceil(math.log2(max(1, math.ceil(tokens / chunks)))))
    return max(1, min(size, tokens))


def chunk_losses(
    z: torch.Tensor, t: torch.Tensor, ignore_index: int, smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's losses per token (0 where ignored) and log-sum-exps, from its logits ``z``."""
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(1, t.clamp(0, z.shape[-1] - 1)[:, None])[:, 0]
    loss = lse - (1 - smoothing) * picked
    if smoothing:
        loss = loss - smoothing * z.mean(dim=-1)
    return torch.where(t != ignore_index, loss, 0.0), lse


def chunk_gradient(
    z: torch.Tensor,
    lse: torch.Tensor,
    t: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    smoothing: float,
) -> torch.Tensor:
    """The gradient of one chunk's losses (``scale``: the loss's gradient per token) with respect
    to its logits ``z``, written into ``z``."""
    vocab = z.shape[-1]
    g = z.sub_(lse[:, None]).exp_()  # the softmax, in the logits' memory
    picked = torch.full((len(t), 1), smoothing - 1, dtype=g.dtype, device=g.device)
    g.scatter_add_(1, t.clamp(0, vocab - 1)[:, None], picked)
    if smoothing:
        g -= smoothing / vocab
    g *= torch.where(t != ignore_index, scale, 0.0)[:, None]
    return g


@dataclass(frozen=True)
class LossOptions:
    """What the loss is, beside its tensors (as :func:`linear_cross_entropy` resolved it)."""

    ignore_index: int = -100
    smoothing: float = 0.0
    softcap: float | None = None
    chunk: int = 1

    def as_schema(self) -> tuple[int, float, float | None, int]:
        """In the order the compiled operators take them."""
        return (self.ignore_index, self.smoothing, self.softcap, self.chunk)


class _Inputs(NamedTuple):
    """The loss's tensors: ``(N, H)`` hidden states, ``(V, H)`` weight, bias, ``(N,)`` target."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    target: torch.Tensor


def _chunks(n: int, chunk: int):
    """The rows of each chunk."""
    return (slice(start, min(start + chunk, n)) for start in range(0, n, chunk))


def _buffer(inputs: _Inputs, options: LossOptions) -> torch.Tensor:
    """Every chunk's logits, in turn: one chunk's worth, in the work dtype."""
    n, vocab = inputs.hidden.shape[0], inputs.weight.shape[0]
    work = torch.promote_types(inputs.hidden.dtype, torch.float32)
    return inputs.hidden.new_empty((min(options.chunk, n), vocab), dtype=work)


def _logits(
    inputs: _Inputs,
    rows: slice,
    buffer: torch.Tensor,
    softcap: float | None,
    y: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunk's logits, written into ``buffer`` (and, with ``softcap``, ``tanh(y / cap)``
    for the chain rule); ``y``: the head's output for the chunk when it is already at hand."""
    h, weight, bias = inputs.hidden[rows], inputs.weight, inputs.bias
    z = buffer[: h.shape[0]]
    if y is not None or h.dtype != z.dtype:  # autocast's dtype: the matmul runs in it
        z.copy_(F.linear(h, weight, bias) if y is None else y)
    elif bias is None:
        torch.mm(h, weight.t(), out=z)
    else:
        torch.addmm(bias, h, weight.t(), out=z)
    if softcap is None:
        return z, None
    t = torch.tanh(z / softcap)
    return torch.mul(t, softcap, out=z), t


def _exp_shifted_(
    z: torch.Tensor, t: torch.Tensor, options: LossOptions
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's losses per token (0 where ignored), log-sum-exps and sums of
    ``exp(z - max)``, leaving ``exp(z - max)`` in ``z``: one exponential per logit."""
    peak = z.amax(dim=-1, keepdim=True)
    z.sub_(peak)
    picked = z.gather(1, t.clamp(0, z.shape[-1] - 1)[:, None])[:, 0]
    smoothed = z.mean(dim=-1) if options.smoothing else None
    total = z.exp_().sum(dim=-1)
    log_total = total.log()
    # the shift cancels: lse - z_t = log_total - (z_t - max)
    loss = log_total - (1 - options.smoothing) * picked
    if smoothed is not None:
        loss -= options.smoothing * smoothed
    losses = torch.where(t != options.ignore_index, loss, 0.0)
    return losses, log_total.add_(peak[:, 0]), total


def _softmax_gradient_(
    e: torch.Tensor, total: torch.Tensor, t: torch.Tensor, scale: torch.Tensor, options: LossOptions
) -> torch.Tensor:
    """:func:`chunk_gradient` from ``e = exp(z - max)`` and its sums ``total``, written into
    ``e``: the softmax and the scale in one pass."""
    vocab, smoothing = e.shape[-1], options.smoothing
    scale = torch.where(t != options.ignore_index, scale, 0.0)
    e.mul_((scale / total)[:, None])
    picked = ((smoothing - 1) * scale)[:, None]
    e.scatter_add_(1, t.clamp(0, vocab - 1)[:, None], picked)
    if smoothing:
        e.sub_((smoothing / vocab * scale)[:, None])
    return e


def _losses(
    inputs: _Inputs, options: LossOptions, logits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's loss (0 where ignored) and the bits of its log-sum-exp, chunk by chunk (the
    chunks of ``logits`` where given, else of the head's output)."""
    n = inputs.hidden.shape[0]
    buffer = _buffer(inputs, options)
    losses = torch.empty(n, dtype=buffer.dtype, device=buffer.device)
    lse = torch.empty(n, dtype=buffer.dtype, device=buffer.device)
    for rows in _chunks(n, options.chunk):
        y = logits[rows] if logits is not None else None
        z, _ = _logits(inputs, rows, buffer, options.softcap, y)
        losses[rows], lse[rows], _ = _exp_shifted_(z, inputs.target[rows], options)
    return losses, lse.view(_BITS_OF[buffer.dtype])


def _forward_kernel(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    smoothing: float,
    softcap: float | None,
    chunk: int,
    logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_losses` with the operator's schema (flat: an operator takes no dataclass)."""
    options = LossOptions(ignore_index, smoothing, softcap, chunk)
    return _losses(_Inputs(hidden, weight, bias, target), options, logits)


#: :func:`_losses` as one operator, for compiled graphs.
_forward_op = torch.library.custom_op(
    "memopt::linear_cross_entropy_forward", _forward_kernel, mutates_args=()
)


@_forward_op.register_fake
def _(hidden, weight, bias, target, ignore_index, smoothing, softcap, chunk, logits=None):
    work = torch.promote_types(hidden.dtype, torch.float32)
    n = hidden.shape[0]
    return hidden.new_empty(n, dtype=work), hidden.new_empty(n, dtype=_BITS_OF[work])


class _LinearCrossEntropy(torch.autograd.Function):
    """Compiled, both passes are one opaque operator each: traced chunk by chunk, the compiler's
    partitioner moved each chunk's logits matmul of the backward (which needs no gradient) into
    the forward and saved what follows it -- the whole logits again -- and saved the log-sum-exp
    as a float, which the graph's codec then compressed."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, options, divisor, logits):
        inputs = _Inputs(hidden, weight, bias, target)
        if torch.compiler.is_compiling():
            op = torch.ops.memopt.linear_cross_entropy_forward
            losses, lse_bits = op(*inputs, *options.as_schema(), logits)
        else:
            losses, lse_bits = _losses(inputs, options, logits)
        ctx.save_for_backward(*inputs)
        # Kept off the compression hooks: an error in it would scale every probability. As its
        # bits in an integer tensor, it is not compressed where a compiled graph saves it either.
        ctx.lse_bits = lse_bits
        ctx.args = (options, divisor)
        return losses if divisor is None else losses.sum() / divisor

    @staticmethod
    @first_order
    def backward(ctx, grad_out):
        inputs = _Inputs(*ctx.saved_tensors)
        options, divisor = ctx.args
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        work = torch.promote_types(inputs.hidden.dtype, torch.float32)
        # d loss / d loss_i: one per token ("none"), else the same for every token
        scale = grad_out if divisor is None else (grad_out / divisor).expand(inputs.target.shape)
        scale = scale.to(work)
        # the log-sum-exp stays integer bits in the graph: read as floats inside the operator
        if torch.compiler.is_compiling():
            op = torch.ops.memopt.linear_cross_entropy_backward
            grads = op(*inputs, ctx.lse_bits, scale, *options.as_schema(), want_w)
        else:
            grads = _gradients(inputs, ctx.lse_bits, scale, options, want_w, donate=True)
        grad_h, grad_w, grad_b = grads
        return (
            grad_h if want_h else None,
            grad_w.to(inputs.weight.dtype) if want_w else None,
            grad_b.to(inputs.bias.dtype) if want_b and inputs.bias is not None else None,
            *[None] * 4,
        )


def _gradient_buffers(inputs: _Inputs, want_w: bool, grad_h: torch.Tensor | None = None):
    """The gradients of ``hidden`` (``grad_h`` where given), ``weight`` (fp32, empty unless
    ``want_w``; unset: the first chunk sets it) and bias (fp32 zeros), before the chunks."""
    hidden, weight = inputs.hidden, inputs.weight
    work = torch.promote_types(hidden.dtype, torch.float32)
    grad_h = torch.empty_like(hidden) if grad_h is None else grad_h
    shape = weight.shape if want_w else (0,)
    # no chunk at all: nothing sets it, and it is the zero gradient
    make = torch.empty if hidden.shape[0] else torch.zeros
    grad_w = make(shape, dtype=work, device=weight.device)
    grad_b = torch.zeros(weight.shape[0], dtype=work, device=weight.device)
    return grad_h, grad_w, grad_b


def _gradients(
    inputs: _Inputs,
    lse_bits: torch.Tensor,
    scale: torch.Tensor,
    options: LossOptions,
    want_w: bool,
    donate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``hidden``, ``weight`` (fp32; empty unless ``want_w``) and the bias
    (fp32; zeros without one), chunk by chunk; ``scale`` is the loss's gradient per token. With
    ``donate``, a freshly decoded ``hidden`` (dead row by row) takes its own gradient."""
    hidden = inputs.hidden
    own = hidden if donate and private(hidden) else None
    grads = _gradient_buffers(inputs, want_w, own)
    buffer = _buffer(inputs, options)
    lse = lse_bits.view(buffer.dtype)
    for rows in _chunks(hidden.shape[0], options.chunk):
        z, t_cap = _logits(inputs, rows, buffer, options.softcap)
        args = (lse[rows], inputs.target[rows], scale[rows], options.ignore_index)
        g = chunk_gradient(z, *args, options.smoothing)
        _accumulate(g, t_cap, inputs, rows, grads)
    return grads


def _accumulate(
    g: torch.Tensor,
    t_cap: torch.Tensor | None,
    inputs: _Inputs,
    rows: slice,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """Add one chunk's share to the gradients (as :func:`_gradient_buffers` made them), from
    ``g``, its logits' gradient (before the softcap's chain rule)."""
    grad_h, grad_w, grad_b = grads
    h, weight = inputs.hidden[rows], inputs.weight
    if t_cap is not None:
        g *= t_cap.square_().neg_().add_(1)
    g = g.to(h.dtype)
    if grad_w.numel():  # before grad_h: it may overwrite ``h``; the first chunk sets it
        grad_w.addmm_(g.t().to(grad_w.dtype), h.to(grad_w.dtype), beta=int(rows.start > 0))
    torch.mm(g, weight, out=grad_h[rows])
    if inputs.bias is not None:
        grad_b += g.sum(0, dtype=grad_b.dtype)


def _losses_and_gradients(
    inputs: _Inputs,
    options: LossOptions,
    logits: torch.Tensor | None,
    divisor: int | torch.Tensor,
    want_w: bool,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each token's loss and the gradients of ``sum(losses) / divisor`` (as :func:`_gradients`
    returns them) in one pass over the chunks: the logits are made once, never recomputed."""
    n = inputs.hidden.shape[0]
    buffer = _buffer(inputs, options)
    scale = (torch.ones((), dtype=buffer.dtype, device=buffer.device) / divisor).expand(n)
    losses = torch.empty(n, dtype=buffer.dtype, device=buffer.device)
    grads = _gradient_buffers(inputs, want_w)
    for rows in _chunks(n, options.chunk):
        y = logits[rows] if logits is not None else None
        z, t_cap = _logits(inputs, rows, buffer, options.softcap, y)
        t = inputs.target[rows]
        losses[rows], _, total = _exp_shifted_(z, t, options)
        g = _softmax_gradient_(z, total, t, scale[rows], options)
        _accumulate(g, t_cap, inputs, rows, grads)
    return losses, grads


class _LinearCrossEntropyGradientsFirst(torch.autograd.Function):
    """The mean or sum loss, eager: its gradients are made in the forward from the logits it
    makes there, and backward only scales them by the loss's gradient. One head matmul fewer
    than recomputing them, and nothing is saved but the gradients, which the backward needs at
    its start anyway (the hidden states are not kept, so neither decoded). They are handed over
    once: a second backward through the same loss is an error."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, options, divisor, logits):
        want_w = ctx.needs_input_grad[1]
        inputs = _Inputs(hidden, weight, bias, target)
        losses, grads = _losses_and_gradients(inputs, options, logits, divisor, want_w)
        ctx.grads = grads  # not saved tensors: gradients are never compressed
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return losses.sum() / divisor

    @staticmethod
    @first_order
    def backward(ctx, grad_out):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError(
                "memopt's chunked loss made its gradients in the forward and handed them to the "
                "first backward; a second backward through the same loss (retain_graph=True) is "
                "not supported: compute the loss again"
            )
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h, grad_w, grad_b = (g.mul_(grad_out.to(g.dtype)) for g in grads)  # ours alone
        weight_dtype, bias_dtype = ctx.dtypes
        return (
            grad_h if want_h else None,
            grad_w.to(weight_dtype) if want_w else None,
            grad_b.to(bias_dtype) if want_b and bias_dtype is not None else None,
            *[None] * 4,
        )


def _backward_kernel(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    lse_bits: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    smoothing: float,
    softcap: float | None,
    chunk: int,
    want_w: bool,
    donate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_gradients` with the operator's schema (flat; compiled graphs never donate).
    The schema stays as it was: inductor's graph cache does not key on it, and a cached graph
    calls the operator with every argument of the schema it was compiled against."""
    options = LossOptions(ignore_index, smoothing, softcap, chunk)
    inputs = _Inputs(hidden, weight, bias, target)
    return _gradients(inputs, lse_bits, scale, options, want_w, donate)


#: :func:`_gradients` as one operator, for compiled graphs.
_backward_op = torch.library.custom_op(
    "memopt::linear_cross_entropy_backward", _backward_kernel, mutates_args=()
)


@_backward_op.register_fake
def _(
    hidden, weight, bias, target, lse_bits, scale, ignore_index, smoothing, softcap, chunk,
    want_w, donate=False,
):  # fmt: skip
    work = torch.promote_types(hidden.dtype, torch.float32)
    return (
        torch.empty_like(hidden),
        weight.new_empty(weight.shape if want_w else (0,), dtype=work),
        weight.new_empty(weight.shape[0], dtype=work),
    )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` without the logits.

    Args:
        hidden: ``(..., H)`` hidden states (any float dtype; the logits are fp32 inside).
        weight: ``(V, H)`` head weight (tied embeddings too); bias: ``(V,)`` or ``None``.
        target: ``(...)`` class indices, ``ignore_index`` where no loss is taken.
        reduction: ``"mean"`` (over the targets not ignored), ``"sum"`` or ``"none"``.
        label_smoothing: as ``F.cross_entropy``'s.
        softcap: logits become ``softcap * tanh(logits / softcap)`` first (Gemma-2's final
            logit softcapping).
        chunk_size: tokens per chunk (default: chunks of logits about the hidden states' size).
        num_items_in_batch: the sum is divided by this instead (Hugging Face's normalisation
            for gradient accumulation); with it, ``reduction`` is ignored.
        logits: ``F.linear(hidden, weight, bias)`` where it was computed already (the forward
            reads it instead of computing the head again; it is not kept, and no gradient
            flows through it).

    Under autocast the matmuls run in autocast's dtype, as ``F.linear`` would.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction: {reduction!r} is not 'mean', 'sum' or 'none'")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing: {label_smoothing!r} is outside [0, 1]")
    shape = target.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    if h.shape[0] != t.shape[0]:
        raise ValueError(f"hidden has {h.shape[0]} tokens, target {t.shape[0]}")
    device = h.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        h, weight = h.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    if logits is not None:
        logits = logits.detach().reshape(-1, weight.shape[0])
    chunk = chunk_size or default_chunk_size(h.shape[0], weight.shape[0], h.shape[-1])
    if num_items_in_batch is not None:
        divisor = num_items_in_batch
    elif reduction == "mean":
        divisor = (t != ignore_index).sum()
    elif reduction == "sum":
        divisor = 1
    else:
        divisor = None
    # a mean or sum in eager training makes its gradients in the forward (one matmul fewer)
    eager = torch.is_grad_enabled() and not torch.compiler.is_compiling()
    wanted = any(x is not None and x.requires_grad for x in (h, weight, bias))
    function = (
        _LinearCrossEntropyGradientsFirst
        if divisor is not None and eager and wanted
        else _LinearCrossEntropy
    )
    options = LossOptions(ignore_index, label_smoothing, softcap, chunk)
    with torch.autocast(device, enabled=False):
        out = function.apply(h, weight, bias, t, options, divisor, logits)
    return out.view(shape) if divisor is None else out
