"""Running-statistics BatchNorm as an autograd op, fused with a ReLU that follows it.

:func:`running_batch_norm` is a BatchNorm layer's forward with its running statistics (the eval
kernel, so equal bit for bit to eval mode), the statistics left as they are: ``z = x * s + t`` per
channel, whose backward needs no batch statistics. Followed by a ReLU it keeps no BN-specific
tensor: the ReLU's output ``y``, which the next layer saves anyway, gives the whole backward
(``x̂ = (y − β)/γ`` where ``y > 0``); a channel whose ``γ`` is 0 or too small against ``β`` keeps
its own slice of the input. Followed by anything else it keeps its input, through the active
saved-tensor hooks.

To find the ReLU soundly, BN's output is a tensor subclass that watches every call made on it
(``__torch_function__``): if the first is a ReLU it runs fused and BN's input is dropped once
nothing else can use the output; any other use keeps the input. A use this cannot see (a C++
extension outside PyTorch's dispatch) makes backward raise an error naming the layer, reported
through a :class:`BatchNormObserver`, rather than return a wrong gradient.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from .first_order import first_order

#: ``|γ|·PRECISION_RATIO ≤ β`` marks a channel whose input cannot be recovered from the ReLU output
#: to full precision; such channels keep their own input slice.
PRECISION_RATIO = 64.0

_FRESH, _FUSED, _FUSED_INPLACE, _USED = range(4)

_T = torch.Tensor
_RELUS = {F.relu, F.relu_, torch.relu, torch.relu_, _T.relu, _T.relu_}
_INPLACE_RELUS = {F.relu_, torch.relu_, _T.relu_}
#: Calls on the watched output that cannot make it an input of another autograd node.
_METADATA = {
    _T.shape.__get__,
    _T.dtype.__get__,
    _T.device.__get__,
    _T.ndim.__get__,
    _T.layout.__get__,
    _T.requires_grad.__get__,
    _T.grad_fn.__get__,
    _T.is_leaf.__get__,
    _T.is_cuda.__get__,
    _T.size,
    _T.dim,
    _T.numel,
    _T.nelement,
    _T.stride,
    _T.storage_offset,
    _T.is_contiguous,
    _T.is_floating_point,
    _T.element_size,
    _T.__len__,
    _T.__repr__,
    _T.__format__,
}


def _channel_view(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.view(1, -1, *([1] * (dim - 2)))


def _reduce_dims(dim: int) -> list[int]:
    return [0, *range(2, dim)]


# --------------------------------------------------------------------------- bookkeeping


class _Box:
    """A saved tensor's payload that can be dropped after the forward that saved it."""

    __slots__ = ("payload", "unpack", "dropped")

    def __init__(self, payload: object, unpack: Callable[[object], torch.Tensor] | None):
        self.payload = payload
        self.unpack = unpack
        self.dropped = False


class _Link:
    """Ties one BN call to its watched output and (if fused) the ReLU that consumed it."""

    __slots__ = ("name", "state", "box", "relu_output", "observer")

    def __init__(self, name: str, observer: BatchNormObserver):
        self.name = name
        self.state = _FRESH
        self.box: _Box | None = None
        self.relu_output: torch.Tensor | None = None  # handed over by the ReLU's backward
        self.observer = observer

    def saw_use(self) -> None:
        if self.state in (_FRESH, _FUSED):
            self.state = _USED

    def drop_input(self) -> None:
        """The BN input is no longer needed for backward: free it."""
        if self.box is not None and not self.box.dropped:
            self.box.payload = None
            self.box.dropped = True
            if self.state in (_FUSED, _FUSED_INPLACE):
                self.observer.fused(self.name)

    def output_freed(self) -> None:
        # Nothing can use BN's output any more: the ReLU (or nothing at all, in which case BN's
        # backward never runs) was its only consumer.
        if self.state in (_FRESH, _FUSED):
            self.drop_input()


def _droppable_save(link: _Link) -> saved_tensors_hooks:
    """Saved-tensor hooks that box what is saved (through the hooks already active)."""
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(t: torch.Tensor) -> _Box:
        box = _Box(outer_pack(t) if outer_pack is not None else t, outer_unpack)
        link.box = box
        return box

    def unpack(box: _Box) -> torch.Tensor:
        if box.dropped:
            raise RuntimeError(
                f"memopt: BatchNorm {link.name!r} needs its input in backward, but its output "
                "was used by code memopt could not see; use batchnorm.mode: batch for this model"
            )
        return box.unpack(box.payload) if box.unpack is not None else box.payload

    return saved_tensors_hooks(pack, unpack)


# --------------------------------------------------------------------------- autograd


class _WatchedOutput(torch.Tensor):
    """BN's output in training: sees every PyTorch call made on it (see module doc)."""

    _memopt_link: _Link

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RELUS and args and type(args[0]) is cls:
            z = args[0]
            link = z._memopt_link
            if link.state == _FRESH and torch.is_grad_enabled():
                inplace = func in _INPLACE_RELUS or bool(
                    kwargs.get("inplace", args[1] if len(args) > 1 else False)
                )
                return _fused_relu(z, link, inplace)
        if func not in _METADATA:
            for arg in _flat(args, kwargs):
                if type(arg) is cls:
                    arg._memopt_link.saw_use()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _flat(args: tuple, kwargs: dict) -> list:
    out: list = []
    stack = [*args, *kwargs.values()]
    while stack:
        item = stack.pop()
        if isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        else:
            out.append(item)
    return out


def _fused_relu(z: torch.Tensor, link: _Link, inplace: bool) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        y = _FusedReLU.apply(z, link, inplace)
    if inplace:
        # z now holds the ReLU output: later uses of it reach the ReLU node, never BN's.
        link.state = _FUSED_INPLACE
        link.drop_input()
    else:
        link.state = _FUSED
    return y


class _FusedReLU(torch.autograd.Function):
    """ReLU on a running-mode BN output: hands its saved output to BN's backward."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, link: _Link, inplace: bool) -> torch.Tensor:
        if inplace:
            y = z.relu_()
            ctx.mark_dirty(z)
        else:
            y = torch.relu(z)
        ctx.save_for_backward(y)
        ctx.link = link
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (y,) = ctx.saved_tensors
        ctx.link.relu_output = y
        return torch.ops.aten.threshold_backward(dy, y, 0), None, None


class _RunningBatchNorm(torch.autograd.Function):
    """``F.batch_norm`` with running statistics in eval form; saves at most the input."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor,
        running_var: torch.Tensor,
        eps: float,
        link: _Link | None,
        precise: torch.Tensor | None,
    ) -> torch.Tensor:
        z = F.batch_norm(x, running_mean, running_var, weight, bias, False, 0.0, eps)
        ctx.mean = running_mean.to(torch.float32, copy=True)  # as used, whatever happens later
        ctx.invstd = torch.rsqrt(running_var.float() + eps)
        ctx.weight, ctx.bias = weight, bias
        ctx.versions = tuple(p._version if p is not None else 0 for p in (weight, bias))
        ctx.link = link
        ctx.dim = x.dim()
        ctx.dtype = x.dtype
        ctx.save_for_backward(x)
        # Channels whose input cannot be recovered from the ReLU output keep their own slice.
        ctx.precise = precise
        ctx.precise_input = x.index_select(1, precise) if precise is not None else None
        if link is not None:
            # Retype the fresh output in place: ``as_subclass`` would return a view of it, and
            # autograd forbids in-place ops on views made inside a custom Function.
            z.__class__ = _WatchedOutput
        return z

    @staticmethod
    @first_order
    def backward(ctx: Any, dz: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        weight, bias, link, dim = ctx.weight, ctx.bias, ctx.link, ctx.dim
        for p, version in zip((weight, bias), ctx.versions, strict=True):
            if p is not None and p._version != version:
                raise RuntimeError(
                    "memopt: a BatchNorm weight or bias was modified in place between forward "
                    "and backward"
                )
        dims = _reduce_dims(dim)
        scale = ctx.invstd if weight is None else ctx.invstd * weight.detach().float()
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (dz.float() * _channel_view(scale, dim)).to(dz.dtype)
        need_dgamma = weight is not None and ctx.needs_input_grad[1]
        dgamma = None
        if link is not None and link.box is not None and link.box.dropped:
            dgamma = _fused_dgamma(ctx, link, dz, need_dgamma)
        elif need_dgamma:
            (x,) = ctx.saved_tensors
            dgamma, _ = _channel_sums(dz, x, ctx.mean, ctx.invstd)
        dbeta = None
        if bias is not None and ctx.needs_input_grad[2]:
            dbeta = dz.sum(dims, dtype=torch.float32).to(bias.dtype)
        if dgamma is not None:
            dgamma = dgamma.to(weight.dtype)
        return dx, dgamma, dbeta, None, None, None, None, None


#: The backward reductions run over about this many elements at a time (whole samples), so
#: their temporaries stay small next to the activations.
_CHUNK_ELEMENTS = 2**18


def _channel_sums(
    dz: torch.Tensor,
    t: torch.Tensor,
    center: torch.Tensor,
    factor: torch.Tensor,
    relu_output: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per channel ``Σ dz·(t − center)·factor`` in float32, in chunks of the batch.

    With ``relu_output`` also the largest ``|dz|`` where ``t ≤ 0`` (0 when a ReLU that produced
    ``t`` is the only consumer of BN's output).
    """
    dim = t.dim()
    dims = _reduce_dims(dim)
    center, factor = _channel_view(center, dim), _channel_view(factor, dim)
    sums = torch.zeros(t.shape[1], dtype=torch.float32, device=t.device)
    stray = torch.zeros((), dtype=torch.float32, device=t.device) if relu_output else None
    rows = max(1, _CHUNK_ELEMENTS // max(1, t[:1].numel()))
    for dz_c, t_c in zip(dz.split(rows), t.split(rows), strict=True):
        d = dz_c.float()
        if stray is not None:
            # NaN in the ReLU output is a diverged model, not a missed use: it propagates.
            stray = torch.maximum(stray, torch.where(t_c <= 0, d, 0).abs_().amax())
        sums += (t_c.float() - center).mul_(factor).mul_(d).sum(dims)
    return sums, stray


def _fused_dgamma(
    ctx: Any, link: _Link, dz: torch.Tensor, need_dgamma: bool
) -> torch.Tensor | None:
    """dγ from the ReLU output (BN's input was dropped); checks that only the ReLU used BN.

    ``x̂ = (y − β)/γ``; where ``y = 0`` the ReLU passed no gradient, so those terms vanish.
    """
    y = link.relu_output
    link.relu_output = None
    if y is None:
        raise RuntimeError(
            f"memopt: BatchNorm {link.name!r}: gradient reached it without passing its ReLU; its "
            "output was used by code memopt could not see. Use batchnorm.mode: batch here."
        )
    if ctx.weight is None:  # affine=False: γ = 1, β = 0
        weight = torch.ones(dz.shape[1], dtype=torch.float32, device=dz.device)
    else:
        weight = ctx.weight.detach().float()
    beta = ctx.bias.detach().float() if ctx.bias is not None else torch.zeros_like(weight)
    usable = weight != 0
    if ctx.precise is not None:
        usable[ctx.precise] = False
    inverse = torch.where(usable, 1 / torch.where(usable, weight, 1), 0)
    dgamma, stray = _channel_sums(dz, y, beta, inverse, relu_output=True)
    link.observer.stray(link.name, stray)
    if not need_dgamma:
        return None
    if ctx.precise is not None:
        idx = ctx.precise
        dgamma[idx], _ = _channel_sums(
            dz.index_select(1, idx), ctx.precise_input, ctx.mean[idx], ctx.invstd[idx]
        )
    return dgamma


# --------------------------------------------------------------------------- the op


#: Accelerator modules -> (parameter versions and addresses, precise channels): finding the
#: channels needs a device sync, so it is redone only when the optimizer changed γ or β.
_PRECISE_CACHE: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, torch.Tensor | None]] = (
    weakref.WeakKeyDictionary()
)


def _precise_channels(module: nn.modules.batchnorm._BatchNorm) -> torch.Tensor | None:
    """Indices of channels whose input a ReLU output cannot give back precisely (or None).

    On accelerators the answer is cached until ``weight`` or ``bias`` changes in place (their
    version counters; a write through ``.data`` bypasses those, as it bypasses autograd's checks).
    """
    weight, bias = module.weight, module.bias
    if weight is None or bias is None:  # β = 0: the ReLU output gives every x̂ > 0 back
        return None
    key = None
    if weight.device.type != "cpu":
        key = (weight._version, bias._version, weight.data_ptr(), bias.data_ptr())
        cached = _PRECISE_CACHE.get(module)
        if cached is not None and cached[0] == key:
            return cached[1]
    with torch.no_grad():
        idx = ((bias > 0) & (weight.abs() * PRECISION_RATIO <= bias)).nonzero().flatten()
    found = idx if idx.numel() else None
    if key is not None:
        _PRECISE_CACHE[module] = (key, found)
    return found


def running_batch_norm(
    input: torch.Tensor,
    module: nn.modules.batchnorm._BatchNorm,
    *,
    name: str = "",
    observer: BatchNormObserver | None = None,
) -> torch.Tensor:
    """Training-mode forward of ``module`` normalizing with its running statistics.

    Equal to the eval-mode output; the running statistics are left as they are (module doc).
    ``name`` labels error messages; ``observer`` hears which calls ran fused with a ReLU and
    checks the fused backward (by default: raise at once if a use was missed).
    """
    if module.running_mean is None or module.running_var is None:
        raise ValueError("running_batch_norm needs a BatchNorm with running statistics")
    weight, bias = module.weight, module.bias
    needs_grad = torch.is_grad_enabled() and (
        input.requires_grad or any(p is not None and p.requires_grad for p in (weight, bias))
    )
    if not needs_grad or torch.compiler.is_compiling():
        # Inside a compiled graph the ReLU fusion (a tensor subclass watching its uses) cannot
        # be traced: eval-mode batch_norm is the same maths, and the compiler decides what to save.
        return F.batch_norm(
            input, module.running_mean, module.running_var, weight, bias, False, 0.0, module.eps
        )
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():
        return _apply(input, module, None, None)  # nothing to drop: the input stays saved
    link = _Link(name or type(module).__name__, observer or _DEFAULT_OBSERVER)
    with _droppable_save(link):
        out = _apply(input, module, link, _precise_channels(module))
    weakref.finalize(out, link.output_freed)
    return out


def _apply(
    x: torch.Tensor,
    module: nn.modules.batchnorm._BatchNorm,
    link: _Link | None,
    precise: torch.Tensor | None,
) -> torch.Tensor:
    out = _RunningBatchNorm.apply(
        x,
        module.weight,
        module.bias,
        module.running_mean,
        module.running_var,
        module.eps,
        link,
        precise,
    )
    if link is not None:
        out._memopt_link = link
    return out


class BatchNormObserver:
    """Hears what running-mode BN calls learn after their forward (:func:`running_batch_norm`)."""

    def fused(self, name: str) -> None:
        """BN ``name`` ran fused with its ReLU: its input was dropped."""

    def stray(self, name: str, value: torch.Tensor) -> None:
        """``value``: the largest gradient that reached fused BN ``name`` where its ReLU passed
        none (0 unless a use of BN's output was missed). Raises when it is not 0."""
        _raise_on_stray(name, value)


_DEFAULT_OBSERVER = BatchNormObserver()


def _raise_on_stray(name: str, stray: torch.Tensor) -> None:
    if float(stray) != 0:
        raise RuntimeError(stray_message(name))


def stray_message(name: str) -> str:
    """The error raised when code memopt could not see used the output of BN ``name``."""
    return (
        f"memopt: the output of BatchNorm {name!r} was used by code memopt could not see (not "
        "through PyTorch's dispatch), so its weight gradient would be wrong. Use "
        "batchnorm.mode: batch for this model."
    )
