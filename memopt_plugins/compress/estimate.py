"""What compression would keep of a measured forward's saved storages: the planner's estimate.

The recompute planner (``recompute.auto`` and ``memopt plan``) chooses from a forward measured
without compression; with compression on, each storage it would keep costs what the codec stores
for it (:func:`~.codec.packed_nbytes`), not its full size, so that recompute is only chosen for
what compression leaves.
"""

from __future__ import annotations

from collections.abc import Callable

from ..config import HALF_BITS, OFF_BITS, QuantizeConfig
from ..measure import SavedStorage
from .codec import packed_nbytes


def storage_ratio(bits: int, quantize: QuantizeConfig) -> Callable[[SavedStorage], float]:
    """Stored ÷ original bytes of each saved storage when the model compresses at ``bits``.

    Only what the hooks would compress changes: floating tensors kept as they are, of at least
    ``min_numel`` elements, saved inside the model (a loss computed outside it is not).
    """

    def ratio(s: SavedStorage) -> float:
        if (
            bits >= OFF_BITS
            or not s.compressible
            or s.owner is None
            or s.numel < quantize.min_numel
        ):
            return 1.0
        original = s.numel * s.element_size
        if bits == HALF_BITS:
            return min(1.0, 2 / s.element_size)
        return packed_nbytes(s.numel, bits, quantize.group_size) / original

    return ratio
