"""Which gradient judges each compressed module, and its drift from the two passes' gradients."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..measure.storage import is_sharded
from .passes import CheckedParameters, PassGradients, PassRecorder
from .report import (
    CALLS_DIFFER,
    DISTRIBUTED_PARAMETERS,
    NEGLIGIBLE_GRADIENT,
    NEGLIGIBLE_NOISE,
    NOTHING_TO_JUDGE,
    SAVES_NOTHING,
)

#: Drift slot of a module without measurable drift (a max over ranks ignores it).
UNMEASURED = -1.0
#: What a judge's indices point at: parameters, or recorded activation tensors.
PARAMS, TENSORS = "parameters", "tensors"


@dataclass(frozen=True)
class Judge:
    """Which gradients judge a module: indices into a pass's target list."""

    kind: str  # PARAMS or TENSORS
    indices: tuple[int, ...]


def find_judges(
    fqns: Sequence[str], checked: CheckedParameters, rec: PassRecorder
) -> tuple[dict[str, Judge], dict[str, str]]:
    """What judges each module (see :mod:`memopt_plugins.drift`), from the exact pass's record."""
    judges: dict[str, Judge] = {}
    unmeasured: dict[str, str] = {}
    # Parameters that ran as DTensors (tensor parallelism): the passes take no gradient of them.
    distributed = {i for i, t in enumerate(checked.targets(rec.running)) if is_sharded(t)}
    for fqn in fqns:
        if rec.saved.get(fqn, 0) == 0:
            unmeasured[fqn] = SAVES_NOTHING
            continue
        own = checked.own(fqn)
        tensors = rec.inputs.get(fqn) or rec.outputs.get(fqn)
        if own:
            judges[fqn] = Judge(PARAMS, own)
        elif tensors:
            judges[fqn] = Judge(TENSORS, tuple(dict.fromkeys(tensors)))
        else:
            name = fqn  # its own subtree's parameters, else its nearest ancestor's
            own = checked.subtree(name)
            while name and not own:
                name = name.rpartition(".")[0]
                own = checked.subtree(name)
            if own:
                judges[fqn] = Judge(PARAMS, own)
            else:
                unmeasured[fqn] = NOTHING_TO_JUDGE
        judge = judges.get(fqn)
        if judge is not None and judge.kind == PARAMS and set(judge.indices) <= distributed:
            del judges[fqn]
            unmeasured[fqn] = DISTRIBUTED_PARAMETERS
    return judges, unmeasured


#: Drift slot of a module whose gradient was not finite in some pass (a max over ranks keeps it,
#: so every rank skips the module when one rank has to).
NOT_FINITE = float("inf")


@dataclass(frozen=True)
class Whole:
    """The model's whole parameter gradient (metric ``sgd``): its cost, squared error, sampling
    variance and noise scale over the batch (:func:`progress_cost`)."""

    cost: float
    error_sq: float
    spread: float
    scale: float

    def cost_without(self, error_sq: float) -> float:
        """The cost were ``error_sq`` of the error gone."""
        return progress_cost(max(self.error_sq - error_sq, 0.0) / self.spread, self.scale)


@dataclass(frozen=True)
class Drifts:
    """One round's drift per module.

    Attributes:
        values: per ``fqns`` entry: the drift, ``UNMEASURED`` or ``NOT_FINITE``.
        missing: ``{fqn: reason}`` of the modules without measurable drift.
        parts: metric ``sgd``: ``{fqn: (error, scale)}``: the compression error's energy over
            the gradient's sampling variance, and the smoothed gradient noise scale over the
            training batch (:class:`NoiseScale`; ``inf``: none known yet).
        total: metric ``sgd``: the whole model's parameter gradient, the one the optimizer
            steps with (``None``: other metrics, or not measurable).
        errors: per target, the squared error of its gradient.
    """

    values: list[float]
    missing: dict[str, str]
    parts: dict[str, tuple[float, float]]
    total: Whole | None = None
    errors: torch.Tensor | None = None  # per target: |q - g|^2


def progress_cost(error: float, scale: float) -> float:
    """The share of a step's progress that compression costs (metric ``sgd``).

    In the model of large-batch training of McCandlish et al. (2018), a step at batch ``B``
    makes progress in proportion to ``1 / (1 + B_noise / B)``, where ``B_noise = tr(Σ) / |G|^2``
    is the gradient noise scale. Compression adds error like more sampling noise, ``error``
    times as much (``tr(Σ)`` grows by ``1 + error``), so it costs
    ``error k / (1 + (1 + error) k)`` of the progress, with ``k = B_noise / B`` (``scale``).
    Small next to the noise SGD already has, or at a batch far above the noise scale, it costs
    little; large against it, most of the step. ``k`` infinite (no noise scale known yet): the
    bound for every noise scale, ``error / (1 + error)``."""
    if scale == float("inf"):
        return error / (1 + error)
    return error * scale / (1 + (1 + error) * scale)


#: Weight of the past in the noise scale's moving averages (about the last ten checks count).
NOISE_DECAY = 0.9


@dataclass
class NoiseScale:
    """The gradient noise scale ``B_noise = tr(Σ) / |G|^2`` of one gradient, smoothed across
    checks: exponential moving averages of its numerator and denominator, each estimated
    without bias from one check (``tr(Σ) = n Var(g_n)``, ``|G|^2 = |g_n|^2 - Var(g_n)``, which
    may come out negative), as McCandlish et al. (2018) do. One check's ratio from a few
    samples swings by orders of magnitude and is often infinite; the averages' ratio does not.

    Attributes:
        trace, signal: the moving averages (from zero: their ratio needs no bias correction).
        good: the last ratio that was finite and positive; ``None``: none yet.
    """

    trace: float = 0.0
    signal: float = 0.0
    good: float | None = None

    def update(self, norm_sq: float, spread: float, samples: int) -> float | None:
        """Add one check's squared norm ``|g_n|^2`` and sampling variance ``Var(g_n)`` of the
        mean gradient of ``samples``; returns :attr:`good`. A value that is not finite is left
        out (it would poison every later average)."""
        trace, signal = spread * samples, norm_sq - spread
        if not (math.isfinite(trace) and math.isfinite(signal)) or trace < 0:
            return self.good
        self.trace = NOISE_DECAY * self.trace + (1 - NOISE_DECAY) * trace
        self.signal = NOISE_DECAY * self.signal + (1 - NOISE_DECAY) * signal
        if self.signal > 0 and math.isfinite(ratio := self.trace / self.signal) and ratio > 0:
            self.good = ratio
        return self.good


def module_drifts(
    fqns: Sequence[str],
    judges: Mapping[str, Judge],
    floors: Mapping[str, float],
    exact: PassGradients,
    exact_sq: torch.Tensor,
    approx: PassGradients,
    metric: str,
    variance: torch.Tensor | None = None,
    scales: Mapping[str | None, float] | None = None,
    params: int = 0,
) -> Drifts:
    """Per-module drift from the exact and the compressed pass.

    A sharded parameter's fold is already the whole gradient's (its shares' folds summed over
    ranks) and ``exact_sq`` is summed over ranks, so its drift is measured over the whole
    parameter, as unsharded. ``variance``
    (metrics ``noise`` and ``sgd``): per target, the sampling variance of the sample's mean exact
    gradient; a module whose variance is at most ``floors[kind] ** 2`` has no measurable drift.
    ``scales`` (``sgd``): per module, and for the whole parameter gradient under ``None``, the
    smoothed noise scale over the training batch (:class:`NoiseScale`; ``inf`` where none is
    known yet: the cost is then its bound for any noise scale).
    ``params``: the first ``params`` targets are the model's parameters (the whole model's cost).
    """
    n = len(approx.folds)  # recorded tensors are missing when the passes ran differently
    # per target: |q - g|^2, <q, g>, |q|^2, |g|^2 (of the folds: for cosine, a fold's errors
    # cancel in its own ratio)
    stats = torch.zeros(4, n, dtype=torch.float64)
    for i in range(n):
        e, q = exact.fold(i, approx), approx.fold(i, exact)
        stats[:, i] = torch.stack([(q - e).square().sum(), (q * e).sum(), q.square().sum(),
                                   e.square().sum()])  # fmt: skip
    finite = exact.finite[:n] & approx.finite[:n]  # sharded gradients' folds are whole
    diff_sq, dot, approx_sq, exact_fold_sq = stats.unbind()
    total = None
    scales = scales or {}
    if metric == "sgd" and variance is not None:
        own = [i for i in range(min(n, params)) if bool(finite[i])]
        spread = float(variance[own].sum())
        if own and spread > floors[PARAMS] ** 2:
            error_sq = float(diff_sq[own].sum())
            scale = scales.get(None, float("inf"))
            total = Whole(progress_cost(error_sq / spread, scale), error_sq, spread, scale)
    drift = [UNMEASURED] * len(fqns)
    missing: dict[str, str] = {}
    parts: dict[str, tuple[float, float]] = {}
    for k, fqn in enumerate(fqns):
        judge = judges.get(fqn)
        if judge is None:
            continue
        idx = list(judge.indices)
        if any(i >= n for i in idx):
            missing[fqn] = CALLS_DIFFER
            continue
        if not bool(finite[idx].all()):
            drift[k] = NOT_FINITE
            continue
        norm_sq = float(exact_sq[idx].sum())
        norm = norm_sq**0.5
        if norm <= floors[judge.kind] or norm == 0.0:
            missing[fqn] = NEGLIGIBLE_GRADIENT
            continue
        if metric in ("noise", "sgd"):
            spread = float(variance[idx].sum()) if max(idx) < len(variance) else None
            if spread is None:
                missing[fqn] = CALLS_DIFFER
                continue
            if spread <= floors[judge.kind] ** 2 or spread == 0.0:
                missing[fqn] = NEGLIGIBLE_NOISE
                continue
            if metric == "noise":
                drift[k] = float(diff_sq[idx].sum()) / spread
                continue
            scale = scales.get(fqn, float("inf"))
            error = float(diff_sq[idx].sum()) / spread
            drift[k], parts[fqn] = progress_cost(error, scale), (error, scale)
        elif metric == "cosine":
            denom = float((approx_sq[idx].sum() * exact_fold_sq[idx].sum()).sqrt())
            drift[k] = max(0.0, 1.0 - float(dot[idx].sum()) / denom) if denom > 0 else 1.0
        else:
            drift[k] = float(diff_sq[idx].sum().sqrt()) / norm
    return Drifts(drift, missing, parts, total, diff_sq)
