"""What autograd holds for a tensor the compression hooks packed, and how it comes back.

:class:`_Saved` is a compact payload with its decoder, the original's version counter (checked
at unpack, as autograd does for tensors it saves itself) and the shared-decode bookkeeping of a
tensor several nodes in a row read; :class:`_Kept` is a tensor kept as it is, with its version.
The decoders restore each tensor's shape and strides (:func:`_decoded_strides`).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Protocol

import torch

from ..buffers import mark_private, shared_until_written, sole_holder
from ..config import OFF_BITS
from ..measure.storage import storage_key
from .codec import decode_mask, dequantize, tensor_nbytes
from .codec.ops import laid_out
from .codec.traced import memory_order


def _check_version(t: torch.Tensor | None, version: int) -> None:
    """Autograd's in-place check, which it skips for tensors saved through hooks: raise as torch
    does when ``t`` (or a view sharing its version counter) changed since it was saved."""
    if t is not None and t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; "
            f"expected version {version} instead. (memopt saved it for backward through its "
            "saved-tensor hooks; the same change raises without memopt.)"
        )


class _Changed:
    """What :func:`_check_version` reads of an original seen changed (it may be gone since)."""

    def __init__(self, shape: torch.Size, version: int):
        self.shape = shape
        self._version = version

    def type(self) -> str:
        return "tensor"


class _Kept:
    """A tensor autograd keeps as it is, with its version when saved (:func:`_check_version`)."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor):
        self.tensor = t
        self.version = t._version


#: Per thread (autograd runs each device's backward on a thread of its own): the :class:`_Saved`
#: whose decoded tensor is held for its next consumers, held weakly. One at a time, so a copy
#: outlives its consumers by at most the next shared decode.
_HOLDING = threading.local()


class _Meter(Protocol):
    """What counts the bytes autograd still holds (:class:`.stats.SavedStats`)."""

    def _release(self, nbytes: int) -> None: ...


class _Saved:
    """What autograd holds instead of a tensor: a compact payload and how to restore it, and
    the original's version counter (through its base, held weakly) to check at unpack.

    ``consumers``: the saves in a row of the same tensor that hold it (a layer norm's output
    saved by the query, key and value projections; the log-probabilities by the log-softmax and
    the NLL loss). Their nodes run one after another in backward, so the first decode is held
    for the rest (:meth:`value`) instead of decoding, and allocating, once per node.

    The copy the dedup cache hands out (its first saver's) is shared by every saver of the
    tensor, kept at the most precise width any of them asks for
    (:meth:`CompressionHooks._keep_at`): ``bits`` is the width it decodes to (``OFF_BITS``:
    losslessly), ``kept`` says its payload is the original itself, and ``scope`` names the scope
    whose counts hold its bytes (``counted``: whether the forward's counts hold them at all)."""

    __slots__ = (
        "payload", "decode", "shape", "source", "version", "changed", "consumers", "held", "taken",
        "shares", "bits", "kept", "counted", "scope", "meter", "charged", "__weakref__",
    )  # fmt: skip

    def __init__(
        self,
        payload: object,
        decode: Callable[[object], torch.Tensor],
        shape: torch.Size,
        bits: int = OFF_BITS,
    ):
        self.payload = payload
        self.decode = decode
        self.shape = shape
        self.source: weakref.ref | None = None
        self.version = 0
        self.changed: int | None = None  # the version the original was seen at, when changed
        self.consumers = 1
        self.held: torch.Tensor | None = None
        self.taken = 0  # consumers that took a decode in this backward
        self.shares = False  # decodes through another's value(), which decides if it is private
        self.bits = bits
        self.kept = False
        self.counted = False
        self.scope: str | None = None
        self.meter: _Meter | None = None
        self.charged = 0  # bytes counted against the meter while this lives

    def charge(self, meter: _Meter, nbytes: int) -> None:
        """Count ``nbytes`` (maybe fewer than 0) against ``meter`` until this is freed, which
        then releases them: no finalizer object per saved tensor."""
        self.meter = meter
        self.charged += nbytes

    def __del__(self) -> None:
        if self.charged:
            self.meter._release(self.charged)

    def watch(self, t: torch.Tensor) -> _Saved:
        """Check at unpack that ``t`` was not changed in place since (views share its base's
        version counter). Only a live original can be read: it is looked at when the forward
        ends (:meth:`look`) and at unpack, so a change to a tensor dropped before the forward
        ended goes unseen."""
        self.source = weakref.ref(t._base if t._base is not None else t)
        self.version = t._version
        return self

    def look(self) -> None:
        """Note a change of the original, while it is alive, for the check at unpack."""
        source = self.source() if self.source is not None else None
        if source is not None and source._version != self.version:
            self.changed = source._version

    def check(self) -> None:
        self.look()
        if self.changed is not None:
            _check_version(_Changed(self.shape, self.changed), self.version)

    def fresh(self) -> torch.Tensor:
        """A decode of its own, for a consumer not counted in :attr:`consumers`."""
        return self.decode(self.payload)

    def value(self) -> torch.Tensor:
        """The decoded tensor for one of its counted consumers: for the last (or only) one,
        marked as one its node may overwrite (:func:`mark_private`) where nothing else holds
        it; else held for the next, unless its node takes it over to write into
        (:func:`shared_until_written`). The original itself (:attr:`kept`, here or in the copy
        this one decodes through) is neither: the model may hold it still."""
        payload = self.payload
        if self.kept or (type(payload) is _Saved and payload.kept):
            return self.fresh()
        self.taken += 1
        last = self.taken == self.consumers
        if last:
            self.taken = 0  # a further backward (retain_graph) starts again
        out, self.held = self.held, None
        if out is not None:  # held for the earlier consumers: private once they let go of it
            if last:
                return mark_private(out) if sole_holder(out) else out
        else:
            out = self.fresh()
            if last:
                return out if self.shares else mark_private(out)
        previous = getattr(_HOLDING, "saved", None)
        previous = previous() if previous is not None else None
        if previous is not None:
            previous.held = None
        self.held = out
        _HOLDING.saved = weakref.ref(self)
        shared_until_written(out, functools.partial(_let_go, weakref.ref(self), _address(out)))
        return out

    @property
    def nbytes(self) -> int:
        payload = self.payload
        return tensor_nbytes(payload) if isinstance(payload, torch.Tensor) else payload.nbytes

    def take(self, other: _Saved) -> None:
        """Decode what ``other`` (a copy of the same tensor, made since) keeps from now on."""
        self.payload, self.decode, self.bits = other.payload, other.decode, other.bits
        self.held, self.taken = None, 0


def _original(t: torch.Tensor) -> torch.Tensor:
    return t


def _no_copy() -> None:
    """The dedup cache's copy of a tensor kept as it is: none (a dead reference's answer)."""
    return None


def _address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _let_go(ref: weakref.ref, address: int) -> bool:
    """The :class:`_Saved` behind ``ref`` stops holding its decode at ``address`` for later
    consumers (they decode their own); whether it held it. Weak and by address: the storage
    keeps this function, which must not keep the storage."""
    saved = ref()
    if saved is None or saved.held is None or _address(saved.held) != address:
        return False
    saved.held = None
    return True


def _alias_key(t: torch.Tensor) -> tuple | None:
    """Identity of the saved data: dense views of the same memory share one key, whatever their
    shape or dim order (attention's output as SDPA saves it, heads apart, and as the output
    projection saves it, heads side by side)."""
    storage = storage_key(t)
    if storage is None:
        return None
    where = (storage, t.storage_offset(), t.dtype, t._version)
    if t.is_contiguous() or memory_order(t) is not None:
        return (*where, t.numel())
    return (*where, tuple(t.shape), t.stride())


def _relaid(
    t: torch.Tensor, first: tuple[int, ...], shared: bool
) -> Callable[[object], torch.Tensor]:
    """Decodes what was saved for another dense view of ``t``'s memory, whose strides were
    ``first``, into ``t``'s shape and strides: laid out as that view was (the memory they
    share), then viewed as ``t``. ``shared``: as one of that save's counted consumers
    (:meth:`_Saved.value`), else a decode of its own."""
    shape, stride = t.shape, t.stride()

    def decode(saved: _Saved) -> torch.Tensor:
        out = saved.value() if shared else saved.fresh()
        out = laid_out(out, first)
        return out.as_strided(shape, stride, out.storage_offset())

    return decode


def _from_half(t: torch.Tensor) -> Callable[[object], torch.Tensor]:
    dtype, stride = t.dtype, _decoded_strides(t)
    return lambda half: laid_out(half.to(dtype), stride)  # .to keeps dense layouts


def _decoder(t: torch.Tensor) -> Callable[[object], torch.Tensor]:
    """Decodes a :class:`PackedTensor` of ``t`` into a tensor of ``t``'s size and layout (see
    :func:`_decoded_strides`): :func:`dequantize` itself where that is the layout it gives (a
    contiguous tensor without size-1 dims, whose strides are then the standard ones; most
    saves), else with ``t``'s strides bound (no closure per saved tensor)."""
    if t.is_contiguous() and 1 not in t.shape:
        return dequantize
    return functools.partial(_decode_strided, _decoded_strides(t))


def _mask_decoder(t: torch.Tensor) -> Callable[[object], torch.Tensor]:
    """Decodes a :class:`~.codec.MaskTensor` of contiguous ``t`` with ``t``'s strides (a size-1
    dim's may be any), as :func:`_decoder` decodes."""
    if 1 not in t.shape:
        return decode_mask
    stride = t.stride()
    return lambda mask: laid_out(decode_mask(mask), stride)


def _decode_strided(stride: tuple[int, ...], packed: object) -> torch.Tensor:
    return dequantize(packed, stride)  # decoded into that layout (no copy into it after)


def _decoded_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides a decoded ``t`` gets: its own where it is dense (a transpose, a permutation,
    a size-1 dim's odd stride), else dense strides in its own dim order. A slice with gaps --
    attention's query, key and value, each a third of one projection's output -- would
    otherwise decode into a buffer the size of the whole projection: three times the bytes,
    alive together in attention's backward. Eager backward formulas take any strides."""
    if t.is_contiguous():  # most saves: no sort (this runs for every compressed tensor)
        return t.stride()
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -d))
    dense, step = [0] * t.dim(), 1
    for d in reversed(order):
        dense[d] = step
        step *= t.shape[d]
    dense = tuple(dense)
    same = all(s == d or n == 1 for s, d, n in zip(t.stride(), dense, t.shape, strict=True))
    return t.stride() if same else dense


def _strided(out: torch.Tensor, stride: tuple | None) -> torch.Tensor:
    """``out`` (contiguous) with the strides of the tensor it was decoded for (``None``: as it
    is)."""
    if stride is None:
        return out
    return torch.empty_strided(out.shape, stride, dtype=out.dtype, device=out.device).copy_(out)
