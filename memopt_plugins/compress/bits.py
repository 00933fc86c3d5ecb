"""The bit table: how many bits each module's saved tensors get, owned by the engine.

The compression hooks read it through :meth:`BitTable.bits_of` at every module entry, so a change
(an escalation, a restored checkpoint) acts from the next forward of that module on.
"""

from __future__ import annotations

from collections.abc import Container, Mapping

from ..config import OFF_BITS, checked_bits


class BitTable:
    """Bits of every module with a compression scope.

    * ``scopes``: every module with a scope and its bits (a scope at :data:`OFF_BITS` shields its
      subtree from a compressing ancestor); the hooks read these.
    * :attr:`compressed`: the modules the optimizer reports and escalates (``opt.bits``): scopes
      installed below 32 bits (one escalated or restored to 32 stays listed), less those *parked*
      because they lie inside a recompute region now (recompute wins; they come back when it ends).
    """

    def __init__(self) -> None:
        self.scopes: dict[str, int] = {}
        self._listed: list[str] = []
        self._parked: frozenset[str] = frozenset()
        #: Counts changes of the scopes' bits: a compiled graph holds the bits of one version.
        self.version = 0

    def install(self, scopes: Mapping[str, int]) -> None:
        """Take the scopes resolved from the config (a checkpoint's bits are set after)."""
        self.scopes = {f: int(b) for f, b in scopes.items()}
        self._listed = [f for f, b in self.scopes.items() if b < OFF_BITS]
        self._parked = frozenset()
        self.version += 1

    def clear(self) -> None:
        """Forget every scope (the model was unpatched)."""
        self.scopes = {}
        self._listed = []
        self._parked = frozenset()
        self.version += 1

    def bits_of(self, fqn: str) -> int:
        """The bits of the scope of module ``fqn``."""
        return self.scopes[fqn]

    @property
    def compressed(self) -> dict[str, int]:
        """``{fqn: bits}`` of the compressed modules (a copy)."""
        return {f: self.scopes[f] for f in self._listed if f not in self._parked}

    def set(self, fqn: str, bits: int) -> None:
        """Change the bits of one compressed module (``ValueError`` for a width memopt has not)."""
        bits = checked_bits(bits)
        if fqn not in self._listed or fqn in self._parked:
            raise KeyError(
                f"{fqn!r} is not a compressed module; compressed: {sorted(self.compressed)}"
            )
        if self.scopes[fqn] != int(bits):
            self.scopes[fqn] = int(bits)
            self.version += 1

    def park(self, inside: Container[str]) -> None:
        """Compressed modules ``inside`` recompute regions are parked; the others come back."""
        self._parked = frozenset(f for f in self._listed if f in inside)
