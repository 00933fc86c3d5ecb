"""What a drift check found (:class:`DriftReport`), why a module has no drift, the ladder."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..config import OFF_BITS

#: A judged gradient whose exact norm is below this fraction of the model's has no drift.
NEGLIGIBLE = 1e-6
#: Checks kept in the history (the oldest are dropped first).
HISTORY_LIMIT = 100
#: quantize.budget: how far over the budget the kept bytes may end before the log warns.
BUDGET_TOLERANCE = 0.05

# Reasons in DriftReport.unmeasured.
SAVES_NOTHING = "saves nothing compression touches"
NEGLIGIBLE_GRADIENT = "negligible exact gradient"
NOTHING_TO_JUDGE = "no gradient to judge it by"
CALLS_DIFFER = "ran differently in the exact and compressed passes"
NEGLIGIBLE_NOISE = "negligible sampling noise of the exact gradient"
NON_FINITE = "gradient not finite (skipped: bits unchanged)"
DISTRIBUTED_PARAMETERS = (
    "judged by parameters that run as DTensors (tensor parallelism): not measured"
)
#: Modules named in a check's INFO line (the rest are counted).
NAMED_IN_LINE = 8


@dataclass(frozen=True)
class DriftReport:
    """The outcome of one drift check.

    Attributes:
        step: the optimizer step the check ran at.
        per_module: ``{fqn: drift}`` of every compressed module with measurable drift, after the
            last round (the max over ranks under torch.distributed).
        unmeasured: ``{fqn: reason}`` of the compressed modules without measurable drift.
        escalated: ``{fqn: (old bits, new bits)}`` over all rounds of this check.
        lowered: ``{fqn: (old bits, new bits)}`` of the modules this check brought down
            (``drift.lower``).
        round_max: the max drift of each round (one compressed pass each): the first is the drift
            training had before this check, the last the drift it has after it.
        threshold, metric: what the drifts were judged by.
        budget: with ``quantize.budget`` or ``quantize.memory``, ``(target, kept)``: the target
            (the tighter where both are set) and the bytes the bits
            keep after the check (predicted from the check's pass by the codec's packed sizes),
            both in bytes of a training forward; ``None`` otherwise.
        skipped: modules whose exact or compressed gradient was not finite: not judged, their
            bits unchanged.
        first: ``{fqn: drift}`` of the first round (the drift training had before the check).
        parts: metric ``sgd``: ``{fqn: (error, scale)}`` of the first round: the compression
            error's energy over the gradient's sampling variance, and the gradient noise scale
            over the training batch (:func:`~memopt_plugins.drift.judges.progress_cost`).
        total: metric ``sgd``: the whole model's cost before and after the check (the parameter
            gradient the optimizer steps with; what the threshold judges); ``None``: not measured.
        blind: the check measured no module's drift (nothing compressed in its sample, or no
            gradient to judge by): it judged nothing, whatever ``max`` reads.
        tried_lower: ``{fqn: (bits, rung below)}`` of the calm modules ``drift.lower`` tried a
            rung lower whose probe sent them back to their bits (they wait longer to try again);
            ``tried_probe``: that probe's whole-model cost (``sgd``) or largest drift.
    """

    step: int
    per_module: dict[str, float] = field(default_factory=dict)
    unmeasured: dict[str, str] = field(default_factory=dict)
    escalated: dict[str, tuple[int, int]] = field(default_factory=dict)
    round_max: tuple[float, ...] = ()
    lowered: dict[str, tuple[int, int]] = field(default_factory=dict)
    threshold: float = 0.05
    metric: str = "sgd"
    budget: tuple[float, float] | None = None
    skipped: tuple[str, ...] = ()
    first: dict[str, float] = field(default_factory=dict)
    parts: dict[str, tuple[float, float]] = field(default_factory=dict)
    total: tuple[float | None, float | None] = (None, None)
    blind: bool = False
    tried_lower: dict[str, tuple[int, int]] = field(default_factory=dict)
    tried_probe: float | None = None

    @property
    def max(self) -> float:
        """The largest drift after the last round (0.0 when nothing was measurable)."""
        return max(self.per_module.values(), default=0.0)

    @property
    def rounds(self) -> int:
        """Compressed passes this check ran."""
        return len(self.round_max)

    def __str__(self) -> str:
        moved = ", ".join(f"{k or '<root>'} {a}->{b}" for k, (a, b) in self.escalated.items())
        down = ", ".join(f"{k or '<root>'} {a}->{b}" for k, (a, b) in self.lowered.items())
        largest = "measured nothing" if self.blind else f"max={self.max:.4f}"
        return (
            f"DriftReport(step={self.step}, {largest} ({self.metric}, threshold "
            f"{self.threshold}), rounds={self.rounds}, escalated: {moved or 'none'}"
            + (f", lowered: {down})" if down else ")")
        )


def next_rung(ladder: Sequence[int], bits: int) -> int:
    """The first ladder rung above ``bits`` (32 when none is)."""
    return next((b for b in ladder if b > bits), OFF_BITS)


def rung_below(ladder: Sequence[int], bits: int) -> int | None:
    """The last ladder rung below ``bits`` (``None`` when none is)."""
    return next((b for b in reversed(ladder) if b < bits), None)


def describe_check(report: DriftReport, trail: Mapping[str, Sequence[int]], modules: int) -> str:
    """One line on a check: what moved, from what to what and why, and the largest drift before
    and after, in the metric's own terms; with no move, what decided it (under ``sgd`` the whole
    gradient's cost, the modules' figures only for reference). ``trail``: the bits each raised
    module went through (more than one rung: a probe at the rung before was still over the
    threshold)."""
    threshold = report.threshold
    head = f"drift check at step {report.step} ({report.metric}, threshold {threshold:g})"
    if report.blind and not report.escalated and not report.lowered:
        return (
            f"{head}: measured nothing ({len(report.unmeasured)} of {modules} modules without "
            "a measurable drift); bits unchanged"
        )
    before, after = report.total
    moves = []
    for fqn in sorted(report.escalated, key=lambda f: -report.first.get(f, 0.0)):
        chain = list(trail.get(fqn) or report.escalated[fqn])
        text = f"{fqn or '<root>'} {' -> '.join(str(b) for b in chain)} ({_why(report, fqn)}"
        if len(chain) > 2:
            text += f"; at {chain[-2]} bits a probe was still over"
        moves.append(text + ")")
    parts = [head]
    if before is not None and (moves or report.lowered):
        whole = f"{100 * before:.1f}%" + (
            "" if after in (None, before) else f" -> {100 * after:.1f}%"
        )
        parts[0] += f": the model's gradient costs {whole} of a step's progress"
    if moves:
        shown = ", ".join(moves[:NAMED_IN_LINE])
        more = f" and {len(moves) - NAMED_IN_LINE} more" if len(moves) > NAMED_IN_LINE else ""
        parts.append(f"{len(moves)} of {modules} modules raised: {shown}{more}")
    if report.lowered:
        down = ", ".join(f"{f or '<root>'} {a} -> {b}" for f, (a, b) in report.lowered.items())
        parts.append(f"lowered: {down}")
    if not moves and not report.lowered:
        top = max(report.per_module.items(), key=lambda kv: kv[1], default=None)
        if after is not None:  # sgd: the whole gradient decided
            text = f"no change: the model's gradient costs {100 * after:.1f}% of a step's progress "
            text += (
                f"(<= {100 * threshold:g}%), which is what the threshold judges"
                if after <= threshold
                else f"(> {100 * threshold:g}%), but no module can go up"
            )
            if top:
                text += (
                    f"; per-module figures for reference: largest {top[0] or '<root>'} "
                    f"({_why(report, top[0])})"
                )
        elif top is None or top[1] <= threshold:
            text = f"no change: every module's drift <= {threshold:g}"
            if top:
                text += f"; largest {top[0] or '<root>'} {top[1]:.4f}"
        else:
            text = (
                f"no change: {top[0] or '<root>'} drifts {top[1]:.4f} (> {threshold:g}), but no "
                "module can go up"
            )
        parts.append(text)
    elif report.round_max:
        parts.append(f"largest drift {report.round_max[0]:.4f} -> {report.max:.4f}")
    if report.tried_lower:
        parts.append(_tried(report))
    if report.skipped:
        parts.append(f"{len(report.skipped)} skipped (gradient not finite)")
    return "; ".join(parts)


def _tried(report: DriftReport) -> str:
    """The calm modules tried a rung lower that went back up, and what the probe read."""
    tried = sorted(report.tried_lower)
    shown = ", ".join(
        f"{f or '<root>'} {a} -> {b}" for f, (a, b) in (
            (f, report.tried_lower[f]) for f in tried[:NAMED_IN_LINE]
        )
    )  # fmt: skip
    more = f" and {len(tried) - NAMED_IN_LINE} more" if len(tried) > NAMED_IN_LINE else ""
    probe = report.tried_probe
    if probe is None:
        read = "was not calm"
    elif report.metric == "sgd":
        read = f"cost {100 * probe:.1f}% of a step's progress"
    else:
        read = f"read a largest drift of {probe:.4f}"
    return (
        f"tried a rung lower and kept at their bits ({len(tried)}: {shown}{more}): the probe "
        f"{read}, over what lowering allows; they wait longer before the next try"
    )


def _why(report: DriftReport, fqn: str) -> str:
    """A module's first-round drift in the metric's own terms."""
    drift = report.first.get(fqn, report.per_module.get(fqn, 0.0))
    part = report.parts.get(fqn)
    if part is None:
        return f"drift {drift:.4f}"
    error, _ = part
    return f"costs {100 * drift:.1f}% of a step's progress: error {error:.2f}x the sampling noise"
