"""What a drift check is handed: the sample it runs, the narrow face of compression it may use,
and how its decisions are made alike on every rank.

The monitor knows nothing of how compression works: :class:`CompressionFace` is all it sees of
it (the bits, a way to change them, a context that suspends compression, ...). The engine builds
one :class:`DriftCheck` per check (:meth:`~memopt_plugins.engine.MemoryOptimizer.check_drift`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from ..distributed import max_over_ranks
from .budget import Pricing


@dataclass(frozen=True)
class CompressionFace:
    """What a check may do to compression, and no more.

    Attributes:
        bits: ``{fqn: bits}`` of the compressed modules.
        set_bits: changes the bits of one module (takes effect at its next forward).
        suspend: a context in which nothing is compressed.
        as_training: ``as_training((samples, batch))``: a context in which compression keeps or
            compresses each tensor saved on the check's samples as it does its counterpart in a
            training forward on ``batch`` samples (``None``: by its own size against
            ``min_numel``).
        generators: private generators the compressed pass draws from (stochastic rounding);
            restored after the check so that training is unaffected.
        scopes: every module with a compression scope (default: those in ``bits``), so that a
            tensor saved inside a 32-bit scope is not counted for a compressed ancestor.
        min_numel: saved tensors smaller than this in a training forward are not compressed
            (judged at the training batch's size with :attr:`CheckSample.batch_size`).
    """

    bits: Mapping[str, int]
    set_bits: Callable[[str, int], None]
    suspend: Callable[[], AbstractContextManager]
    as_training: Callable[[tuple[int, int] | None], AbstractContextManager] | None = None
    generators: Sequence[torch.Generator] = ()
    scopes: Sequence[str] | None = None
    min_numel: int = 0


@dataclass(frozen=True)
class CheckSample:
    """The loss a check's passes run, and the training batch its sample was cut from.

    Attributes:
        model: the patched model (the one ``loss_fn`` runs; see :mod:`memopt_plugins.drift`
            on DDP).
        loss_fn: ``loss_fn() -> scalar loss`` on a small batch; called once exact and once per
            round compressed.
        batch_size: samples in the training batch the sample was cut from (metric ``sgd``, and
            the size saved tensors are judged at; default: the sample's own).
        cut: ``cut(n)``: the loss on equal pieces of at most ``n`` samples of the sample
            (:func:`~.passes.cut_sample`), run in turn by every pass in place of ``loss_fn``, so
            that no pass holds more than a piece's activations; ``most``: that ``n``
            (:func:`~.passes.piece_samples`, the least over ranks is taken).
    """

    model: nn.Module
    loss_fn: Callable[[], torch.Tensor]
    batch_size: int | None = None
    cut: Callable[[int], Sequence[Callable[[], torch.Tensor]]] | None = None
    most: int = 0


@dataclass(frozen=True)
class DriftCheck:
    """One check, as the engine hands it to :meth:`~.monitor.DriftMonitor.check`.

    Attributes:
        sample: what its passes run.
        face: what it may do to compression.
        step: the step recorded in the report (default: the counted optimizer steps).
        max_rounds: compressed passes at most; ``None`` re-checks until no module escalates,
            ``1`` escalates at most one rung per call.
        pricing: ``quantize.budget``/``memory``: called after the first compressed pass, what
            each module keeps at each width and the target (:class:`~.budget.Pricing`;
            ``None``: not known yet); the bits are then solved for it
            (:meth:`~.decide.Decision.fit_budget`).
        reduce_max: element-wise max over ranks of a float64 tensor (the integration's reduce;
            identity without torch.distributed).
        speaks: whether this process writes the check's lines (default: the monitor's).
    """

    sample: CheckSample
    face: CompressionFace
    step: int | None = None
    max_rounds: int | None = None
    pricing: Callable[[], Pricing | None] | None = None
    reduce_max: Callable[[torch.Tensor], torch.Tensor] = max_over_ranks
    speaks: Callable[[], bool] | None = None
