"""A model's own ``F.cross_entropy`` made lean by configuration (``ops.cross_entropy: lean``).

A model that computes ``F.cross_entropy(self.lm_head(x).view(-1, V), targets)`` in its forward
(karpathy's nanoGPT) keeps the log-softmax for backward, and the backward holds it beside two
logits-sized gradients. While the model runs, a :class:`CrossEntropyMode` (:mod:`..routing`)
routes the call:

* logits that are, unchanged, the output of the last ``F.linear`` call (an ``nn.Linear`` head, in
  any view of the same rows) go to :func:`~.loss.linear_cross_entropy` with the head's input and
  weight, which keeps none of them; the logits the model returns keep their own gradient path;
* other logits go to :func:`cross_entropy`, which keeps them once (as autograd saves any tensor,
  so memopt compresses them) and writes their gradient into the decoded copy.

Both are exact for class-index targets; other calls run ``F.cross_entropy`` itself. Which
arguments are taken: docs/lean-ops.md, "ops.cross_entropy: lean".
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..buffers import private
from ..first_order import first_order
from .loss import _BITS_OF, chunk_gradient, chunk_losses, linear_cross_entropy

#: Chunks of rows by default: each chunk's temporaries are this fraction of the logits.
_CHUNKS = 8


def _divisor(target: torch.Tensor, ignore_index: int, reduction: str) -> Any:
    """What the sum of the losses is divided by (``None``: no reduction)."""
    if reduction == "mean":
        return (target != ignore_index).sum()
    return 1 if reduction == "sum" else None


class _CrossEntropy(torch.autograd.Function):
    """Cross-entropy of ``(N, V)`` logits keeping the logits and one log-sum-exp per row."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, smoothing, chunk, divisor):
        n = logits.shape[0]
        work = torch.promote_types(logits.dtype, torch.float32)
        losses = torch.empty(n, dtype=work, device=logits.device)
        lse = torch.empty(n, dtype=work, device=logits.device)
        for start in range(0, n, chunk):  # chunks: no logits-sized temporary
            rows = slice(start, min(start + chunk, n))
            z = logits[rows].to(work)
            losses[rows], lse[rows] = chunk_losses(z, target[rows], ignore_index, smoothing)
        ctx.save_for_backward(logits, target)
        ctx.lse_bits = lse.view(_BITS_OF[work])  # off the compression hooks, as in .loss
        ctx.args = (ignore_index, smoothing, chunk, divisor)
        return losses if divisor is None else losses.sum() / divisor

    @staticmethod
    @first_order
    def backward(ctx, grad_out):
        logits, target = ctx.saved_tensors
        ignore_index, smoothing, chunk, divisor = ctx.args
        work = torch.promote_types(logits.dtype, torch.float32)
        lse = ctx.lse_bits.view(work)
        scale = grad_out if divisor is None else (grad_out / divisor).expand(target.shape)
        scale = scale.to(work)
        # a freshly decoded copy takes its own gradient; the caller's logits are never written
        own = private(logits)
        grad = logits if own else torch.empty_like(logits)
        n = logits.shape[0]
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            args = (lse[rows], target[rows], scale[rows], ignore_index, smoothing)
            if grad.dtype == work:  # the chunk's gradient computed in its place
                if not own:
                    grad[rows] = logits[rows]
                chunk_gradient(grad[rows], *args)
            else:
                grad[rows] = chunk_gradient(logits[rows].to(work), *args)
        return grad, None, None, None, None, None


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(logits, target, ...)`` for ``(N, V)`` logits and ``(N,)`` class indices,
    keeping only the logits (and a log-sum-exp per row) and writing their gradient into a
    decoded copy of them: at most one logits-sized tensor of its own in backward."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction: {reduction!r} is not 'mean', 'sum' or 'none'")
    chunk = chunk_size or max(1, math.ceil(len(logits) / _CHUNKS))
    divisor = _divisor(target, ignore_index, reduction)
    return _CrossEntropy.apply(logits, target, ignore_index, label_smoothing, chunk, divisor)


#: ``F.cross_entropy``'s parameters, by position.
_PARAMETERS = (
    "input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
    "label_smoothing",
)  # fmt: skip


def _storage_owner(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


class CrossEntropyMode(TorchFunctionMode):
    """Routes ``F.cross_entropy`` (see module doc); remembers the last ``F.linear`` call."""

    def __init__(self, chunk_size: int | None = None) -> None:
        super().__init__()
        self.chunk_size = chunk_size
        self._head: tuple[Any, ...] | None = None  # weak references to the last linear call

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            return self._cross_entropy(args, kwargs)
        out = func(*args, **kwargs)
        if func is F.linear:
            self._remember(out, *args, **kwargs)
        return out

    def _remember(
        self,
        out: torch.Tensor,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> None:
        # weakly: the head's input must not outlive the model's own use of it
        refs = [weakref.ref(t) if t is not None else None for t in (out, input, weight, bias)]
        self._head = (*refs, out._version, input._version)

    def _linear_of(self, logits: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """``(input, weight, bias)`` of the last ``F.linear`` when ``logits`` are its unchanged
        output (or a view of all of it, row by row), else ``None``."""
        if self._head is None:
            return None
        out_ref, input_ref, weight_ref, bias_ref, out_version, input_version = self._head
        out, input, weight = out_ref(), input_ref(), weight_ref()
        bias = bias_ref() if bias_ref is not None else None
        if (
            out is None
            or input is None
            or weight is None
            or (bias_ref is not None and bias is None)
        ):
            return None
        same_rows = logits is out or (
            _storage_owner(logits) is _storage_owner(out)
            and out.is_contiguous()
            and logits.is_contiguous()
            and logits.data_ptr() == out.data_ptr()
            and logits.numel() == out.numel()
        )
        unchanged = out._version == out_version and input._version == input_version
        if not (same_rows and unchanged and logits.shape[-1] == weight.shape[0]):
            return None
        return input, weight, bias

    def _cross_entropy(self, args: tuple, kwargs: dict) -> torch.Tensor:
        given = dict(zip(_PARAMETERS, args, strict=False)) | kwargs
        logits, target = given["input"], given["target"]
        plain = (
            given.get("weight") is None
            and given.get("size_average") is None
            and given.get("reduce") is None
            and logits.dim() == 2
            and target.dim() == 1
            and not target.is_floating_point()
            and torch.is_grad_enabled()
            and logits.requires_grad
        )
        if not plain:
            return F.cross_entropy(*args, **kwargs)
        options = {
            "ignore_index": given.get("ignore_index", -100),
            "reduction": given.get("reduction", "mean"),
            "label_smoothing": given.get("label_smoothing", 0.0),
            "chunk_size": self.chunk_size,
        }
        head = self._linear_of(logits)
        if head is None:
            return cross_entropy(logits, target, **options)
        hidden, weight, bias = head
        return linear_cross_entropy(hidden, weight, target, bias, logits=logits, **options)
