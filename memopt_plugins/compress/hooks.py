"""Saved-tensor hooks scoped per module: the innermost selected module decides the bits.

A forward pre-hook enters the module's ``saved_tensors_hooks`` and a forward hook
(``always_call=True``) leaves them, so every tensor autograd saves while the module runs — by an
``nn.Module`` or a functional call — goes through :meth:`CompressionHooks.pack`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.hooks import RemovableHandle

from ..patching import forward_hook, forward_pre_hook
from .codec import dequantize, narrow_int, quantize, tensor_nbytes, widen_int

HALF_BITS = 16
OFF_BITS = 32


class _Saved:
    """What autograd holds instead of a tensor: a compact payload and how to restore it."""

    __slots__ = ("payload", "decode", "shape", "__weakref__")

    def __init__(
        self, payload: object, decode: Callable[[object], torch.Tensor], shape: torch.Size
    ):
        self.payload = payload
        self.decode = decode
        self.shape = shape

    @property
    def nbytes(self) -> int:
        payload = self.payload
        return tensor_nbytes(payload) if isinstance(payload, torch.Tensor) else payload.nbytes


def _alias_key(t: torch.Tensor) -> tuple:
    """Identity of the saved data: contiguous views of the same elements share one key."""
    where = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, t._version)
    if t.is_contiguous():
        return (*where, t.numel())
    return (*where, tuple(t.shape), t.stride())


def _reshaped(shape: torch.Size) -> Callable[[object], torch.Tensor]:
    return lambda saved: saved.decode(saved.payload).view(shape)


def _from_half(dtype: torch.dtype) -> Callable[[object], torch.Tensor]:
    return lambda half: half.to(dtype)


@dataclass
class SavedStats:
    """Byte counts of what the hooks handled.

    ``held_bytes`` is live: compact payloads still referenced by autograd (freed after backward).
    ``forward_original``/``forward_stored`` cover the tensors saved during the last forward pass
    (every saved tensor that reached the hooks: compressed or kept as it is; parameters excluded).
    """

    held_bytes: int = 0
    forward_original: int = 0
    forward_stored: int = 0
    forward_tensors: int = 0

    def _release(self, nbytes: int) -> None:
        self.held_bytes -= nbytes

    @property
    def forward_ratio(self) -> float:
        """Uncompressed ÷ stored bytes of the last forward pass (1.0 when nothing was saved)."""
        return self.forward_original / self.forward_stored if self.forward_stored else 1.0


class CompressionHooks:
    """Installs per-module saved-tensor hooks and packs what autograd saves inside them.

    Args:
        bits_of: current bits of a module fqn (read at every call, so escalation acts at once).
        group_size, stochastic, min_numel: codec settings (see ``quantize`` in the config).
    """

    def __init__(
        self,
        bits_of: Callable[[str], int],
        *,
        group_size: int,
        stochastic: bool,
        min_numel: int,
    ):
        self.bits_of = bits_of
        self.group_size = group_size
        self.stochastic = stochastic
        self.min_numel = min_numel
        self.stats = SavedStats()
        self._handles: list[RemovableHandle] = []
        self._local = threading.local()
        self._cache: dict[tuple, tuple[weakref.ref, weakref.ref]] = {}
        self._skip_ptrs: frozenset[int] = frozenset()
        self._root: nn.Module | None = None

    # ----------------------------------------------------------------- installation
    def install(self, root: nn.Module, fqns: list[str]) -> None:
        """Give every module in ``fqns`` (names within ``root``) a compression scope."""
        self._root = root
        modules = dict(root.named_modules())
        for fqn in fqns:
            module = modules[fqn]
            self._handles.append(forward_pre_hook(module, self._enter_hook(fqn)))
            self._handles.append(forward_hook(module, self._exit_hook, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._cache.clear()
        self._root = None

    # ----------------------------------------------------------------- suspension
    @property
    def _scopes(self) -> list:
        scopes = getattr(self._local, "scopes", None)
        if scopes is None:
            scopes = self._local.scopes = []
        return scopes

    @property
    def suspended(self) -> bool:
        return getattr(self._local, "suspended", 0) > 0

    @contextmanager
    def suspend(self) -> Iterator[None]:
        """No compression inside (recompute regions, the exact pass of the drift check)."""
        self._local.suspended = getattr(self._local, "suspended", 0) + 1
        try:
            yield
        finally:
            self._local.suspended -= 1

    # ----------------------------------------------------------------- module hooks
    def _begin(self) -> None:
        """The outermost scope opens. Nothing held from an earlier forward means a new step:
        restart the per-forward counts and refresh the parameters' addresses (they may have
        moved to another device or dtype since apply)."""
        if self.stats.held_bytes == 0 and self._root is not None:
            root = self._root
            self._skip_ptrs = frozenset(
                t.untyped_storage().data_ptr()
                for t in (*root.parameters(), *root.buffers())
                if t.numel() > 0
            )
            self.stats.forward_original = 0
            self.stats.forward_stored = 0
            self.stats.forward_tensors = 0

    def _enter_hook(self, fqn: str) -> Callable:
        def enter(module: nn.Module, args: object) -> None:
            if not self._scopes:
                self._begin()
            scope = None
            if torch.is_grad_enabled() and not self.suspended:
                bits = self.bits_of(fqn)
                scope = saved_tensors_hooks(lambda t: self.pack(t, bits), self.unpack)
                scope.__enter__()
            self._scopes.append(scope)

        return enter

    def _exit_hook(self, module: nn.Module, args: object, output: object) -> None:
        scopes = self._scopes
        if scopes:
            scope = scopes.pop()
            if scope is not None:
                scope.__exit__(None, None, None)
            if not scopes:
                self._cache.clear()  # the outermost scope closed: dedup spans one forward

    # ----------------------------------------------------------------- pack / unpack
    def _keep_as_is(self, t: torch.Tensor) -> bool:
        if isinstance(t, nn.Parameter) or t.numel() < self.min_numel:
            return True
        storage = t.untyped_storage()
        if storage.data_ptr() in self._skip_ptrs:
            return True  # a parameter, a buffer, or a view of one
        if storage.nbytes() < tensor_nbytes(t):
            return True  # a broadcast (expanded) view: smaller as it is than any copy
        grad_fn = t.grad_fn
        if grad_fn is not None and grad_fn.name() == "ToCopyBackward0":
            # autocast's cast copy of a parameter: cached and shared, compressing it saves nothing
            source = grad_fn.next_functions[0][0]
            return source is not None and type(source).__name__ == "AccumulateGrad"
        return False

    def pack(self, t: torch.Tensor, bits: int) -> object:
        """Return what autograd keeps for ``t`` under ``bits``: ``t`` itself or a compact copy."""
        if self._keep_as_is(t):
            return t
        key = _alias_key(t)
        hit = self._cache.get(key)
        # The cached tensor being alive proves its storage is, so the address is not a reused one.
        if hit is not None and hit[0]() is not None:
            saved = hit[1]()
            if saved is not None:  # saved earlier in this forward (maybe as another view): once
                return (
                    saved if saved.shape == t.shape else _Saved(saved, _reshaped(t.shape), t.shape)
                )
        saved = self._compress(t, bits)
        stats = self.stats
        original = tensor_nbytes(t)
        stats.forward_original += original
        stats.forward_tensors += 1
        if saved is t:
            stats.forward_stored += original
            return t
        nbytes = saved.nbytes
        stats.forward_stored += nbytes
        stats.held_bytes += nbytes
        weakref.finalize(saved, stats._release, nbytes)
        self._cache[key] = (weakref.ref(t), weakref.ref(saved))
        return saved

    def _compress(self, t: torch.Tensor, bits: int) -> object:
        if not t.is_floating_point():
            if t.dtype == torch.bool or t.is_complex():
                return t
            narrowed = narrow_int(t)
            return t if narrowed is t else _Saved(narrowed, widen_int, t.shape)
        if bits >= OFF_BITS:
            return t
        # Detached, so that nothing below records autograd history.
        if bits == HALF_BITS:
            if t.element_size() <= 2:
                return t
            return _Saved(t.detach().to(torch.bfloat16), _from_half(t.dtype), t.shape)
        packed = quantize(t.detach(), bits, group_size=self.group_size, stochastic=self.stochastic)
        return _Saved(packed, dequantize, t.shape)

    @staticmethod
    def unpack(saved: object) -> torch.Tensor:
        if isinstance(saved, _Saved):
            return saved.decode(saved.payload)
        return saved
