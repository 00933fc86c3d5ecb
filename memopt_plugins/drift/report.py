"""What a drift check found (:class:`DriftReport`), why a module has no drift, the ladder."""

from __future__ import annotations

from collections.abc import Sequence
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
        budget: with ``quantize.budget``, ``(target, kept)``: the budget and the bytes the bits
            keep after the check (predicted from the check's pass by the codec's packed sizes),
            both in bytes of a training forward; ``None`` otherwise.
    """

    step: int
    per_module: dict[str, float] = field(default_factory=dict)
    unmeasured: dict[str, str] = field(default_factory=dict)
    escalated: dict[str, tuple[int, int]] = field(default_factory=dict)
    round_max: tuple[float, ...] = ()
    lowered: dict[str, tuple[int, int]] = field(default_factory=dict)
    threshold: float = 0.05
    metric: str = "rel_l2"
    budget: tuple[float, float] | None = None

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
        return (
            f"DriftReport(step={self.step}, max={self.max:.4f} ({self.metric}, threshold "
            f"{self.threshold}), rounds={self.rounds}, escalated: {moved or 'none'}"
            + (f", lowered: {down})" if down else ")")
        )


def next_rung(ladder: Sequence[int], bits: int) -> int:
    """The first ladder rung above ``bits`` (32 when none is)."""
    return next((b for b in ladder if b > bits), OFF_BITS)


def rung_below(ladder: Sequence[int], bits: int) -> int | None:
    """The last ladder rung below ``bits`` (``None`` when none is)."""
    return next((b for b in reversed(ladder) if b < bits), None)
