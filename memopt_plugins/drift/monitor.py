"""The drift monitor: schedules checks, runs them, escalates (and with ``drift.lower`` lowers)
bits, keeps counters and history."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from ..config import OFF_BITS, DriftConfig
from ..distributed import is_rank_zero, max_over_ranks
from ..measure import eagerly
from .budget import Pricing, log_outcome, solve, step_size
from .judges import PARAMS, TENSORS, Judge, find_judges, module_drifts
from .passes import (
    CheckedParameters,
    PassRecorder,
    SignedHalves,
    gradients,
    preserved_state,
    scalar_loss,
    sq_norms,
    summed_over_shards,
)
from .report import HISTORY_LIMIT, NEGLIGIBLE, DriftReport, next_rung, rung_below

log = logging.getLogger("memopt")


class DriftMonitor:
    """Runs drift checks, escalates bits along the ladder, keeps the step counter and history.

    The monitor does not know how compression works: it is given the compressed modules' bits, a
    way to change them, and a context that suspends compression (the exact pass).

    Args:
        config: the ``drift`` section of the config.
    """

    def __init__(self, config: DriftConfig, budget: bool = False):
        self.config = config
        self.budget = budget  # quantize.budget is set: checks come with a pricing
        self.steps = 0
        self.escalations = 0
        self.deescalations = 0
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
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_LIMIT)
        self.last: DriftReport | None = None

    def start(self, configured: Mapping[str, int]) -> None:
        """The bits the config gives each module: ``drift.lower`` never goes under them (a
        restored state keeps its own)."""
        for fqn, bits in configured.items():
            self.floor.setdefault(fqn, int(bits))

    # ----------------------------------------------------------------- scheduling
    def should_check(self, step: int | None = None) -> bool:
        """True when a check is due at ``step`` (default: the counted optimizer steps).

        Checks run at step 0 and every ``check_every`` steps, when ``drift.enabled``.
        """
        step = self.steps if step is None else step
        return self.config.enabled and step % self.config.check_every == 0

    # ----------------------------------------------------------------- the check
    def check(
        self,
        model: nn.Module,
        loss_fn: Callable[[], torch.Tensor],
        bits: Mapping[str, int],
        *,
        set_bits: Callable[[str, int], None],
        suspend: Callable[[], AbstractContextManager],
        generators: Sequence[torch.Generator] = (),
        scopes: Sequence[str] | None = None,
        min_numel: int = 0,
        reduce_max: Callable[[torch.Tensor], torch.Tensor] = max_over_ranks,
        step: int | None = None,
        max_rounds: int | None = None,
        pricing: Callable[[], Pricing | None] | None = None,
    ) -> DriftReport:
        """Measure the drift of the modules in ``bits`` and escalate those over the threshold.

        Args:
            model: the patched model (the one ``loss_fn`` runs; see the module notes on DDP).
            loss_fn: ``loss_fn() -> scalar loss`` on a small batch; called once exact and once per
                round compressed.
            bits: ``{fqn: bits}`` of the compressed modules.
            set_bits: changes the bits of one module (takes effect at its next forward).
            suspend: a context in which nothing is compressed.
            generators: private generators the compressed pass draws from (stochastic rounding);
                restored after the check so that training is unaffected.
            scopes: every module with a compression scope (default: those in ``bits``), so that
                a tensor saved inside a 32-bit scope is not counted for a compressed ancestor.
            min_numel: saved tensors smaller than this are not compressed.
            reduce_max: element-wise max over ranks of a float64 tensor (the integration's
                reduce; identity without torch.distributed).
            step: the step recorded in the report (default: the counted optimizer steps).
            max_rounds: compressed passes at most; ``None`` re-checks until no module escalates,
                ``1`` escalates at most one rung per call.
            pricing: ``quantize.budget``: called after the first compressed pass, what each
                module keeps at each width and the target (:class:`~.budget.Pricing`; ``None``:
                not known yet); the bits are then solved for it (:meth:`_fit_budget`).
        """
        cfg = self.config
        step = self.steps if step is None else step
        current = dict(bits)
        fqns = sorted(current)
        limit = len(cfg.ladder) + 1 if max_rounds is None else max(1, max_rounds)
        if not fqns:
            return self._record(DriftReport(step, threshold=cfg.threshold, metric=cfg.metric))

        checked = CheckedParameters(model)
        params, sharded = checked.params, checked.sharded
        param_free = [f for f in fqns if not checked.own(f)]
        escalated: dict[str, tuple[int, int]] = {}
        lowered_now: dict[str, tuple[int, int]] = {}
        round_max: list[float] = []
        # Eagerly: modules inside compiled graphs are judged too (their hooks fire).
        with eagerly(), preserved_state(model, generators) as one_pass:
            with one_pass(), suspend():
                rec = PassRecorder(model, param_free, fqns if scopes is None else scopes, min_numel)
                with rec:
                    loss = scalar_loss(loss_fn)
                judges, unmeasured = find_judges(fqns, checked, rec)
                wanted = sorted(
                    {i for j in judges.values() if j.kind == TENSORS for i in j.indices}
                )
                layout = rec.layout()
                targets = checked.targets(rec.running) + [rec.tensors[i] for i in wanted]
                exact = gradients(loss, targets, sharded)
                del loss, rec, targets
            position = {i: len(params) + k for k, i in enumerate(wanted)}
            judges = {
                f: j if j.kind == PARAMS else Judge(j.kind, tuple(position[i] for i in j.indices))
                for f, j in judges.items()
            }
            exact_sq = summed_over_shards(sq_norms(exact), sharded)
            floors = {
                PARAMS: NEGLIGIBLE * float(exact_sq[: len(params)].sum().sqrt()),
                TENSORS: NEGLIGIBLE * float(exact_sq[len(params) :].sum().sqrt()),
            }
            variance = None
            if cfg.metric == "noise":  # a second exact pass, its two halves weighted +1 and -1
                with one_pass(), suspend():
                    rec = PassRecorder(model, param_free)
                    with rec, SignedHalves(model) as halves:
                        loss = scalar_loss(loss_fn)
                    tensors = [rec.tensors[i] for i in wanted] if rec.layout() == layout else []
                    spread = gradients(loss, checked.targets(rec.running) + tensors, sharded)
                    del loss, rec, tensors
                variance = summed_over_shards(sq_norms(spread), sharded) * halves.scale
                del spread

            def measured() -> tuple[dict[str, float], dict[str, str]]:
                """One compressed pass: each module's drift (max over ranks) and the unmeasured."""
                with one_pass():
                    rec = PassRecorder(model, param_free)
                    with rec:
                        loss = scalar_loss(loss_fn)
                    aligned = rec.layout() == layout
                    tensors = [rec.tensors[i] for i in wanted] if aligned else []
                    approx = gradients(loss, checked.targets(rec.running) + tensors, sharded)
                    del loss, rec, tensors
                local, missing = module_drifts(
                    fqns, judges, floors, exact, exact_sq, approx, cfg.metric, sharded, variance
                )
                del approx
                drift = _max_of(reduce_max, local, params[0].device if params else None)
                found = {f: d for f, d in zip(fqns, drift, strict=True) if d >= 0}
                absent = {**unmeasured, **missing}
                return found, {f: r for f, r in absent.items() if f not in found}

            first, kept = None, None
            if pricing is not None:  # quantize.budget: the bits are solved from the first pass
                first = measured()
                round_max.append(max(first[0].values(), default=0.0))
                priced = _reduced(pricing(), reduce_max, params[0].device if params else None)
                if priced is not None:
                    start = dict(current)
                    per_module, unmeasured_now, kept = self._fit_budget(
                        first, current, priced, set_bits, step, measured, round_max, limit
                    )
                    escalated = {f: (start[f], b) for f, b in current.items() if b > start[f]}
                    lowered_now = {f: (start[f], b) for f, b in current.items() if b < start[f]}
            while kept is None:
                if first is None:
                    per_module, unmeasured_now = measured()
                    round_max.append(max(per_module.values(), default=0.0))
                else:
                    (per_module, unmeasured_now), first = first, None
                moved = self._escalate(per_module, current, set_bits, step)
                for fqn, (old, new) in moved.items():
                    escalated[fqn] = (escalated.get(fqn, (old, new))[0], new)
                if not moved or len(round_max) >= limit:
                    break
            if kept is None and cfg.lower and not moved:
                calm = {f: d for f, d in per_module.items() if f not in escalated}
                lowered = self._lower(calm, current, set_bits, step, measured, round_max)
                if lowered is not None:
                    per_module, unmeasured_now, lowered_now = lowered
        report = DriftReport(
            step,
            per_module,
            unmeasured_now,
            escalated,
            tuple(round_max),
            lowered_now,
            threshold=cfg.threshold,
            metric=cfg.metric,
            budget=kept,
        )
        return self._record(report)

    def _escalate(
        self,
        per_module: Mapping[str, float],
        current: dict[str, int],
        set_bits: Callable[[str, int], None],
        step: int,
    ) -> dict[str, tuple[int, int]]:
        cfg = self.config
        moved: dict[str, tuple[int, int]] = {}
        for fqn, drift in per_module.items():
            old = current[fqn]
            if drift <= cfg.threshold or old >= OFF_BITS:
                continue
            new = next_rung(cfg.ladder, old)
            set_bits(fqn, new)
            current[fqn] = new
            moved[fqn] = (old, new)
            self.escalations += 1
            self.calm[fqn] = 0
            if fqn in self.lowered:  # back over the threshold after a lowering: wait longer
                self._back_off(fqn)
            if is_rank_zero():
                log.info(
                    "memopt: %s drift %.4f > threshold %.4f (%s) at step %d: bits %d -> %d",
                    fqn or "<root>",
                    drift,
                    cfg.threshold,
                    cfg.metric,
                    step,
                    old,
                    new,
                )
        return moved

    def _back_off(self, fqn: str) -> None:
        base = self.config.lower_after
        self.wait[fqn] = min(8 * base, 2 * self.wait.get(fqn, base))

    def _lower(
        self,
        per_module: Mapping[str, float],
        current: dict[str, int],
        set_bits: Callable[[str, int], None],
        step: int,
        measured: Callable[[], tuple[dict[str, float], dict[str, str]]],
        round_max: list[float],
    ) -> tuple[dict[str, float], dict[str, str], dict[str, tuple[int, int]]] | None:
        """``drift.lower``: modules calm for ``lower_after`` checks go down one rung, probed by
        one compressed pass; a module whose probe is not calm goes back up and waits longer.
        Returns the probe's drifts, unmeasured modules and the lowerings kept (``None``: no
        module was due). Every rank decides the same: drifts are max-reduced over ranks."""
        cfg = self.config
        calm_below = cfg.lower_below * cfg.threshold
        due: dict[str, tuple[int, int]] = {}
        for fqn, drift in per_module.items():
            old = current[fqn]
            lower = rung_below(cfg.ladder, old)
            # Never under its starting bits, nor past lower_changes with a try and a return.
            changes = self.changes.get(fqn, 0) + 2
            if lower is None or lower < self.floor.get(fqn, old) or changes > cfg.lower_changes:
                continue
            # Calm at its bits; whether it stays calm a rung lower, the probe measures: a
            # module's drift is mostly the other modules' rounding (backward carries it), so
            # scaling its own drift by the step size (1 / (2^b - 1)) overstates it many times.
            calm = drift <= calm_below
            self.calm[fqn] = self.calm.get(fqn, 0) + 1 if calm else 0
            if self.calm[fqn] >= self.wait.get(fqn, cfg.lower_after):
                due[fqn] = (old, lower)
        if not due:
            return None
        for fqn, (_, lower) in due.items():
            set_bits(fqn, lower)
            current[fqn] = lower
        probe, unmeasured = measured()
        round_max.append(max(probe.values(), default=0.0))
        kept: dict[str, tuple[int, int]] = {}
        # The threshold stays a hard cap: a module pushed over it by the lowered ones around it
        # undoes them all.
        others_over = any(d > cfg.threshold for f, d in probe.items() if f not in due)
        for fqn, (old, lower) in due.items():
            self.calm[fqn] = 0
            drift = probe.get(fqn)
            if others_over or (drift is not None and drift > calm_below):  # back up
                set_bits(fqn, old)
                current[fqn] = old
                self._back_off(fqn)
                probe[fqn] = per_module[fqn]  # its drift at the bits it keeps
                continue
            kept[fqn] = (old, lower)
            self.lowered.add(fqn)
            self.deescalations += 1
            if is_rank_zero():
                log.info(
                    "memopt: %s drift %.4f <= %.4f (%.2f x threshold, %s) at %d bits at step %d: "
                    "bits %d -> %d",
                    fqn or "<root>",
                    drift if drift is not None else 0.0,
                    calm_below,
                    cfg.lower_below,
                    cfg.metric,
                    lower,
                    step,
                    old,
                    lower,
                )
        return probe, unmeasured, kept

    # ----------------------------------------------------------------- quantize.budget
    def _fit_budget(
        self,
        first: tuple[dict[str, float], dict[str, str]],
        current: dict[str, int],
        priced: Pricing,
        set_bits: Callable[[str, int], None],
        step: int,
        measured: Callable[[], tuple[dict[str, float], dict[str, str]]],
        round_max: list[float],
        limit: int,
    ) -> tuple[dict[str, float], dict[str, str], tuple[float, float]]:
        """Solve the bits for the budget and probe each solution with one compressed pass.

        A probe that finds a module over the threshold undoes the solution's lowerings (the new
        rounding is what pushed it over: a module's drift is mostly the others' rounding, so the
        module over it is seldom the one to blame) and holds those modules where they were; a
        module over it with nothing lowered goes one rung up and is held there. A hold lasts a
        module's wait in checks (``drift.lower_after``, doubled per hold up to 8x): bounded
        back-off. Returns the drifts and unmeasured modules of the last calm pass (else the
        last pass) and (target, kept) in bytes of a training forward."""
        cfg = self.config
        per_module, unmeasured = first
        at = dict(current)  # the bits the last pass ran at
        self.held = {f: (w, n - 1) for f, (w, n) in self.held.items() if n > 1}
        verified = not any(d > cfg.threshold for d in per_module.values())
        if verified:  # sensitivities from calm passes only: an over one is others' rounding
            self._learn(per_module, unmeasured, current)
        self._hold_over(per_module, current, set_bits, step)
        calm, reverted = (first if verified else None), False
        for _ in range(limit):
            unknown = max(self.sensitivity.values(), default=1.0)  # never measured below 32
            sensitivity = {f: self.sensitivity.get(f, unknown) for f in current}
            floors = {f: w for f, (w, _) in self.held.items()}
            plan = solve(current, priced, sensitivity, cfg.ladder, floors, cfg.threshold)
            changes = {f: (current[f], b) for f, b in plan.items() if b != current[f]}
            if not changes and verified:
                break
            for fqn, (old, new) in changes.items():
                drift = (per_module.get(fqn), at[fqn])
                self._budget_move(fqn, old, new, drift, set_bits, current, step)
            per_module, unmeasured = measured()
            round_max.append(max(per_module.values(), default=0.0))
            at = dict(current)
            over = sorted(f for f, d in per_module.items() if d > cfg.threshold)
            reverted = False
            if not over:
                self._learn(per_module, unmeasured, current)
                verified, calm = True, (per_module, unmeasured)
                continue
            lowered = {f: old for f, (old, new) in changes.items() if new < old}
            if lowered:  # undo this round (its raises paid for by its lowerings): the state
                reverted = True  # before it stands again, and the lowered ones are held
                for fqn, (old, _) in changes.items():
                    self._budget_move(fqn, current[fqn], old, (None, 0), set_bits, current, step)
                for fqn, old in lowered.items():
                    self.held[fqn] = (old, self.wait.get(fqn, cfg.lower_after))
                    self._back_off(fqn)
                if is_rank_zero():
                    log.info(
                        "memopt: quantize.budget at step %d: the probe of %d lowered modules "
                        "found %s over drift.threshold %.4f; they go back and are held",
                        step,
                        len(lowered),
                        ", ".join(f or "<root>" for f in over[:3])
                        + (", ..." if len(over) > 3 else ""),
                        cfg.threshold,
                    )
            else:
                verified = not self._hold_over(per_module, current, set_bits, step)
        if reverted and calm is not None:  # the last probe's bits are gone: the calm pass's
            per_module, unmeasured = calm
        kept = priced.total(current)
        floor = cfg.ladder[0]
        held = sorted(f for f, (w, _) in self.held.items() if current.get(f, floor) > floor)
        log_outcome(priced, kept, held, floor, step)
        return per_module, unmeasured, (priced.target * priced.scale, kept * priced.scale)

    def _learn(
        self,
        per_module: Mapping[str, float],
        unmeasured: Mapping[str, str],
        bits: Mapping[str, int],
    ) -> None:
        """Sensitivities (drift per unit of step size) from a pass at ``bits``; a module without
        measurable drift has none."""
        for fqn, drift in per_module.items():
            if bits[fqn] < OFF_BITS:
                self.sensitivity[fqn] = drift / step_size(bits[fqn])
        for fqn in unmeasured:
            self.sensitivity[fqn] = 0.0

    def _hold_over(
        self,
        per_module: Mapping[str, float],
        current: dict[str, int],
        set_bits: Callable[[str, int], None],
        step: int,
    ) -> dict[str, tuple[int, int]]:
        """Modules over the threshold go one rung up and the budget's solver may not take them
        under it for the next checks (their wait, doubled each time, at most 8x lower_after)."""
        moved = self._escalate(per_module, current, set_bits, step)
        for fqn, (_, new) in moved.items():
            self.held[fqn] = (new, self.wait.get(fqn, self.config.lower_after))
            self._back_off(fqn)
        return moved

    def _budget_move(
        self,
        fqn: str,
        old: int,
        new: int,
        drift: tuple[float | None, int],
        set_bits: Callable[[str, int], None],
        current: dict[str, int],
        step: int,
    ) -> None:
        """One change the budget's solver made: set, counted, logged (with the drift measured
        last and the bits it was measured at)."""
        set_bits(fqn, new)
        current[fqn] = new
        if new > old:
            self.escalations += 1
        else:
            self.deescalations += 1
        if is_rank_zero():
            sensitivity = self.sensitivity.get(fqn)
            log.info(
                "memopt: %s bits %d -> %d at step %d for quantize.budget (drift %s at %s bits, "
                "predicted %s at %d)",
                fqn or "<root>",
                old,
                new,
                step,
                "-" if drift[0] is None else f"{drift[0]:.4f}",
                drift[1] or "-",
                "-" if sensitivity is None else f"{sensitivity * step_size(new):.4f}",
                new,
            )

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
                "budget": None if report.budget is None else list(report.budget),
            }
        )
        return report

    # ----------------------------------------------------------------- metrics and state
    def metrics(self) -> dict[str, float]:
        """``memopt/drift/max``, ``memopt/drift/<fqn>`` (last check), ``memopt/escalations`` and,
        with ``drift.lower``, ``memopt/deescalations``."""
        out: dict[str, float] = {"memopt/escalations": float(self.escalations)}
        if self.config.lower or self.budget:
            out["memopt/deescalations"] = float(self.deescalations)
        if self.last is not None:
            out["memopt/drift/max"] = self.last.max
            for fqn, drift in self.last.per_module.items():
                out[f"memopt/drift/{fqn or '<root>'}"] = drift
        return out

    def state_dict(self) -> dict[str, Any]:
        """Step counter, escalation count, history and the last report (plain Python types)."""
        last = self.last
        return {
            "steps": self.steps,
            "escalations": self.escalations,
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
        """Restore what :meth:`state_dict` saved."""
        self.steps = int(state.get("steps", 0))
        self.escalations = int(state.get("escalations", 0))
        lowering = state.get("lowering", {})
        self.deescalations = int(lowering.get("deescalations", 0))
        self.floor = {k: int(v) for k, v in lowering.get("floor", {}).items()}
        self.calm = {k: int(v) for k, v in lowering.get("calm", {}).items()}
        self.wait = {k: int(v) for k, v in lowering.get("wait", {}).items()}
        self.lowered = {str(f) for f in lowering.get("lowered", ())}
        self.changes = {k: int(v) for k, v in lowering.get("changes", {}).items()}
        budget = state.get("budget", {})
        self.sensitivity = {k: float(v) for k, v in budget.get("sensitivity", {}).items()}
        self.held = {k: (int(w), int(n)) for k, (w, n) in budget.get("held", {}).items()}
        self.history = deque((dict(h) for h in state.get("history", ())), maxlen=HISTORY_LIMIT)
        last = state.get("last")
        self.last = (
            None
            if last is None
            else DriftReport(
                int(last["step"]),
                {k: float(v) for k, v in last["per_module"].items()},
                dict(last.get("unmeasured", {})),
                {k: (int(a), int(b)) for k, (a, b) in last.get("escalated", {}).items()},
                tuple(float(v) for v in last.get("round_max", ())),
                {k: (int(a), int(b)) for k, (a, b) in last.get("lowered", {}).items()},
                threshold=float(last.get("threshold", self.config.threshold)),
                metric=str(last.get("metric", self.config.metric)),
                budget=None if last.get("budget") is None else tuple(last["budget"]),
            )
        )


def _reduced(
    priced: Pricing | None,
    reduce_max: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device | None,
) -> Pricing | None:
    """``priced`` with every number max-reduced over ranks, so that all ranks solve the same."""
    if priced is None:
        return None
    fqns = sorted(priced.costs)
    widths = sorted({b for c in priced.costs.values() for b in c})
    values = [priced.costs[f][b] for f in fqns for b in widths] + [priced.target, priced.scale]
    out = iter(_max_of(reduce_max, values, device))
    costs = {f: {b: next(out) for b in widths} for f in fqns}
    return Pricing(costs, next(out), next(out))


def _max_of(
    reduce_max: Callable[[torch.Tensor], torch.Tensor],
    values: list[float],
    device: torch.device | None,
) -> list[float]:
    """``values`` max-reduced over ranks by ``reduce_max`` (as a float64 tensor on ``device``)."""
    if not values:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device or torch.device("cpu"))
    return reduce_max(t).cpu().tolist()
