"""Byte counts of what the compression hooks saved: per forward, per scope, per compiled graph."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .estimate import stored_nbytes


@dataclass
class ModuleSaved:
    """What one compression scope saved in a forward (its innermost-scope tensors, counted once).

    ``original``/``stored``: bytes before and after the hooks. ``fixed``: the stored bytes no bit
    width changes (integer and bool tensors). ``floats``: ``(numel, element_size)`` of each
    floating tensor the scope's bits act on, so its bytes at another width follow from the codec
    (:meth:`bytes_at`).
    """

    original: int = 0
    stored: int = 0
    fixed: int = 0
    floats: list[tuple[int, int]] = field(default_factory=list)

    def bytes_at(self, bits: int, group_size: int) -> int:
        """The bytes this scope would have stored at ``bits`` (the codec's packed sizes)."""
        return self.fixed + sum(stored_nbytes(n, e, bits, group_size) for n, e in self.floats)


@dataclass
class SavedStats:
    """Byte counts of what the hooks handled.

    ``held_bytes`` is live: compact payloads still referenced by autograd (freed after backward).
    ``forward_original``/``forward_stored`` cover the tensors the eager hooks saw during the last
    forward pass (every saved tensor that reached them: compressed or kept as it is; parameters
    excluded). ``compiled`` holds, per compiled graph, the same two counts for what it saved in
    the last forward: the sizes its pack hooks were traced with (the graph packs inside, where
    nothing is counted) times the calls of the graph (one graph may serve every block), what it
    saves as it is included (:class:`.compiled.CompiledGraphs`); ``saved_original`` and
    ``saved_stored`` add both. ``modules`` holds the eager counts per compression scope
    (:class:`ModuleSaved`, each tensor under the innermost scope it was saved in) of the last
    forward; a compiled graph's modules are not in it.
    """

    held_bytes: int = 0
    forward_original: int = 0
    forward_stored: int = 0
    forward_tensors: int = 0
    compiled: dict[object, tuple[int, int]] = field(default_factory=dict)
    modules: dict[str, ModuleSaved] = field(default_factory=dict)
    #: saved tensors kept as they are because the codec cannot take them, per kind (a tensor
    #: subclass's name, a layout, "meta"), counted since apply
    unencodable: dict[str, int] = field(default_factory=dict)
    #: of the last forward's stored bytes, what the hooks kept as it is in a scope that asked
    #: for fewer bits (integer and bool tensors the codec keeps exactly, an op's workspace):
    #: ``{(scope, dtype): (tensors, bytes)}``
    kept_whole: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)

    def _release(self, nbytes: int) -> None:
        self.held_bytes -= nbytes

    def add_compiled(self, graphs: Mapping[object, tuple[int, int]]) -> None:
        """Add ``{graph: (original, stored)}``, what compiled graphs saved in this forward."""
        if not graphs:
            return
        compiled = dict(self.compiled)  # a new dict: a snapshot may hold the old one
        for graph, (original, stored) in graphs.items():
            before = compiled.get(graph, (0, 0))
            compiled[graph] = (before[0] + original, before[1] + stored)
        self.compiled = compiled

    def keep_whole(self, scope: str | None, dtype: str, nbytes: int) -> None:
        """Count ``nbytes`` stored as they were saved in ``scope`` (``None``: outside every
        scope), which asked to compress them (:attr:`kept_whole`)."""
        kept = dict(self.kept_whole)  # a new dict: a snapshot may hold the old one
        tensors, before = kept.get((scope or "", dtype), (0, 0))
        kept[(scope or "", dtype)] = (tensors + 1, before + nbytes)
        self.kept_whole = kept

    @property
    def kept_as_is(self) -> int:
        """Bytes of the last forward kept as they are where fewer bits were asked for."""
        return sum(nbytes for _, nbytes in self.kept_whole.values())

    def snapshot(self) -> tuple:
        """The per-forward counts, for :meth:`restore` (``held_bytes`` is live and not kept)."""
        return (
            self.forward_original,
            self.forward_stored,
            self.forward_tensors,
            self.compiled,
            self.kept_whole,
        )

    def restore(self, snapshot: tuple) -> None:
        """Put back per-forward counts taken by :meth:`snapshot` (after an extra pass)."""
        (
            self.forward_original,
            self.forward_stored,
            self.forward_tensors,
            self.compiled,
            self.kept_whole,
        ) = snapshot

    def start_forward(self) -> None:
        """A new forward begins: its counts start from zero."""
        self.restore((0, 0, 0, {}, {}))  # new dicts: these are replaced, never changed
        self.modules = {}  # a new dict: a snapshot holding the old one keeps it

    @property
    def saved_original(self) -> int:
        return self.forward_original + sum(original for original, _ in self.compiled.values())

    @property
    def saved_stored(self) -> int:
        return self.forward_stored + sum(stored for _, stored in self.compiled.values())

    @property
    def forward_ratio(self) -> float:
        """Uncompressed ÷ stored bytes of the last forward pass, compiled graphs included (1.0
        when nothing was saved)."""
        stored = self.saved_stored
        return self.saved_original / stored if stored else 1.0
