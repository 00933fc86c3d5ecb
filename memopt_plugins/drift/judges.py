"""Which gradient judges each compressed module, and its drift from the two passes' gradients."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from .exact import ExactPass

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


@dataclass(frozen=True)
class Judging:
    """How a check judges its rounds: ``drift.metric`` as it runs (``sgd`` falls back to
    ``cosine`` without the gradient's sampling noise) and, for ``sgd``, the smoothed noise scale
    over the training batch per module and for the whole parameter gradient under ``None``
    (:class:`NoiseScale`; ``inf`` where none is known yet: the cost is then its bound for any
    noise scale)."""

    metric: str
    scales: Mapping[str | None, float] | None = None


def noise_scales(
    whole: NoiseScale,
    modules: dict[str, NoiseScale],
    judges: Mapping[str, Judge],
    exact: ExactPass,
    batch: int,
) -> dict[str | None, float]:
    """The exact pass's measurement added to the smoothed noise scales (:class:`NoiseScale`) of
    the whole parameter gradient (``whole``, key ``None``) and of each judged module
    (``modules``, added where missing), and each one's last good ``B_noise / batch`` (``inf``
    where none has been finite and positive yet: one check's infinite, NaN or negative estimate
    is never decided on)."""
    finite, variance = exact.gradients.finite, exact.variance
    groups: dict[str | None, list[int]] = {
        None: [i for i in range(exact.params) if bool(finite[i])]
    }
    groups.update({f: list(j.indices) for f, j in judges.items()})
    out: dict[str | None, float] = {}
    for key, idx in groups.items():
        noise = whole if key is None else modules.setdefault(key, NoiseScale())
        if idx and max(idx) < len(variance):
            noise.update(float(exact.sq[idx].sum()), float(variance[idx].sum()), exact.samples)
        out[key] = float("inf") if noise.good is None else noise.good / batch
    return out


def module_drifts(
    fqns: Sequence[str],
    judges: Mapping[str, Judge],
    exact: ExactPass,
    approx: PassGradients,
    judging: Judging,
) -> Drifts:
    """Per-module drift from the exact and the compressed pass, as ``judging`` says.

    A sharded parameter's fold is already the whole gradient's (its shares' folds summed over
    ranks) and the exact squared norms are summed over ranks, so its drift is measured over the
    whole parameter, as unsharded. Metrics ``noise`` and ``sgd``: a module whose exact
    gradient's sampling variance is at most its floor squared has no measurable drift."""
    compared = _Compared(exact, approx, judging)
    drift = [UNMEASURED] * len(fqns)
    missing: dict[str, str] = {}
    for k, fqn in enumerate(fqns):
        judge = judges.get(fqn)
        if judge is None:
            continue
        found = compared.drift(fqn, judge)
        if isinstance(found, str):
            missing[fqn] = found
        else:
            drift[k] = found
    return Drifts(drift, missing, compared.parts, compared.whole(), compared.diff_sq)


class _Compared:
    """The two passes' gradients compared target by target: per target ``|q - g|^2``,
    ``<q, g>``, ``|q|^2`` and ``|g|^2`` of the folds (for cosine, a fold's errors cancel in its
    own ratio); targets past the compressed pass's are missing (the passes ran differently)."""

    def __init__(self, exact: ExactPass, approx: PassGradients, judging: Judging):
        self.exact, self.judging = exact, judging
        gradients = exact.gradients
        n = self.n = len(approx.folds)
        stats = torch.zeros(4, n, dtype=torch.float64)
        for i in range(n):
            e, q = gradients.fold(i, approx), approx.fold(i, gradients)
            stats[:, i] = torch.stack([(q - e).square().sum(), (q * e).sum(), q.square().sum(),
                                       e.square().sum()])  # fmt: skip
        self.finite = gradients.finite[:n] & approx.finite[:n]  # sharded folds are whole
        self.diff_sq, self.dot, self.approx_sq, self.exact_fold_sq = stats.unbind()
        #: metric ``sgd``: ``{fqn: (error, scale)}`` of the modules judged (:class:`Drifts`)
        self.parts: dict[str, tuple[float, float]] = {}

    def whole(self) -> Whole | None:
        """Metric ``sgd``: the cost of the whole parameter gradient (``None``: other metrics,
        or its sampling variance is negligible)."""
        exact, scales = self.exact, self.judging.scales or {}
        if self.judging.metric != "sgd" or exact.variance is None:
            return None
        own = [i for i in range(min(self.n, exact.params)) if bool(self.finite[i])]
        spread = float(exact.variance[own].sum())
        if not (own and spread > exact.floors[PARAMS] ** 2):
            return None
        error_sq = float(self.diff_sq[own].sum())
        scale = scales.get(None, float("inf"))
        return Whole(progress_cost(error_sq / spread, scale), error_sq, spread, scale)

    def drift(self, fqn: str, judge: Judge) -> float | str:
        """The drift of ``fqn`` by ``judge``'s targets, ``NOT_FINITE``, or why it has none."""
        idx = list(judge.indices)
        if any(i >= self.n for i in idx):
            return CALLS_DIFFER
        if not bool(self.finite[idx].all()):
            return NOT_FINITE
        floor = self.exact.floors[judge.kind]
        norm_sq = float(self.exact.sq[idx].sum())
        norm = norm_sq**0.5
        if norm <= floor or norm == 0.0:
            return NEGLIGIBLE_GRADIENT
        metric = self.judging.metric
        if metric in ("noise", "sgd"):
            return self._against_noise(fqn, idx, floor)
        if metric == "cosine":
            denom = float((self.approx_sq[idx].sum() * self.exact_fold_sq[idx].sum()).sqrt())
            return max(0.0, 1.0 - float(self.dot[idx].sum()) / denom) if denom > 0 else 1.0
        return float(self.diff_sq[idx].sum().sqrt()) / norm

    def _against_noise(self, fqn: str, idx: list[int], floor: float) -> float | str:
        """Metrics ``noise`` and ``sgd``: the error over the sampling variance, and for ``sgd``
        the share of progress it costs (its parts noted in :attr:`parts`)."""
        variance = self.exact.variance
        spread = float(variance[idx].sum()) if max(idx) < len(variance) else None
        if spread is None:
            return CALLS_DIFFER
        if spread <= floor**2 or spread == 0.0:
            return NEGLIGIBLE_NOISE
        if self.judging.metric == "noise":
            return float(self.diff_sq[idx].sum()) / spread
        scale = (self.judging.scales or {}).get(fqn, float("inf"))
        error = float(self.diff_sq[idx].sum()) / spread
        self.parts[fqn] = (error, scale)
        return progress_cost(error, scale)
