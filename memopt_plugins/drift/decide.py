"""The drift check's decision: which modules go up the ladder, which come down (``drift.lower``),
and the bits solved for ``quantize.budget``, each change probed by a round (:class:`Decision`).

A decision acts on the bits through the check's :class:`~.request.CompressionFace` and keeps its
counters and its memory across checks (calm checks, waits, holds, sensitivities) on the
:class:`~.monitor.DriftMonitor`, whose state they are. Every rank decides the same: the rounds
it reads are max-reduced over ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from ..config import OFF_BITS
from .budget import Pricing, log_outcome, solve, step_size
from .exact import device_of
from .judges import Whole
from .passes import max_reduced
from .report import BUDGET_TOLERANCE, DriftReport, next_rung, rung_below
from .request import DriftCheck
from .rounds import Round, Rounds

if TYPE_CHECKING:
    from .monitor import DriftMonitor

log = logging.getLogger("memopt")

#: A rung up cuts a module's own rounding error about this much (one more bit halves a step;
#: 4 -> 8 bits: 16x).
RUNG_CUT = 1 / 16
#: sgd: modules are chosen until the whole gradient's cost is predicted under this share of the
#: threshold, so that the probe finds it under (a module's own error is not all it removes).
MARGIN = 0.8


def over_threshold(found: Round, threshold: float) -> list[str]:
    """The modules to raise. Without a whole-gradient cost: those over ``threshold``. With it
    (metric ``sgd``): none while it is under; over it, modules by their own share of the error
    (then by their own cost) until the cost without the error they would shed is predicted under
    ``MARGIN`` x the threshold, at least one."""
    per_module, whole = found.drift, found.total
    if whole is None:
        return sorted(f for f, d in per_module.items() if d > threshold)
    if whole.cost <= threshold or not per_module:
        return []
    order = sorted(per_module, key=lambda f: (-found.energy.get(f, 0.0), -per_module[f], f))
    chosen, shed = [], 0.0
    for fqn in order:
        if chosen and whole.cost_without(shed) <= MARGIN * threshold:
            break
        chosen.append(fqn)
        shed += found.energy.get(fqn, 0.0) * (1 - RUNG_CUT)
    return sorted(chosen)


def reduced_pricing(
    priced: Pricing | None,
    reduce_max: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device | None,
) -> Pricing | None:
    """``priced`` with every number max-reduced over ranks, so that all ranks solve the same."""
    if priced is None:
        return None
    fqns = sorted(priced.costs)
    widths = priced.widths
    values = [priced.costs[f][b] for f in fqns for b in widths] + [priced.target, priced.scale]
    out = iter(max_reduced(reduce_max, values, device))
    costs = {f: {b: next(out) for b in widths} for f in fqns}
    return Pricing(costs, next(out), next(out), priced.key)


class Decision:
    """One check's changes to the bits, from its rounds (:meth:`decide`), and its report
    (:meth:`report`).

    Args:
        monitor: holds the counters and what carries over between checks.
        check: the check (its face changes the bits; ``max_rounds`` bounds the rounds).
        rounds: runs the check's rounds at the bits of the moment.
        step: the step the check reports.
    """

    def __init__(self, monitor: DriftMonitor, check: DriftCheck, rounds: Rounds, step: int):
        self.monitor, self.config = monitor, monitor.config
        self.set_bits = check.face.set_bits
        self.current = dict(check.face.bits)  # the bits of the moment
        self.start = dict(self.current)
        self.rounds, self.step = rounds, step
        limit = check.max_rounds
        self.limit = len(self.config.ladder) + 1 if limit is None else max(1, limit)
        self.trail: dict[str, list[int]] = {}  # the bits each raised module went through
        self.lowered: dict[str, tuple[int, int]] = {}  # drift.lower's lowerings kept
        #: drift.lower's tries the probe sent back, and the probe's drift (or whole cost)
        self.tried: dict[str, tuple[int, int]] = {}
        self.tried_probe: float | None = None
        self.kept: tuple[float, float] | None = None  # quantize.budget: (target, kept) bytes
        self.target_key = "quantize.budget"  # the key(s) of the memory target, for the log
        #: the first round's whole parameter gradient (``None`` where the budget set the bits)
        self.first_total: Whole | None = None
        self.last: Round | None = None  # the round the report shows

    def decide(self, pricing: Callable[[], Pricing | None] | None) -> None:
        """Escalate until no module is over the threshold or the rounds run out, then lower
        calm modules (``drift.lower``); with ``pricing`` (``quantize.budget``) the bits are
        solved from the first round instead, once a price is known."""
        first = None
        rounds = self.rounds
        if pricing is not None:  # quantize.budget: the bits are solved from the first pass
            first = rounds.run()
            device = device_of(rounds.passes.checked)
            priced = reduced_pricing(pricing(), rounds.reduce_max, device)
            if priced is not None:
                self.last, self.kept = self.fit_budget(first, priced)
        moved: dict[str, tuple[int, int]] = {}
        while self.kept is None:
            if first is None:
                self.last = rounds.run()
            else:
                self.last, first = first, None
            if len(rounds.round_max) == 1:
                self.first_total = self.last.total
            moved = self.escalate(self.last, rounds.passes.finished)
            for fqn, (old, new) in moved.items():
                self.trail.setdefault(fqn, [old]).append(new)
            if not moved or len(rounds.round_max) >= self.limit:
                break
        if self.kept is None and self.config.lower and not moved:
            calm = {f: d for f, d in self.last.drift.items() if f not in self.trail}
            lowered = self.lower(calm)
            if lowered is not None and lowered[1]:  # the probe's bits are the ones kept
                self.last, self.lowered = lowered

    def report(self, metric: str) -> DriftReport:
        """What the check found and changed (``metric``: the one it judged by)."""
        current, start, rounds, last = self.current, self.start, self.rounds, self.last
        escalated = {f: (start[f], b) for f, b in current.items() if b > start[f]}
        lowered = self.lowered
        if self.kept is not None:
            lowered = {f: (start[f], b) for f, b in current.items() if b < start[f]}
        # Nothing measured, nothing judged: no cost of the whole gradient to claim either.
        blind = not rounds.first_drift and not rounds.skipped
        first_total = self.first_total
        return DriftReport(
            self.step,
            last.drift,
            last.unmeasured,
            escalated,
            tuple(rounds.round_max),
            lowered,
            threshold=self.config.threshold,
            metric=metric,
            budget=self.kept,
            skipped=tuple(sorted(rounds.skipped)),
            first=rounds.first_drift,
            parts=rounds.first_parts,
            total=(None, None)
            if blind
            else (
                None if first_total is None else first_total.cost,
                None if last is None or last.total is None else last.total.cost,
            ),
            blind=blind,
            tried_lower=dict(self.tried),
            tried_probe=self.tried_probe,
        )

    # ----------------------------------------------------------------- up and down the ladder
    def escalate(
        self, found: Round | Mapping[str, float], finished: Mapping[str, int] | None = None
    ) -> dict[str, tuple[int, int]]:
        """Every module over the threshold one rung up (the check's INFO line says which).

        ``found``: a round, or the drifts of modules chosen to go up. With the whole gradient's
        cost (metric ``sgd``) the threshold judges that (:func:`over_threshold`).

        A module over it at 32 bits keeps nothing compressed: its drift is inherited, carried
        back by backward from modules whose forward ended after its own (``finished``: when each
        ended in the exact pass), and those still compressed go one rung up instead."""
        cfg, monitor, current = self.config, self.monitor, self.current
        per_module = found.drift if isinstance(found, Round) else found
        if isinstance(found, Round):
            over = over_threshold(found, cfg.threshold)
        else:
            over = sorted(per_module)
        raise_ = {f for f in over if current[f] < OFF_BITS}
        for fqn in over:
            if current[fqn] >= OFF_BITS and finished and fqn in finished:
                after = finished[fqn]
                raise_.update(
                    f
                    for f, end in finished.items()
                    if end > after and current.get(f, OFF_BITS) < OFF_BITS
                )
        moved: dict[str, tuple[int, int]] = {}
        for fqn in sorted(raise_):
            old = current[fqn]
            new = next_rung(cfg.ladder, old)
            self._set(fqn, new)
            moved[fqn] = (old, new)
            monitor.escalations += 1
            monitor.calm[fqn] = 0
            if fqn in monitor.lowered:  # back over the threshold after a lowering: wait longer
                self.back_off(fqn)
        return moved

    def back_off(self, fqn: str) -> None:
        """``fqn`` waits twice as long before its next lowering, at most 8x ``lower_after``."""
        base, wait = self.config.lower_after, self.monitor.wait
        wait[fqn] = min(8 * base, 2 * wait.get(fqn, base))

    def lower(
        self, per_module: Mapping[str, float]
    ) -> tuple[Round, dict[str, tuple[int, int]]] | None:
        """``drift.lower``: modules calm for ``lower_after`` checks go down one rung, probed by
        one round; a module whose probe is not calm goes back up and waits longer. Returns the
        probe and the lowerings kept (``None``: no module was due)."""
        cfg = self.config
        calm_below = cfg.lower_below * cfg.threshold
        due = self._due(per_module, calm_below)
        if not due:
            return None
        for fqn, (_, lower) in due.items():
            self._set(fqn, lower)
        probe = self.rounds.run()
        kept: dict[str, tuple[int, int]] = {}
        # The threshold stays a hard cap: a module pushed over it by the lowered ones around it
        # undoes them all.
        others_over = any(d > cfg.threshold for f, d in probe.drift.items() if f not in due)
        if probe.total is not None:  # sgd: the whole model's cost is what the threshold caps
            others_over = probe.total.cost > cfg.threshold
        monitor = self.monitor
        read = (
            probe.total.cost if probe.total is not None else max(probe.drift.values(), default=None)
        )
        for fqn, (old, lower) in due.items():
            monitor.calm[fqn] = 0
            drift = probe.drift.get(fqn)
            if others_over or (drift is not None and drift > calm_below):  # back up
                self._set(fqn, old)
                self.back_off(fqn)
                self.tried[fqn] = (old, lower)
                self.tried_probe = read
                probe.drift[fqn] = per_module[fqn]  # its drift at the bits it keeps
                continue
            kept[fqn] = (old, lower)
            monitor.lowered.add(fqn)
            monitor.deescalations += 1
        return probe, kept

    def _due(
        self, per_module: Mapping[str, float], calm_below: float
    ) -> dict[str, tuple[int, int]]:
        """The modules calm at or under ``calm_below`` for their wait in checks, with the rung
        each would go down to (their calm checks counted)."""
        cfg, monitor = self.config, self.monitor
        due: dict[str, tuple[int, int]] = {}
        for fqn, drift in per_module.items():
            old = self.current[fqn]
            lower = rung_below(cfg.ladder, old)
            # Never under its starting bits, nor past lower_changes with a try and a return.
            changes = monitor.changes.get(fqn, 0) + 2
            if lower is None or lower < monitor.floor.get(fqn, old) or changes > cfg.lower_changes:
                continue
            # Calm at its bits; whether it stays calm a rung lower, the probe measures: a
            # module's drift is mostly the other modules' rounding (backward carries it), which
            # no scaling of its own drift by the step size (1 / (2^b - 1)) predicts.
            calm = drift <= calm_below
            monitor.calm[fqn] = monitor.calm.get(fqn, 0) + 1 if calm else 0
            if monitor.calm[fqn] >= monitor.wait.get(fqn, cfg.lower_after):
                due[fqn] = (old, lower)
        return due

    def _set(self, fqn: str, bits: int) -> None:
        self.set_bits(fqn, bits)
        self.current[fqn] = bits

    # ----------------------------------------------------------------- quantize.budget
    def fit_budget(self, first: Round, priced: Pricing) -> tuple[Round, tuple[float, float]]:
        """Solve the bits for the budget and probe each solution with one compressed pass.

        A probe that finds a module over the threshold undoes the solution's lowerings (the new
        rounding is what pushed it over: a module's drift is mostly the others' rounding, so the
        module over it is seldom the one to blame) and holds those modules where they were; a
        module over it with nothing lowered goes one rung up and is held there. A hold lasts a
        module's wait in checks (``drift.lower_after``, doubled per hold up to 8x): bounded
        back-off. The budget is the cap: a module over the threshold goes up only while the bits
        still fit it, and one WARNING names those it holds back and what raising them needs.
        Returns the last calm round (else the last round) and (target, kept) in bytes of a
        training forward."""
        cfg, monitor, current = self.config, self.monitor, self.current
        self.target_key = priced.key
        found = first
        at = dict(current)  # the bits the last pass ran at
        monitor.held = {f: (w, n - 1) for f, (w, n) in monitor.held.items() if n > 1}
        short: dict[str, float] = {}  # modules the budget holds under what the threshold wants
        verified = not over_threshold(found, cfg.threshold)
        if verified:  # sensitivities from calm passes only: an over one is others' rounding
            self.learn(found)
        self.hold_over(found, priced, short)
        calm, reverted = (first if verified else None), False
        for _ in range(self.limit):
            changes = self._solved(priced)
            if not changes and verified:
                break
            for fqn, (old, new) in changes.items():
                self.budget_move(fqn, old, new, (found.drift.get(fqn), at[fqn]))
            found = self.rounds.run()
            at = dict(current)
            over = over_threshold(found, cfg.threshold)
            reverted = False
            if not over:
                self.learn(found)
                verified, calm = True, found
                continue
            lowered = {f: old for f, (old, new) in changes.items() if new < old}
            if lowered:  # undo this round (its raises paid for by its lowerings): the state
                reverted = True  # before it stands again, and the lowered ones are held
                self._undo(changes, lowered, over)
            else:
                verified = not self.hold_over(found, priced, short)
        if reverted and calm is not None:  # the last probe's bits are gone: the calm pass's
            found = calm
        return found, self._budget_kept(priced, short)

    def _solved(self, priced: Pricing) -> dict[str, tuple[int, int]]:
        """The changes the budget's solver makes to the bits of the moment: ``{fqn: (old,
        new)}`` (a module never measured below 32 bits has the largest sensitivity known)."""
        monitor, current = self.monitor, self.current
        unknown = max(monitor.sensitivity.values(), default=1.0)
        sensitivity = {f: monitor.sensitivity.get(f, unknown) for f in current}
        floors = {f: w for f, (w, _) in monitor.held.items()}
        plan = solve(current, priced, sensitivity, priced.widths, floors, self.config.threshold)
        return {f: (current[f], b) for f, b in plan.items() if b != current[f]}

    def _undo(
        self,
        changes: Mapping[str, tuple[int, int]],
        lowered: Mapping[str, int],
        over: list[str],
    ) -> None:
        """A probe found ``over`` over the threshold: ``changes`` go back, and the modules
        ``lowered`` are held at their bits before it."""
        cfg, monitor = self.config, self.monitor
        for fqn, (old, _) in changes.items():
            self.budget_move(fqn, self.current[fqn], old, (None, 0))
        for fqn, old in lowered.items():
            monitor.held[fqn] = (old, monitor.wait.get(fqn, cfg.lower_after))
            self.back_off(fqn)
        if monitor.speaks():
            log.info(
                "memopt: %s at step %d: the probe of %d lowered modules "
                "found %s over drift.threshold %.4f; they go back and are held",
                self.target_key,
                self.step,
                len(lowered),
                ", ".join(f or "<root>" for f in over[:3]) + (", ..." if len(over) > 3 else ""),
                cfg.threshold,
            )

    def _budget_kept(self, priced: Pricing, short: Mapping[str, float]) -> tuple[float, float]:
        """The outcome's lines (and the WARNING for the modules the budget holds back,
        ``short``); returns (target, kept) in bytes of a training forward."""
        cfg, monitor, current = self.config, self.monitor, self.current
        kept = priced.total(current)
        floor = min(priced.widths, default=cfg.ladder[0])
        held = sorted(f for f, (w, _) in monitor.held.items() if current.get(f, floor) > floor)
        log_outcome(priced, kept, held, floor, self.step)
        if short and monitor.speaks():
            log.warning(
                "memopt: %s %.2f MiB holds %d module(s) at step %d that "
                "drift.threshold %.4f would raise: %s; a rung up for them needs %.2f MiB more",
                priced.key,
                priced.target * priced.scale / 2**20,
                len(short),
                self.step,
                cfg.threshold,
                ", ".join(f or "<root>" for f in sorted(short)[:8])
                + (", ..." if len(short) > 8 else ""),
                sum(short.values()) * priced.scale / 2**20,
            )
        return priced.target * priced.scale, kept * priced.scale

    def learn(self, found: Round) -> None:
        """Sensitivities (drift per unit of step size) from a round at the bits of the moment;
        a module without measurable drift has none."""
        bits, sensitivity = self.current, self.monitor.sensitivity
        for fqn, drift in found.drift.items():
            if bits[fqn] < OFF_BITS:
                sensitivity[fqn] = drift / step_size(bits[fqn])
        for fqn in found.unmeasured:
            sensitivity[fqn] = 0.0

    def hold_over(
        self, found: Round, priced: Pricing, short: dict[str, float]
    ) -> dict[str, tuple[int, int]]:
        """Modules over the threshold go one rung up while the bits fit the budget (most drift
        first), and the budget's solver may not take them under it for the next checks (their
        wait, doubled each time, at most 8x lower_after); the others are noted in ``short``
        with the bytes their rung up would add."""
        cfg, monitor, current = self.config, self.monitor, self.current
        over = over_threshold(found, cfg.threshold)
        total = priced.total(current)
        allowed: dict[str, float] = {}
        for fqn in sorted(over, key=lambda f: -found.drift[f]):
            old = current[fqn]
            if old >= OFF_BITS:
                continue
            cost = priced.costs.get(fqn, {})
            extra = cost.get(next_rung(cfg.ladder, old), 0.0) - cost.get(old, 0.0)
            if total + extra > priced.target * (1 + BUDGET_TOLERANCE):
                short[fqn] = extra
                continue
            total += extra
            allowed[fqn] = found.drift[fqn]
        moved = self.escalate(allowed)
        for fqn, (_, new) in moved.items():
            monitor.held[fqn] = (new, monitor.wait.get(fqn, cfg.lower_after))
            self.back_off(fqn)
        return moved

    def budget_move(self, fqn: str, old: int, new: int, drift: tuple[float | None, int]) -> None:
        """One change the budget's solver made: set, counted, logged (with the drift measured
        last and the bits it was measured at)."""
        monitor = self.monitor
        self._set(fqn, new)
        if new > old:
            monitor.escalations += 1
        else:
            monitor.deescalations += 1
        if monitor.speaks():
            sensitivity = monitor.sensitivity.get(fqn)
            log.info(
                "memopt: %s bits %d -> %d at step %d for %s (drift %s at %s bits, "
                "predicted %s at %d)",
                fqn or "<root>",
                old,
                new,
                self.step,
                self.target_key,
                "-" if drift[0] is None else f"{drift[0]:.4f}",
                drift[1] or "-",
                "-" if sensitivity is None else f"{sensitivity * step_size(new):.4f}",
                new,
            )
