"""Compression as the engine and the drift check see it: one narrow object.

:class:`Compression` puts the saved-tensor hooks (:mod:`.hooks`) on a model and its counting
observer (:mod:`.counts`) beside them, and answers for both: suspend compression, treat passes as
a training batch's sample, set the counts aside around passes that are no training step's, end a
step, the rounding noise, and what the last training forward kept. Nothing else reaches into the
hooks' state.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import nn

from ..measure.process import StepPeak
from .bits import BitTable
from .codec import NoiseGenerators
from .counts import SavedCounts
from .hooks import CompressionHooks, PackObserver
from .stats import ModuleSaved, SavedStats


class Compression:
    """The compression scopes of one model and what they kept.

    Args:
        bits: the engine's bit table (read at every module entry).
        group_size, stochastic, min_numel: codec settings (see ``quantize`` in the config).
        noise: the generators stochastic rounding draws from.
    """

    def __init__(
        self,
        bits: BitTable,
        *,
        group_size: int,
        stochastic: bool,
        min_numel: int,
        noise: NoiseGenerators,
    ):
        self._counts = SavedCounts()
        self.hooks = CompressionHooks(
            bits,
            group_size=group_size,
            stochastic=stochastic,
            min_numel=min_numel,
            noise=noise,
            counter=self._counts,
        )
        self.noise = noise

    def install(
        self,
        model: nn.Module,
        fqns: Sequence[str],
        owner: object,
        device: Callable[[], torch.device],
    ) -> None:
        """Give every module in ``fqns`` a compression scope. ``owner`` lives as long as the
        hooks are on ``model``; ``device()``: where the model is now (the step-peak meter's)."""
        self.hooks.install(model, fqns)
        self.hooks.owner = owner
        self._counts.memory = StepPeak(device)

    def remove(self) -> None:
        self.hooks.remove()

    # ----------------------------------------------------------------- what the hooks do
    def suspend(self) -> AbstractContextManager[None]:
        """No compression inside (recompute regions, the exact pass of the drift check)."""
        return self.hooks.suspend()

    def as_training(self, sample: tuple[int, int] | None) -> AbstractContextManager[None]:
        """Saves inside are of ``sample`` = ``(samples, batch)``, cut from a training batch."""
        return self.hooks.as_training(sample)

    def observed(self, observer: PackObserver) -> AbstractContextManager[None]:
        """``observer`` is told of every tensor packed inside."""
        return self.hooks.observed(observer)

    # ----------------------------------------------------------------- what they kept
    @property
    def stats(self) -> SavedStats:
        """What the last training forward kept (read it; the hooks' counter writes it)."""
        return self._counts.stats

    @property
    def peak(self) -> int | None:
        """The last step's peak above its start (:attr:`.StepPeak.peak`)."""
        memory = self._counts.memory
        return memory.peak if memory is not None else None

    @property
    def peak_so_far(self) -> int | None:
        """The open step's peak so far, else the last step's (:attr:`.StepPeak.so_far`);
        ``None`` before :meth:`install`."""
        memory = self._counts.memory
        return memory.so_far if memory is not None else None

    @property
    def metered(self) -> bool:
        """Whether the step-peak meter runs (after :meth:`install`)."""
        return self._counts.memory is not None

    def end_step(self) -> None:
        """The training loop took a step: the next forward starts the step's counts afresh."""
        self._counts.end_step()

    def measure_afresh(self) -> None:
        """The next step is measured as the first (a new step-peak meter)."""
        memory = self._counts.memory
        if memory is not None:
            self._counts.memory = StepPeak(memory.device)

    @contextmanager
    def snapshot(self) -> Iterator[tuple[Mapping[str, ModuleSaved], int]]:
        """Around passes that are no training step's (the drift check's): on leaving, the counts
        and the step's state are as on entering. Yields the last training forward's per-scope
        counts and saved bytes; inside, the scopes count afresh (:meth:`take_modules`)."""
        with self._counts.set_aside() as kept:
            yield kept

    def take_modules(self) -> dict[str, ModuleSaved]:
        """The per-scope counts since the last call (or the forward's start); then afresh."""
        return self._counts.take_modules()


def device_of(model: nn.Module) -> Callable[[], torch.device]:
    """``device()``: where the model's first parameter is now (the CPU without one); holds the
    model weakly."""
    ref = weakref.ref(model)

    def device() -> torch.device:
        module = ref()
        first = next(module.parameters(), None) if module is not None else None
        return first.device if first is not None else torch.device("cpu")

    return device
