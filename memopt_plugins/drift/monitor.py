"""The drift monitor: schedules checks and runs them, keeps what carries over between checks
(counters, calm checks, waits, holds, noise scales), the history and the state.

A check runs in three parts, each in its own module: the exact pass (:mod:`.exact`), the
compressed rounds (:mod:`.rounds`) and the decision on the bits (:mod:`.decide`)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from ..config import DriftConfig, checked_bits
from ..config_io import reading_state, state_count, state_list, state_map, state_name
from ..distributed import is_rank_zero
from ..measure.scopes import eagerly
from .decide import Decision
from .exact import CheckPasses, ExactPass, exact_pass
from .judges import Judge, Judging, NoiseScale, noise_scales
from .passes import preserved_state
from .report import HISTORY_LIMIT, SAVES_NOTHING, DriftReport, describe_check
from .request import DriftCheck
from .rounds import Rounds

log = logging.getLogger("memopt")


class DriftMonitor:
    """Runs drift checks, escalates bits along the ladder, keeps the step counter and history.

    The monitor does not know how compression works: each check hands it the compressed modules'
    bits, a way to change them, and a context that suspends compression (the exact pass), its
    :class:`~.request.CompressionFace`.

    Args:
        config: the ``drift`` section of the config.
    """

    def __init__(self, config: DriftConfig, budget: bool = False):
        self.config = config
        self.budget = budget  # a memory target is set: checks come with a pricing
        self.steps = 0
        self.escalations = 0
        self.deescalations = 0
        self.skipped = 0  # modules a check skipped for a gradient that was not finite
        self.blind = 0  # checks that measured no module's drift
        #: whether this process writes the checks' lines (rank 0; an integration's main process)
        self.speaks: Callable[[], bool] = is_rank_zero
        self._noted_no_variance = False
        self._noted_no_scale = False
        #: the bits the config gives each module now (:meth:`start`; no part of the state)
        self.configured: dict[str, int] = {}
        # drift.lower: starting bits, calm checks in a row, checks to wait, lowered once, changes
        self.floor: dict[str, int] = {}
        self.calm: dict[str, int] = {}
        self.wait: dict[str, int] = {}
        self.lowered: set[str] = set()
        self.changes: dict[str, int] = {}
        # quantize.budget: drift per unit of step size, and widths the threshold holds a module
        # at (checks left)
        self.sensitivity: dict[str, float] = {}
        self.held: dict[str, tuple[int, int]] = {}
        # metric sgd: the gradient noise scale smoothed across checks, the whole parameter
        # gradient's and each module's
        self.noise_whole = NoiseScale()
        self.noise: dict[str, NoiseScale] = {}
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_LIMIT)
        self.last: DriftReport | None = None

    def start(self, configured: Mapping[str, int]) -> None:
        """The bits the config gives each module (:attr:`configured`): ``drift.lower`` never goes
        under them (a restored state keeps its own floors)."""
        self.configured = {fqn: int(bits) for fqn, bits in configured.items()}
        for fqn, bits in self.configured.items():
            self.floor.setdefault(fqn, bits)

    # ----------------------------------------------------------------- scheduling
    def should_check(self, step: int | None = None) -> bool:
        """True when a check is due at ``step`` (default: the counted optimizer steps).

        Checks run at step 0 and every ``check_every`` steps, when ``drift.enabled``.
        """
        step = self.steps if step is None else step
        return self.config.enabled and step % self.config.check_every == 0

    # ----------------------------------------------------------------- the check
    def check(self, check: DriftCheck) -> DriftReport:
        """Measure the drift of the compressed modules and escalate those over the threshold
        (with ``drift.lower`` lower calm ones, with a pricing solve the bits for the budget), in
        three parts: the exact pass (:func:`~.exact.exact_pass`), the compressed rounds
        (:class:`~.rounds.Rounds`) and the decision (:class:`~.decide.Decision`). What the check
        is handed: :class:`~.request.DriftCheck`."""
        if check.speaks is not None:
            self.speaks = check.speaks
        cfg = self.config
        step = self.steps if check.step is None else check.step
        fqns = sorted(check.face.bits)
        if not fqns:
            return self._record(DriftReport(step, threshold=cfg.threshold, metric=cfg.metric))
        passes = CheckPasses.of(check, fqns, halves=cfg.metric in ("noise", "sgd"))
        # Eagerly: modules inside compiled graphs are judged too (their hooks fire).
        with eagerly(), preserved_state(check.sample.model, check.face.generators) as one_pass:
            exact = exact_pass(passes, one_pass, check, fqns, cfg.metric)
            judging = self._judging(exact, passes.judges, step, check.sample.batch_size)
            decision = Decision(self, check, Rounds(passes, exact, judging, one_pass, check), step)
            decision.decide(check.pricing)
        report = decision.report(judging.metric)
        self.skipped += len(report.skipped)
        self.blind += report.blind
        if self.speaks():
            _log_check(report, decision.trail, len(fqns))
            if report.blind:
                _warn_blind(report, len(fqns), passes.sample is None)
        return self._record(report)

    def _judging(
        self, exact: ExactPass, judges: Mapping[str, Judge], step: int, batch_size: int | None
    ) -> Judging:
        """The metric the check judges by (``sgd`` without the gradient's sampling noise:
        ``cosine``, said once) and for ``sgd`` the noise scales, the exact pass's measurement
        added to the smoothed ones (:func:`~.judges.noise_scales`)."""
        metric = self.config.metric
        if metric == "sgd" and exact.variance is None:
            metric = "cosine"
            if not self._noted_no_variance and self.speaks():
                self._noted_no_variance = True
                log.warning(
                    "memopt: drift.metric sgd needs the gradient's sampling noise: the "
                    "model was called with no tensor of 2 or more samples along dim 0 (or "
                    "sample_size is 1); these checks judge by cosine instead"
                )
        if metric != "sgd":
            return Judging(metric)
        batch = batch_size or exact.samples
        scales = noise_scales(self.noise_whole, self.noise, judges, exact, batch)
        if scales[None] == float("inf") and not self._noted_no_scale and self.speaks():
            self._noted_no_scale = True
            log.info(
                "memopt: at step %d the gradient noise scale is not known yet (the "
                "gradient's signal has not stood above its sampling noise in the checks "
                "so far): until it is, sgd judges costs at their bound for any noise "
                "scale, error / (1 + error)",
                step,
            )
        return Judging(metric, scales)

    def _record(self, report: DriftReport) -> DriftReport:
        self.last = report
        for fqn in (*report.escalated, *report.lowered):
            self.changes[fqn] = self.changes.get(fqn, 0) + 1
        self.history.append(
            {
                "step": report.step,
                "max": report.max,
                "round_max": list(report.round_max),
                "escalated": {k: list(v) for k, v in report.escalated.items()},
                "lowered": {k: list(v) for k, v in report.lowered.items()},
                "skipped": list(report.skipped),
                "budget": None if report.budget is None else list(report.budget),
            }
        )
        return report

    # ----------------------------------------------------------------- metrics and state
    def metrics(self, per_module: bool = False) -> dict[str, float]:
        """``memopt/escalations``, ``memopt/drift_skipped`` (modules skipped for a gradient
        that was not finite) and ``memopt/drift_blind`` (checks that measured nothing) so far,
        ``memopt/lowerings`` (with ``drift.lower`` or a budget), ``memopt/drift_max`` (the last
        check's largest module drift, unless it measured nothing) and, with ``per_module``,
        ``memopt/drift/<fqn>`` (the last check's drift of each module)."""
        out: dict[str, float] = {
            "memopt/escalations": float(self.escalations),
            "memopt/drift_skipped": float(self.skipped),
            "memopt/drift_blind": float(self.blind),
        }
        if self.config.lower or self.budget:
            out["memopt/lowerings"] = float(self.deescalations)
        if self.last is not None and not self.last.blind:  # measured nothing: no max to show
            out["memopt/drift_max"] = self.last.max
            if per_module:
                for fqn, drift in self.last.per_module.items():
                    out[f"memopt/drift/{fqn or '<root>'}"] = drift
        return out

    def state_dict(self) -> dict[str, Any]:
        """Step counter, escalation count, history and the last report (plain Python types)."""
        last = self.last
        return {
            "steps": self.steps,
            "escalations": self.escalations,
            "skipped": self.skipped,
            "blind": self.blind,
            "lowering": {
                "deescalations": self.deescalations,
                "floor": dict(self.floor),
                "calm": dict(self.calm),
                "wait": dict(self.wait),
                "lowered": sorted(self.lowered),
                "changes": dict(self.changes),
            },
            "budget": {
                "sensitivity": dict(self.sensitivity),
                "held": {f: list(v) for f, v in self.held.items()},
            },
            "noise": {
                "whole": dataclasses.asdict(self.noise_whole),
                "modules": {f: dataclasses.asdict(n) for f, n in self.noise.items()},
            },
            "history": [dict(h) for h in self.history],
            "last": None
            if last is None
            else {
                "step": last.step,
                "per_module": dict(last.per_module),
                "unmeasured": dict(last.unmeasured),
                "escalated": {k: list(v) for k, v in last.escalated.items()},
                "lowered": {k: list(v) for k, v in last.lowered.items()},
                "round_max": list(last.round_max),
                "budget": None if last.budget is None else list(last.budget),
                "threshold": last.threshold,
                "metric": last.metric,
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; a bad state changes nothing (:meth:`read`)."""
        self.take(self.read(state))

    def read(self, state: Any) -> DriftMonitor:
        """A monitor holding ``state`` (what :meth:`state_dict` saved), read whole: a value of
        the wrong type or range is a :class:`ConfigError` naming its key, and this monitor is
        left as it was. :meth:`take` lays what it holds on this one."""
        other = DriftMonitor(self.config, self.budget)
        with reading_state("drift"):
            state = state_map(state)
        for key in ("steps", "escalations", "skipped", "blind"):
            with reading_state(f"drift.{key}"):
                setattr(other, key, state_count(state.get(key, 0)))
        with reading_state("drift.lowering"):
            lowering = state_map(state.get("lowering", {}))
            other.deescalations = state_count(lowering.get("deescalations", 0))
            other.floor = {
                k: checked_bits(v) for k, v in state_map(lowering.get("floor", {})).items()
            }
            for key in ("calm", "wait", "changes"):
                counts = state_map(lowering.get(key, {}))
                setattr(other, key, {k: state_count(v) for k, v in counts.items()})
            other.lowered = {state_name(f) for f in state_list(lowering.get("lowered", ()))}
        with reading_state("drift.budget"):
            budget = state_map(state.get("budget", {}))
            sensitivity = state_map(budget.get("sensitivity", {}))
            other.sensitivity = {k: _finite(v) for k, v in sensitivity.items()}
            held = state_map(budget.get("held", {}))
            other.held = {k: (checked_bits(w), state_count(n)) for k, (w, n) in held.items()}
        with reading_state("drift.noise"):
            noise = state_map(state.get("noise", {}))
            other.noise_whole = _noise_scale(noise.get("whole", {}))
            other.noise = {
                state_name(f): _noise_scale(n)
                for f, n in state_map(noise.get("modules", {})).items()
            }
        with reading_state("drift.history"):
            other.history = deque(
                (state_map(h) for h in state_list(state.get("history", ()))), maxlen=HISTORY_LIMIT
            )
        with reading_state("drift.last"):
            last = state.get("last")
            other.last = None if last is None else self._report_of(state_map(last))
        return other

    def _report_of(self, last: dict[str, Any]) -> DriftReport:
        return DriftReport(
            state_count(last["step"]),
            {k: float(v) for k, v in state_map(last["per_module"]).items()},
            state_map(last.get("unmeasured", {})),
            {k: (int(a), int(b)) for k, (a, b) in state_map(last.get("escalated", {})).items()},
            tuple(float(v) for v in state_list(last.get("round_max", ()))),
            {k: (int(a), int(b)) for k, (a, b) in state_map(last.get("lowered", {})).items()},
            threshold=float(last.get("threshold", self.config.threshold)),
            metric=str(last.get("metric", self.config.metric)),
            budget=None if last.get("budget") is None else tuple(state_list(last["budget"])),
        )

    def take(self, other: DriftMonitor) -> None:
        """The state ``other`` holds (:meth:`read`), laid on this monitor (copied: the two
        share nothing a later change could reach)."""
        for key in _STATE:
            setattr(self, key, copy.deepcopy(getattr(other, key)))

    @property
    def modules(self) -> set[str]:
        """Every module the state names (as a checkpoint of another model would show)."""
        named = (
            self.floor,
            self.calm,
            self.wait,
            self.changes,
            self.sensitivity,
            self.held,
            self.noise,
        )
        return {f for part in named for f in part} | self.lowered


#: What :meth:`DriftMonitor.state_dict` saves, as attributes.
_STATE = (
    "steps",
    "escalations",
    "skipped",
    "blind",
    "deescalations",
    "floor",
    "calm",
    "wait",
    "lowered",
    "changes",
    "sensitivity",
    "held",
    "noise_whole",
    "noise",
    "history",
    "last",
)


def _finite(value: Any) -> float:
    if isinstance(value, bool) or not math.isfinite(out := float(value)):
        raise ValueError(f"expected a finite number, got {value!r}")
    return out


def _noise_scale(value: Any) -> NoiseScale:
    """A :class:`NoiseScale` from its saved fields: finite averages (the trace's not negative)
    and a last good ratio that is ``None`` or finite and positive."""
    fields = state_map(value)
    trace, signal = _finite(fields.get("trace", 0.0)), _finite(fields.get("signal", 0.0))
    good = fields.get("good")
    good = None if good is None else _finite(good)
    if trace < 0 or (good is not None and good <= 0):
        raise ValueError(f"expected a noise scale's averages, got {fields!r}")
    return NoiseScale(trace, signal, good)


def _log_check(report: DriftReport, trail: Mapping[str, list[int]], modules: int) -> None:
    """The check's INFO line (and a WARNING for the modules it skipped)."""
    log.info("memopt: %s", describe_check(report, trail, modules))
    if report.skipped:
        log.warning(
            "memopt: the drift check at step %d skipped %d module(s) whose exact or compressed "
            "gradient was not finite; their bits stay: %s",
            report.step,
            len(report.skipped),
            ", ".join(f or "<root>" for f in report.skipped[:8])
            + (", ..." if len(report.skipped) > 8 else ""),
        )


def _warn_blind(report: DriftReport, modules: int, own_sizes: bool) -> None:
    """The WARNING of a check that measured no module's drift: why, and (``own_sizes``: the
    sample's tensors were judged by their own sizes) what lets it see."""
    reasons: dict[str, int] = {}
    for reason in report.unmeasured.values():
        reasons[reason] = reasons.get(reason, 0) + 1
    why = ", ".join(f"{n}: {r}" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1]))
    hint = ""
    if own_sizes and SAVES_NOTHING in reasons:
        hint = (
            "; its sample's saved tensors were held to quantize.min_numel at their own sizes, "
            "not training's: give the check the training batch (check_drift(batch=...) or "
            "batch_size=...), or a larger drift.sample_size"
        )
    log.warning(
        "memopt: the drift check at step %d measured nothing: %d of %d compressed modules have "
        "no measurable drift (%s); it judged no module and counts in memopt/drift_blind%s",
        report.step,
        len(report.unmeasured),
        modules,
        why,
        hint,
    )
