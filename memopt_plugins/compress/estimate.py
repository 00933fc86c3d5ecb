"""What compression stores, from sizes and bits alone: the prices of the memory target
(``quantize.budget``, ``quantize.memory``) and the planner's estimate.

:func:`stored_nbytes` is what the hooks store for one floating tensor at a bit width (the codec's
packed sizes, :func:`~.codec.packed_nbytes`); the budget prices each scope's saved tensors at every
width with it (:meth:`.stats.ModuleSaved.bytes_at`). The recompute planner (``recompute.auto``
and ``memopt plan``) chooses from a forward measured without compression; with compression on,
each storage it would keep costs what the hooks would store for it (:func:`storage_ratio`), not
its full size, so that recompute is only chosen for what compression leaves.
"""

from __future__ import annotations

from collections.abc import Callable

from ..config import HALF_BITS, OFF_BITS, QuantizeConfig
from ..measure.step import SavedStorage
from ..policy import compresses_storage
from .codec import mask_nbytes, packed_nbytes


def stored_nbytes(numel: int, element_size: int, bits: int, group_size: int) -> int:
    """What the hooks store for a floating tensor of ``numel`` elements at ``bits``."""
    if bits >= OFF_BITS or (bits == HALF_BITS and element_size <= 2):
        return numel * element_size
    if bits == HALF_BITS:
        return numel * 2
    return packed_nbytes(numel, bits, group_size)


def storage_ratio(bits: int, quantize: QuantizeConfig) -> Callable[[SavedStorage], float]:
    """Stored ÷ original bytes of each saved storage when the model compresses at ``bits``
    (1 for what the policy leaves as it is, :func:`memopt_plugins.policy.compresses_storage`; a
    bit an element for a mask)."""

    def ratio(s: SavedStorage) -> float:
        if bits >= OFF_BITS or not compresses_storage(s, quantize.min_numel):
            return 1.0
        original = s.numel * s.element_size
        if s.mask:
            return mask_nbytes(s.numel, s.element_size) / original
        return stored_nbytes(s.numel, s.element_size, bits, quantize.group_size) / original

    return ratio
