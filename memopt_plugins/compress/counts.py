"""The compression hooks' counting observer: what each forward kept, per scope and per step.

The hooks pack and unpack; everything they are counted by lives here, told of each event
(:class:`~.hooks.SaveCounter`): the per-forward byte counts (:class:`~.stats.SavedStats`), the
per-scope counts the budget prices (:class:`~.stats.ModuleSaved`), the compiled graphs' counts
at each forward's end, and the step-peak meter (:class:`~memopt_plugins.measure.process.StepPeak`).
A step begins at the first forward after the training loop's step (:meth:`end_step`), or, in a
loop that counts no steps, at one with nothing held from an earlier forward.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext

import torch

from ..config import OFF_BITS
from ..measure.process import StepPeak
from .saved import _Saved
from .stats import ModuleSaved, SavedStats


class SavedCounts:
    """Counts of what the compression hooks kept, fed by their events."""

    def __init__(self) -> None:
        self.stats = SavedStats()
        self.memory: StepPeak | None = None  # told of each training forward's start and end
        self.step_ended = False  # the training loop took a step since the last forward began

    # ----------------------------------------------------------------- forwards and steps
    def starts_step(self) -> bool:
        """A training forward's outermost scope opens: whether it starts a new step (its counts
        restart; the caller refreshes what it knows of the model's storages)."""
        if not (self.step_ended or self.stats.held_bytes == 0):
            return False
        self.step_ended = False
        self.stats.start_forward()
        if self.memory is not None:
            self.memory.start(self.stats.held_bytes)
        return True

    def forward_done(self, compiled: Mapping[object, tuple[int, int]]) -> None:
        """The outermost scope closed; ``compiled``: what compiled graphs saved in it."""
        self.stats.add_compiled(compiled)
        if self.memory is not None and torch.is_grad_enabled():
            self.memory.forward_done(self.stats.held_bytes)

    def end_step(self) -> None:
        """The training loop took a step: the next forward starts the step's counts afresh."""
        self.step_ended = True
        if self.memory is not None:
            self.memory.finish()

    def paused(self) -> object:
        """A context in which forwards are no training step's (the step-peak meter waits)."""
        return self.memory.paused() if self.memory is not None else nullcontext()

    # ----------------------------------------------------------------- saved tensors
    def unencodable(self, kind: str) -> bool:
        """A saved tensor the codec cannot take, of ``kind``: whether it is the first of it."""
        seen = self.stats.unencodable.get(kind, 0)
        self.stats.unencodable[kind] = seen + 1
        return not seen

    def saved(
        self,
        t: torch.Tensor,
        saved: _Saved | torch.Tensor,
        nbytes: int,
        scope: str | None,
        bits: int,
    ) -> None:
        """``t`` (``original`` bytes) was saved in ``scope`` as ``saved``, ``nbytes`` bytes:
        ``t`` itself, or a compact copy whose bytes are held until autograd lets it go."""
        stats = self.stats
        original = t.numel() * t.element_size()
        stats.forward_original += original
        stats.forward_tensors += 1
        stats.forward_stored += nbytes
        # a lossless copy (an integer tensor narrowed, a mask as bits) is the same at every width
        fixed = not t.is_floating_point() or (saved is not t and saved.bits >= OFF_BITS)
        self._count_module(scope, t, original, nbytes, fixed)
        if saved is t:
            if bits < OFF_BITS:  # asked to compress: the codec keeps it exactly (ints, bools)
                stats.keep_whole(scope, str(t.dtype).removeprefix("torch."), original)
            return
        stats.held_bytes += nbytes
        saved.charge(stats, nbytes)  # released when autograd lets it go

    def resaved(
        self, saved: _Saved, view: torch.Tensor, moved: tuple[str | None, int] | None,
        stored: int, held: int, scope: str | None,
    ) -> None:  # fmt: skip
        """The shared copy ``saved`` of ``view`` was made again (``stored`` bytes, ``held`` of
        them held); ``moved``: the scope and bytes it was counted at before (``None``: never
        counted), taken out of that scope's counts; now in ``scope``'s."""
        stats = self.stats
        original = view.numel() * view.element_size()
        before = 0
        if moved is not None:
            before_scope, before = moved
            self._uncount_module(before_scope, view, original, before)
        else:
            stats.forward_original += original
            stats.forward_tensors += 1
        stats.forward_stored += stored - before
        if held != before:
            stats.held_bytes += held - before
            saved.charge(stats, held - before)
        self._count_module(scope, view, original, stored, not view.is_floating_point())

    def _count_module(
        self, fqn: str | None, t: torch.Tensor, original: int, stored: int, fixed: bool
    ) -> None:
        """Add ``t`` to scope ``fqn``'s counts (:attr:`SavedStats.modules`; ``None``: none):
        ``fixed``, bytes no bit width changes, else a floating tensor its bits act on."""
        if fqn is None:
            return
        saved = self.stats.modules.get(fqn)
        if saved is None:
            saved = self.stats.modules[fqn] = ModuleSaved()
        saved.original += original
        saved.stored += stored
        if fixed:
            saved.fixed += stored
        else:
            saved.floats.append((t.numel(), t.element_size()))

    def _uncount_module(self, fqn: str | None, t: torch.Tensor, original: int, stored: int) -> None:
        """Take ``t`` out of scope ``fqn``'s counts (its copy moved to another scope's bits); a
        scope left with nothing is dropped."""
        saved = self.stats.modules.get(fqn) if fqn is not None else None
        if saved is None:
            return
        saved.original -= original
        saved.stored -= stored
        if t.is_floating_point():
            saved.floats.remove((t.numel(), t.element_size()))
        else:
            saved.fixed -= stored
        if not saved.original:
            del self.stats.modules[fqn]

    # ----------------------------------------------------------------- around extra passes
    @contextmanager
    def set_aside(self) -> Iterator[tuple[Mapping[str, ModuleSaved], int]]:
        """Inside, forwards are no training step's: on leaving, the per-forward counts, the
        per-scope counts and whether a step ended are as on entering. Yields the per-scope counts
        of the last training forward and its saved bytes; inside, scopes count afresh."""
        kept, modules, step_ended = self.stats.snapshot(), self.stats.modules, self.step_ended
        trained = self.stats.saved_original
        self.stats.modules = {}
        try:
            with self.paused():
                yield modules, trained
        finally:
            self.stats.restore(kept)
            self.stats.modules = modules
            self.step_ended = step_ended

    def take_modules(self) -> dict[str, ModuleSaved]:
        """The per-scope counts so far; the next forward's start afresh."""
        found, self.stats.modules = self.stats.modules, {}
        return found
