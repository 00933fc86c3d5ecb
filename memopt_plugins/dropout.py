"""Memory-efficient dropout: the mask kept as bits (``bitmask``) or rebuilt from a seed.

PyTorch's dropout keeps its whole noise tensor for backward. :class:`_DropoutFunction` computes the
same output and gradient and keeps either the mask packed 8 elements a byte (``bitmask``: drawn
from the global RNG as PyTorch's CPU kernel draws it, so bit for bit ``nn.Dropout`` under the same
seed) or one seed per call (``regenerate``: drawn from the global CPU generator, never reseeding
it, the mask rebuilt from a private generator; reproducible, but not ``nn.Dropout``'s masks). Under
``torch.utils.checkpoint`` (RNG preserved) a replay rebuilds the very mask or seed.

:class:`DropoutPatch` swaps modules whose type is exactly one of torch's dropout modules for a
subclass of the same type (names, ``isinstance`` and state dict unchanged), and routes functional
dropout called inside the model (Hugging Face's eager attention) through :mod:`.routing`. Written
for eager execution; what is not covered (fused dropout, subclasses with a ``forward`` of their
own, calls outside the model's modules): docs/architecture.md, "Dropout".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .compress.codec import pack_mask, unpack_mask
from .routing import ModelRouting, RoutingMode

log = logging.getLogger("memopt")

BITMASK = "bitmask"
REGENERATE = "regenerate"
MODES = (BITMASK, REGENERATE)

_ALPHA = 1.7580993408473766  # SELU's -scale * alpha, as in ATen's alpha dropout
_SEED_HIGH = 2**63 - 1


def _draw_seed() -> int:
    # The global CPU generator: checkpoint restores it before recompute, on any device.
    return int(torch.randint(_SEED_HIGH, (), dtype=torch.int64))


def _seeded_noise(
    seed: int, shape: torch.Size, dtype: torch.dtype, device: torch.device, keep: float
) -> torch.Tensor:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return torch.empty(shape, dtype=dtype, device=device).bernoulli_(keep, generator=generator)


def _noise_shape(x: torch.Tensor, feature: bool, batched: bool) -> torch.Size:
    if not feature:
        return x.shape
    lead = 2 if batched else 1  # one draw per (sample, channel), or per channel when unbatched
    return torch.Size((*x.shape[:lead], *([1] * (x.dim() - lead))))


def _alpha_coefficients(p: float) -> tuple[float, float]:
    """``(a, c)``: alpha dropout computes ``x * (mask * a) + (mask - 1) * c + c * p``."""
    a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p))
    return a, _ALPHA * a


def _to_multiplier(noise: torch.Tensor, p: float, alpha: bool) -> torch.Tensor:
    """Turn a 0/1 noise tensor (in place) into the factor PyTorch multiplies the input by."""
    return noise.mul_(_alpha_coefficients(p)[0]) if alpha else noise.div_(1 - p)


class _DropoutFunction(torch.autograd.Function):
    """Dropout whose backward needs the mask as bits (or only a seed), never a float mask."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        p: float,
        feature: bool,
        batched: bool,
        alpha: bool,
        inplace: bool,
        regenerate: bool,
    ) -> torch.Tensor:
        shape = _noise_shape(x, feature, batched)
        if regenerate:
            ctx.seed = _draw_seed()
            noise = _seeded_noise(ctx.seed, shape, x.dtype, x.device, 1 - p)
        else:
            # The same allocation and draw as ATen's CPU dropout, hence the same mask.
            noise = x.new_empty(shape) if feature else torch.empty_like(x)
            noise.bernoulli_(1 - p)
            ctx.save_for_backward(pack_mask(noise))
        ctx.p, ctx.shape, ctx.alpha, ctx.regenerate = p, shape, alpha, regenerate
        ctx.dtype, ctx.device = x.dtype, x.device
        shift = None
        if alpha:
            _, c = _alpha_coefficients(p)
            shift = noise.add(-1).mul_(c).add_(c * p)
        _to_multiplier(noise, p, alpha)
        if inplace:
            out = x.mul_(noise)
            ctx.mark_dirty(x)
        else:
            out = x.mul(noise)
        return out.add_(shift) if shift is not None else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.regenerate:
            noise = _seeded_noise(ctx.seed, ctx.shape, ctx.dtype, ctx.device, 1 - ctx.p)
        else:
            (packed,) = ctx.saved_tensors
            noise = unpack_mask(packed, ctx.shape, ctx.dtype)
        return grad * _to_multiplier(noise, ctx.p, ctx.alpha), None, None, None, None, None, None


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"dropout mode must be one of {', '.join(MODES)}; got {mode!r}")


def _dropout(
    x: torch.Tensor,
    p: float,
    training: bool,
    inplace: bool,
    mode: str,
    *,
    feature: bool = False,
    batched: bool = True,
    alpha: bool = False,
) -> torch.Tensor:
    """ATen's ``_dropout_impl`` with the mask kept by ``mode``; same early exits and checks."""
    _check_mode(mode)
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if p == 0 or not training or x.numel() == 0:
        return x
    if feature and x.dim() < 2:
        raise RuntimeError("Feature dropout requires at least 2 dimensions in the input")
    if p == 1:
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        return x.mul_(zero) if inplace else x.mul(zero)
    return _DropoutFunction.apply(x, p, feature, batched, alpha, inplace, mode == REGENERATE)


# --------------------------------------------------------------------------- functional API


def _functional(
    name: str,
    *,
    feature: bool = False,
    alpha: bool = False,
    training: bool = True,
    ranks: tuple[int, ...] = (),
    batched_rank: int | None = None,
) -> Callable[..., torch.Tensor]:
    """``F.<name>`` with PyTorch's signature and defaults, plus the keyword ``mode``.

    ``ranks``: the input ranks handled here (others go to ``F.<name>`` itself, which raises or
    warns as it does); ``batched_rank``: the rank that has a batch dimension (feature dropout
    draws one value per sample and channel, or per channel without a batch).
    """
    native = getattr(F, name)

    def functional(
        input: torch.Tensor,
        p: float = 0.5,
        training: bool = training,
        inplace: bool = False,
        *,
        mode: str = BITMASK,
    ) -> torch.Tensor:
        if ranks and input.dim() not in ranks:
            return native(input, p, training, inplace)
        batched = batched_rank is None or input.dim() == batched_rank
        return _dropout(
            input, p, training, inplace, mode, feature=feature, batched=batched, alpha=alpha
        )

    functional.__name__ = functional.__qualname__ = name
    functional.__doc__ = f"``F.{name}`` whose backward keeps the mask as bits or a seed (``mode``)."
    return functional


dropout = _functional("dropout")
alpha_dropout = _functional("alpha_dropout", alpha=True, training=False)
feature_alpha_dropout = _functional(
    "feature_alpha_dropout", feature=True, alpha=True, training=False
)
dropout1d = _functional("dropout1d", feature=True, ranks=(2, 3), batched_rank=3)
#: 4-D only: PyTorch treats 3-D input to dropout2d as (N, C, L) with a deprecation warning.
dropout2d = _functional("dropout2d", feature=True, ranks=(4,), batched_rank=4)
dropout3d = _functional("dropout3d", feature=True, ranks=(4, 5), batched_rank=5)


def _aten_route(feature: bool, alpha: bool, inplace: bool) -> Callable[..., torch.Tensor]:
    # torch.dropout(input, p, train) and friends: ATen's signature, batched feature noise.
    def route(input: torch.Tensor, p: float, train: bool, *, mode: str) -> torch.Tensor:
        return _dropout(input, p, train, inplace, mode, feature=feature, alpha=alpha)

    return route


#: PyTorch function -> the equivalent above (which takes ``mode=`` as a keyword).
_ROUTES: dict[Callable[..., Any], Callable[..., torch.Tensor]] = {
    F.dropout: dropout,
    F.alpha_dropout: alpha_dropout,
    F.feature_alpha_dropout: feature_alpha_dropout,
    F.dropout1d: dropout1d,
    F.dropout2d: dropout2d,
    F.dropout3d: dropout3d,
}
for _name, _feature, _alpha in (
    ("dropout", False, False),
    ("feature_dropout", True, False),
    ("alpha_dropout", False, True),
    ("feature_alpha_dropout", True, True),
):
    _ROUTES[getattr(torch, _name)] = _aten_route(_feature, _alpha, inplace=False)
    _ROUTES[getattr(torch, _name + "_")] = _aten_route(_feature, _alpha, inplace=True)


class FunctionalDropoutMode(RoutingMode):
    """Routes PyTorch's dropout functions to their memory-efficient equivalents (see module doc)."""

    def __init__(self, mode: str) -> None:
        _check_mode(mode)
        super().__init__({func: partial(route, mode=mode) for func, route in _ROUTES.items()})
        self.mode = mode


# --------------------------------------------------------------------------- modules


# Instance attribute of a module DropoutPatch swapped in: the PyTorch type it replaced.
_SWAPPED_FROM = "_memopt_swapped_from"


def _new_module(cls: type[nn.Module]) -> nn.Module:
    """An empty instance of ``cls``, for unpickling; its state is set afterwards."""
    return cls.__new__(cls)


class _MemoryDropoutMixin:
    """Forward of a dropout module through the memory-efficient functional of the same kind."""

    mode: str
    _functional: Callable[..., torch.Tensor]
    _uses_inplace = True  # PyTorch's alpha-dropout modules ignore their ``inplace``

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        inplace = self.inplace and self._uses_inplace
        return type(self)._functional(input, self.p, self.training, inplace, mode=self.mode)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode}"

    def __reduce_ex__(self, protocol: int) -> tuple:
        """Copies and pickles of a module that :class:`DropoutPatch` swapped in are the PyTorch
        module it replaced (see :mod:`memopt_plugins.patching`); others stay as they are."""
        reduced = super().__reduce_ex__(protocol)
        original = self.__dict__.get(_SWAPPED_FROM)
        if original is None:
            return reduced
        state = {k: v for k, v in reduced[2].items() if k not in ("mode", _SWAPPED_FROM)}
        return (_new_module, (original,), state)


class MemoryDropout(_MemoryDropoutMixin, nn.Dropout):
    """``nn.Dropout`` keeping its mask as bits or a seed."""

    _functional = staticmethod(dropout)


class MemoryDropout1d(_MemoryDropoutMixin, nn.Dropout1d):
    """``nn.Dropout1d`` keeping its mask as bits or a seed."""

    _functional = staticmethod(dropout1d)


class MemoryDropout2d(_MemoryDropoutMixin, nn.Dropout2d):
    """``nn.Dropout2d`` keeping its mask as bits or a seed."""

    _functional = staticmethod(dropout2d)


class MemoryDropout3d(_MemoryDropoutMixin, nn.Dropout3d):
    """``nn.Dropout3d`` keeping its mask as bits or a seed."""

    _functional = staticmethod(dropout3d)


class MemoryAlphaDropout(_MemoryDropoutMixin, nn.AlphaDropout):
    """``nn.AlphaDropout`` keeping its mask as bits or a seed (``inplace`` ignored, as there)."""

    _functional = staticmethod(alpha_dropout)
    _uses_inplace = False


class MemoryFeatureAlphaDropout(_MemoryDropoutMixin, nn.FeatureAlphaDropout):
    """``nn.FeatureAlphaDropout`` keeping its mask as bits or a seed (``inplace`` ignored)."""

    _functional = staticmethod(feature_alpha_dropout)
    _uses_inplace = False


#: Exact PyTorch type -> replacement (a subclass of it). Subclasses of these are not swapped.
REPLACEMENTS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Dropout: MemoryDropout,
    nn.Dropout1d: MemoryDropout1d,
    nn.Dropout2d: MemoryDropout2d,
    nn.Dropout3d: MemoryDropout3d,
    nn.AlphaDropout: MemoryAlphaDropout,
    nn.FeatureAlphaDropout: MemoryFeatureAlphaDropout,
}


def memory_dropout_module(module: nn.Module, mode: str) -> nn.Module:
    """The replacement of a dropout ``module``: same type family, ``p``, ``inplace``, mode."""
    _check_mode(mode)
    replacement = REPLACEMENTS[type(module)](module.p, module.inplace)
    replacement.mode = mode
    replacement.train(module.training)
    return replacement


class DropoutPatch:
    """Applies a dropout mode to a model: swaps dropout modules, routes functional dropout.

    Args:
        mode: ``"bitmask"`` or ``"regenerate"``.
    """

    def __init__(self, mode: str) -> None:
        _check_mode(mode)
        self.mode = mode
        # (parent, child name, original, replacement), in the order applied
        self._swaps: list[tuple[nn.Module, str, nn.Module, nn.Module]] = []
        self._routing = ModelRouting(lambda: FunctionalDropoutMode(mode))

    @property
    def swapped(self) -> list[nn.Module]:
        """The replacement modules now in the model."""
        return [swap[3] for swap in self._swaps]

    def apply(self, model: nn.Module) -> None:
        """Swap the dropout modules of ``model``; every module's scope enters the mode."""
        made: dict[int, nn.Module] = {}  # a module registered under several parents: one swap
        for parent in list(model.modules()):
            for name, child in list(parent._modules.items()):
                if child is None or type(child) not in REPLACEMENTS:
                    continue
                replacement = made.get(id(child))
                if replacement is None:
                    replacement = made[id(child)] = memory_dropout_module(child, self.mode)
                    setattr(replacement, _SWAPPED_FROM, type(child))
                parent._modules[name] = replacement
                self._swaps.append((parent, name, child, replacement))
        self._routing.apply(model)
        log.info(
            "memopt: dropout mode %s: %d dropout modules swapped, functional dropout routed",
            self.mode,
            len(made),
        )

    def remove(self) -> None:
        """Put the original modules back (with the ``p`` and train/eval state they have now)."""
        self._routing.remove()
        for parent, name, original, replacement in reversed(self._swaps):
            if parent._modules.get(name) is not replacement:
                log.warning(
                    "memopt: %s.%s was replaced by someone else since apply; left as it is",
                    type(parent).__name__,
                    name,
                )
                continue
            original.p = replacement.p
            original.inplace = replacement.inplace
            original.train(replacement.training)
            parent._modules[name] = original
        self._swaps.clear()

    def active(self) -> AbstractContextManager[None]:
        """Route functional dropout inside this block (if not already routed on this thread).

        For code that runs parts of the model without calling its modules, e.g. a recompute
        replay that calls a module's ``forward`` directly.
        """
        return self._routing.active()
