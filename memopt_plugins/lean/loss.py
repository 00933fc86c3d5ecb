"""The loss head and the cross-entropy in chunks of tokens: the full logits are never alive.

``F.cross_entropy(F.linear(hidden, weight, bias), target)`` keeps the logits (tokens x vocabulary,
in fp32 for a Hugging Face model) for backward, and its backward holds three tensors of that size
at once (the saved log-softmax, its gradient, the logits' gradient): the peak of a language
model's step. :func:`linear_cross_entropy` computes the same loss chunk by chunk, keeping only
its inputs and one fp32 log-sum-exp per token; its backward recomputes each chunk's logits (one
more head matmul) and turns them into the gradients of ``hidden``, ``weight`` and ``bias`` at
once, so a chunk of logits and its gradient is the most it holds. ``hidden`` is saved as autograd
saves any tensor, so memopt's compression hooks compress it like the rest; the log-sum-exp is
kept as it is (an error in it would bias every probability).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..buffers import private

#: Per chunk, logits about this many times the hidden size (Liger-Kernel's choice).
_CHUNK_TARGET = 1


def default_chunk_size(tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk so that a chunk's logits are about as large as the hidden states: a
    power of two, at least 1 and at most ``tokens``."""
    chunks = max(1, math.ceil(vocab / max(hidden, 1)) * _CHUNK_TARGET)
    size = 1 << max(0, math.ceil(math.log2(max(1, math.ceil(tokens / chunks)))))
    return max(1, min(size, tokens))


def _logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None
):
    """The chunk's logits in fp32 (and, with ``softcap``, ``tanh(y / cap)`` for the chain rule)."""
    y = F.linear(h, weight, bias)
    y = y.to(torch.promote_types(y.dtype, torch.float32))
    if softcap is None:
        return y, None
    t = torch.tanh(y / softcap)
    return softcap * t, t


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, bias, target, ignore_index, smoothing, softcap, chunk, divisor
    ):
        n, vocab = hidden.shape[0], weight.shape[0]
        work = torch.promote_types(hidden.dtype, torch.float32)
        losses = torch.empty(n, dtype=work, device=hidden.device)
        lse = torch.empty(n, dtype=work, device=hidden.device)
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            z, _ = _logits(hidden[rows], weight, bias, softcap)
            lse[rows] = torch.logsumexp(z, dim=-1)
            t = target[rows]
            valid = t != ignore_index
            picked = z.gather(1, t.clamp(0, vocab - 1)[:, None])[:, 0]
            loss = lse[rows] - (1 - smoothing) * picked
            if smoothing:
                loss = loss - smoothing * z.mean(dim=-1)
            losses[rows] = torch.where(valid, loss, 0.0)
        ctx.save_for_backward(hidden, weight, bias, target)
        # Kept off the saved-tensor hooks: an error in it would scale every probability.
        ctx.lse = lse
        ctx.args = (ignore_index, smoothing, softcap, chunk, divisor)
        return losses if divisor is None else losses.sum() / divisor

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, target = ctx.saved_tensors
        ignore_index, smoothing, softcap, chunk, divisor = ctx.args
        lse = ctx.lse
        n, vocab = hidden.shape[0], weight.shape[0]
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = None
        if want_h:  # a decoded ``hidden`` is dead row by row: its gradient goes where it was
            grad_h = hidden if private(hidden) else torch.empty_like(hidden)
        work = lse.dtype
        grad_w = torch.zeros(weight.shape, dtype=work, device=weight.device)
        grad_b = torch.zeros(vocab, dtype=work, device=weight.device)
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            h = hidden[rows]
            z, t_cap = _logits(h, weight, bias, softcap)
            g = z.sub_(lse[rows, None]).exp_()  # the softmax, in the logits' memory
            t = target[rows]
            picked = torch.full((len(t), 1), smoothing - 1, dtype=g.dtype, device=g.device)
            g.scatter_add_(1, t.clamp(0, vocab - 1)[:, None], picked)
            if smoothing:
                g -= smoothing / vocab
            if divisor is None:  # reduction "none": a gradient per token
                weights = grad_out[rows].to(work)
            else:
                weights = (grad_out.to(work) / divisor).expand(len(t))
            g *= torch.where(t != ignore_index, weights, 0.0)[:, None]
            if t_cap is not None:
                g *= 1 - t_cap.square()
            g = g.to(hidden.dtype)
            if want_w:  # before grad_h: it may overwrite ``h``
                grad_w.addmm_(g.t().to(work), h.to(work))
            if want_h:
                grad_h[rows] = g @ weight
            if want_b and bias is not None:
                grad_b += g.to(work).sum(0)
            del z, g  # before the next chunk's logits: one chunk alive at a time
        grad_w = grad_w.to(weight.dtype) if want_w else None
        grad_b = grad_b.to(bias.dtype) if want_b and bias is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


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
    chunk = chunk_size or default_chunk_size(h.shape[0], weight.shape[0], h.shape[-1])
    if num_items_in_batch is not None:
        divisor = num_items_in_batch
    elif reduction == "mean":
        divisor = (t != ignore_index).sum()
    elif reduction == "sum":
        divisor = 1
    else:
        divisor = None
    with torch.autocast(device, enabled=False):
        out = _LinearCrossEntropy.apply(
            h, weight, bias, t, ignore_index, label_smoothing, softcap, chunk, divisor
        )
    return out.view(shape) if divisor is None else out
