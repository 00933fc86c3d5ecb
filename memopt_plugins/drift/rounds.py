"""The drift check's rounds: compressed passes at the bits of the moment, each judged against the
exact pass and max-reduced over ranks before anything is decided, so that every rank decides
alike (:class:`Rounds`)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import astuple, dataclass, field

from .exact import CheckPasses, ExactPass, device_of
from .judges import NOT_FINITE, Drifts, Judging, Whole, module_drifts
from .passes import max_reduced
from .report import NON_FINITE
from .request import DriftCheck


@dataclass
class Round:
    """One round of compressed passes at the bits of the moment."""

    drift: dict[str, float]  # measurable drift per module (max over ranks)
    unmeasured: dict[str, str]  # why the others have none
    parts: dict[str, tuple[float, float]]  # metric sgd: (error ratio, noise scale / batch)
    total: Whole | None = None  # metric sgd: the whole parameter gradient (max over ranks)
    energy: dict[str, float] = field(default_factory=dict)  # sgd: each module's own error


class Rounds:
    """Runs a check's rounds (:meth:`run`) and keeps what the report says of them all: each
    round's largest drift (:attr:`round_max`), the first round's drifts and ``sgd`` parts, and
    the modules skipped for a gradient that was not finite in some pass (:attr:`skipped`)."""

    def __init__(
        self,
        passes: CheckPasses,
        exact: ExactPass,
        judging: Judging,
        one_pass: Callable[[], AbstractContextManager],
        check: DriftCheck,
    ):
        self.passes, self.exact, self.judging, self.one_pass = passes, exact, judging, one_pass
        self.as_training = check.face.as_training
        self.reduce_max = check.reduce_max
        self.fqns = sorted(check.face.bits)
        self.round_max: list[float] = []
        self.first_drift: dict[str, float] = {}  # the first round's, as it was measured
        self.first_parts: dict[str, tuple[float, float]] = {}
        self.skipped: set[str] = set()

    def run(self) -> Round:
        """One compressed pass at the current bits, each piece judged at its training size:
        each module's drift (max over ranks), the unmeasured and the skipped."""
        passes = self.passes
        training = nullcontext() if self.as_training is None else self.as_training(passes.sample)
        with self.one_pass(), training:
            approx = passes.run()
        found = module_drifts(self.fqns, passes.judges, self.exact, approx, self.judging)
        del approx
        out = self._over_ranks(found)
        self.round_max.append(max(out.drift.values(), default=0.0))
        if len(self.round_max) == 1:
            self.first_drift, self.first_parts = dict(out.drift), out.parts
        return out

    def _over_ranks(self, found: Drifts) -> Round:
        """``found`` max-reduced over ranks, as a round. Metric ``sgd``: the whole gradient and
        each module's own error are reduced too (a fixed size on every rank: -1 where this rank
        has none)."""
        fqns, whole = self.fqns, found.total
        extra = []
        if self.judging.metric == "sgd":
            errors, checked = found.errors, self.passes.checked
            own = [
                float(errors[list(checked.own(f))].sum())
                if errors is not None and checked.own(f)
                else 0.0
                for f in fqns
            ]
            head = [-1.0] * 4 if whole is None else [*astuple(whole)]
            extra = head + own
        device = device_of(self.passes.checked)
        reduced = max_reduced(self.reduce_max, [*found.values, *extra], device)
        drift = reduced[: len(fqns)]
        total, energy = None, {}
        if extra and reduced[len(fqns)] >= 0:
            cost, error_sq, spread, scale, *own = reduced[len(fqns) :]
            total = Whole(cost, error_sq, spread, scale)
            energy = {f: e for f, e in zip(fqns, own, strict=True) if e > 0}
        per = {f: d for f, d in zip(fqns, drift, strict=True) if 0 <= d < NOT_FINITE}
        bad = {f for f, d in zip(fqns, drift, strict=True) if d == NOT_FINITE}
        self.skipped.update(bad)
        absent = {**self.passes.unmeasured, **found.missing, **dict.fromkeys(bad, NON_FINITE)}
        absent = {f: r for f, r in absent.items() if f not in per}
        parts = {f: p for f, p in found.parts.items() if f in per}
        return Round(per, absent, parts, total, energy)
