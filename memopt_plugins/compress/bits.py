"""The bit table: how many bits each module's saved tensors get, owned by the engine.

The compression hooks read it through :meth:`BitTable.bits_of` at every module entry, so a change
(an escalation, a restored checkpoint) acts from the next forward of that module on.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping

from ..config import OFF_BITS, checked_bits
from ..select import parent_fqns


class BitTable:
    """Bits of every module with a compression scope.

    * ``scopes``: every module with a scope and the bits its scope packs at (a scope at
      :data:`OFF_BITS` shields its subtree from a compressing ancestor); the hooks read these.
    * :attr:`compressed`: the modules the optimizer reports and escalates (``opt.bits``), at the
      bits set for them: scopes installed below 32 bits (one escalated or restored to 32 stays
      listed), less those *parked* because they lie inside a recompute region now (recompute
      wins; they come back when it ends).

    A recomputed module's scope (a *boundary*) holds only what is saved outside its region: the
    checkpoint's boundary input. It packs at the more precise of the module's own bits and its
    enclosing scope's (none: nothing compressed), so an excluded or 32-bit recomputed module keeps
    its input exact, and :meth:`set` on either reaches it.
    """

    def __init__(self) -> None:
        self.scopes: dict[str, int] = {}
        self._own: dict[str, int] = {}  # the bits installed or set per scope
        self._listed: list[str] = []
        self._parked: frozenset[str] = frozenset()
        self._boundaries: frozenset[str] = frozenset()
        #: Counts changes of the scopes' bits: a compiled graph holds the bits of one version.
        self.version = 0

    def install(self, scopes: Mapping[str, int]) -> None:
        """Take the scopes resolved from the config (a checkpoint's bits are set after)."""
        self._own = {f: int(b) for f, b in scopes.items()}
        self._listed = [f for f, b in self._own.items() if b < OFF_BITS]
        self._parked = self._boundaries = frozenset()
        self._derive(changed=True)

    def clear(self) -> None:
        """Forget every scope (the model was unpatched)."""
        self._own = {}
        self._listed = []
        self._parked = self._boundaries = frozenset()
        self._derive(changed=True)

    def bits_of(self, fqn: str) -> int:
        """The bits of the scope of module ``fqn``."""
        return self.scopes[fqn]

    @property
    def compressed(self) -> dict[str, int]:
        """``{fqn: bits}`` of the compressed modules (a copy)."""
        return {f: self._own[f] for f in self._listed if f not in self._parked}

    def set(self, fqn: str, bits: int) -> None:
        """Change the bits of one compressed module (``ValueError`` for a width memopt has not)."""
        bits = checked_bits(bits)
        if fqn not in self._listed or fqn in self._parked:
            raise KeyError(
                f"{fqn!r} is not a compressed module; compressed: {sorted(self.compressed)}"
            )
        if self._own[fqn] != int(bits):
            self._own[fqn] = int(bits)
            self._derive()

    def park(self, inside: Container[str], boundaries: Iterable[str] = ()) -> None:
        """The recompute regions now: compressed modules ``inside`` them are parked (the others
        come back), and the scopes of the recomputed modules themselves (``boundaries``) pack
        their boundary input only (see the class docstring)."""
        self._parked = frozenset(f for f in self._listed if f in inside)
        self._boundaries = frozenset(f for f in boundaries if f in self._own)
        self._derive()

    def _derive(self, changed: bool = False) -> None:
        """Set :attr:`scopes` from the bits set; a change bumps :attr:`version`."""
        scopes = dict(self._own)
        for fqn in self._boundaries:
            # regions never nest, so the enclosing scope is no boundary: its own bits hold
            enclosing = next((p for p in parent_fqns(fqn) if p in self._own), None)
            outer = self._own[enclosing] if enclosing is not None else OFF_BITS
            scopes[fqn] = max(self._own[fqn], outer)
        if changed or scopes != self.scopes:
            self.version += 1
        self.scopes = scopes
