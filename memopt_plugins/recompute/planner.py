"""The recompute planner: pick the modules to recompute under a memory budget.

``recompute.auto: {budget: b}`` (and ``memopt plan``) read one
:class:`~memopt_plugins.measure.Measurement` of a forward: the bytes each module's recompute would
free, where it sits in the order of saves, and its forward's operations (a clock-free cost, so the
same model, batch and budget give the same plan). :func:`choose` picks by bytes freed per operation
until at most ``b`` of the baseline saved bytes remain, counting freed bytes off what is kept and
off the estimated backward peak (a replay re-creates activations on top of what is held). It never
picks a module inside a picked one, one freeing more than half of the baseline alone, nor the
model. The forward measured is the first training forward (:meth:`RecomputePlanner.install`; that
step runs at baseline memory) or one on a batch of your choice (:meth:`RecomputePlanner.plan_now`).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import ConfigError
from ..distributed import from_rank_zero
from ..measure.scopes import ScopeTracker, Watch, eagerly
from ..measure.step import Measurement, ModuleCost, Ratio, StepRecorder, measure
from ..select import outermost, parent_fqns, within
from ..tree import tensors_in
from .wrap import IN_RECOMPUTE, RECOMPUTE, Recompute

log = logging.getLogger("memopt")


# --------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class RecomputePlan:
    """The planner's choice; ``str(plan)`` is a table of the candidates, best first."""

    budget: float
    baseline_bytes: int  # saved for backward without any recompute
    kept_bytes: int  # estimated to be saved with the plan
    peak_bytes: int  # estimated most held in backward (kept, or a replay on top of what is held)
    chosen: tuple[str, ...]  # picked by the planner
    fixed: tuple[str, ...]  # recomputed by recompute.modules / types
    candidates: tuple[ModuleCost, ...]  # every module with something to free, best rate first

    @property
    def met(self) -> bool:
        """True when the kept bytes are within the budget."""
        return self.kept_bytes <= self.budget * self.baseline_bytes

    @property
    def kept_fraction(self) -> float:
        return self.kept_bytes / self.baseline_bytes if self.baseline_bytes else 1.0

    def __str__(self) -> str:
        return self.table()

    def table(self, max_rows: int = 40) -> str:
        """The summary line and up to ``max_rows`` candidates with their action."""
        mib = 1 << 20
        status = "" if self.met else " (budget not reachable with these modules)"
        head = (
            f"recompute plan: keeps {self.kept_bytes / mib:.2f} of {self.baseline_bytes / mib:.2f}"
            f" MiB saved for backward ({self.kept_fraction:.0%}, budget {self.budget:.0%})"
            f"{status}, estimated backward peak {self.peak_bytes / mib:.2f} MiB; recompute "
            f"{len(self.chosen) + len(self.fixed)} modules"
        )
        regions = set(self.chosen) | set(self.fixed)
        rows = [("module", "kind", "frees MiB", "MFLOP", "KiB/MFLOP", "action")]
        for c in self.candidates:
            if c.fqn in regions:
                action = RECOMPUTE if c.fqn in self.chosen else f"{RECOMPUTE} (config)"
            elif any(p in regions for p in parent_fqns(c.fqn)):
                action = IN_RECOMPUTE
            else:
                action = "-"
            rows.append(
                (
                    c.fqn,
                    c.kind,
                    f"{c.saved_bytes / mib:.2f}",
                    f"{c.flops / 1e6:.2f}",
                    f"{c.bytes_per_flop * 1e6 / 1024:.1f}",
                    action,
                )
            )
        hidden = max(0, len(rows) - 1 - max_rows)
        rows = rows[: max_rows + 1]
        widths = [max(len(r[i]) for r in rows) for i in range(6)]
        lines = [head] + [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
        if hidden:
            lines.append(f"... {hidden} more candidates")
        return "\n".join(lines)


def estimated_peak(
    regions: Sequence[ModuleCost],
    kept: int,
    replayed: dict[str, ModuleCost] | None = None,
    transient: int = 0,
) -> int:
    """Most bytes held in backward: ``kept`` at its start (plus ``transient``, what the first
    backward ops hold beside it), or a region's replay on top of what is still held then --
    what was saved before the region, less what earlier regions freed. ``replayed``: the
    regions' costs at full precision, where ``regions`` count compressed bytes (a replay
    re-creates its activations uncompressed)."""
    peak = kept + transient
    for r in regions:
        earlier = sum(a.saved_bytes for a in regions if a.end <= r.start and a is not r)
        replay = (replayed or {}).get(r.fqn, r).saved_bytes
        peak = max(peak, r.before_bytes - earlier + replay)
    return peak


def choose(
    measurement: Measurement,
    budget: float,
    fixed: Sequence[str] = (),
    ratio: Ratio | None = None,
    replayed: dict[str, ModuleCost] | None = None,
    transient: int = 0,
) -> RecomputePlan:
    """Pick modules to recompute until at most ``budget`` of the baseline saved bytes remain.

    ``ratio(storage)``: the share of its bytes a storage keeps under compression; then what is
    kept is counted compressed (against the uncompressed baseline), so that recompute is only
    chosen for what compression leaves: where compression alone meets the budget, nothing is.
    Its replays still count at full precision in the peak (they come back uncompressed): a
    region whose replay would hold more than compressing it keeps is not picked; and the
    backward's start holds, beside what is kept, the largest saved storage at full precision
    (decoded: the loss head's logits in a language model), which a replay later in backward does
    not meet. ``replayed`` and ``transient`` are those internals. The batch that fits under the
    planner with int8: ``benchmarks/fits.md``.

    Greedy, best rate first: a candidate's benefit is what it removes from the kept bytes plus
    what it removes from the estimated backward peak (:func:`estimated_peak`), per operation of
    its forward; near the end the cheapest single pick that meets the budget is taken instead
    when it costs less than the best rate would need. A candidate that contains picked modules
    is judged by what it adds over them, and replaces them when picked; one that would raise
    kept + peak is not picked. Never picked: the model itself, modules overlapping ``fixed``
    (recomputed by the config), modules that changed an input in place, and modules freeing more
    than half of the baseline by themselves.
    """
    if not 0 < budget <= 1:
        raise ConfigError(f"recompute.auto.budget: {budget!r} is not a number in (0, 1]")
    if ratio is not None:
        scaled = measurement.scaled(ratio)
        share = budget * measurement.baseline_bytes / max(scaled.baseline_bytes, 1)
        largest = max((st.nbytes for st in measurement.storages), default=0)
        plan = choose(scaled, min(1.0, share), fixed, replayed=measurement.costs, transient=largest)
        return dataclasses.replace(plan, budget=budget, baseline_bytes=measurement.baseline_bytes)
    costs = measurement.costs
    baseline = measurement.baseline_bytes
    fixed_costs = [costs[f] for f in fixed if f in costs]
    kept = baseline - sum(c.saved_bytes for c in fixed_costs)
    pool = [
        c
        for c in costs.values()
        if c.fqn
        and 0 < c.saved_bytes <= baseline // 2
        and c.fqn not in measurement.unsafe
        and not any(c.fqn == f or within(c.fqn, f) or within(f, c.fqn) for f in fixed)
    ]
    greedy = _Greedy(pool, fixed_costs, kept, budget * baseline, replayed, transient)
    greedy.run()
    order = list(costs)
    return RecomputePlan(
        budget=budget,
        baseline_bytes=baseline,
        kept_bytes=greedy.kept,
        peak_bytes=greedy.peak,
        chosen=tuple(sorted(greedy.picked, key=order.index)),
        fixed=tuple(fixed),
        candidates=tuple(sorted(pool, key=lambda c: -c.bytes_per_flop)),
    )


@dataclass(frozen=True)
class _Pick:
    """A candidate judged against the modules picked so far: the picked ones inside it
    (``inner``, replaced when it is picked), what it removes from the kept bytes over them
    (``gain``), the estimated peak with it, its forward's operations over theirs (``flops``)
    and its benefit per operation (``rate``)."""

    cost: ModuleCost
    inner: list[str]
    gain: int
    peak: int
    flops: float
    rate: float


class _Greedy:
    """:func:`choose`'s search: picks from ``pool`` until at most ``target`` bytes are kept
    (:attr:`kept`, :attr:`peak`, :attr:`picked`), beside the modules ``fixed`` recomputes."""

    def __init__(
        self,
        pool: list[ModuleCost],
        fixed: list[ModuleCost],
        kept: int,
        target: float,
        replayed: dict[str, ModuleCost] | None,
        transient: int,
    ):
        self.pool, self.fixed, self.target = pool, fixed, target
        self.replayed, self.transient = replayed, transient
        self.kept = kept
        self.peak = estimated_peak(fixed, kept, replayed, transient)
        self.picked: dict[str, ModuleCost] = {}

    def run(self) -> None:
        while self.kept > self.target:
            pick = self._next()
            if pick is None:
                break
            for p in pick.inner:
                del self.picked[p]
            self.picked[pick.cost.fqn] = pick.cost
            self.kept -= pick.gain
            self.peak = pick.peak

    def _next(self) -> _Pick | None:
        """The best rate's pick, unless one that meets the budget costs less (no overshoot)."""
        best: _Pick | None = None
        closer: _Pick | None = None
        for c in self.pool:
            pick = self._judged(c)
            if pick is None:
                continue
            if best is None or pick.rate > best.rate:
                best = pick
            meets = self.kept - pick.gain <= self.target
            if meets and (closer is None or pick.flops < closer.flops):
                closer = pick
        if best is None:
            return None
        # Do not overshoot: one pick that meets the budget wins when it costs no more than the
        # best-rate pick (when that one meets it too), or than the best rate would need for
        # the remaining bytes (when it does not).
        gap = self.kept - self.target
        needed = best.flops if best.gain >= gap else gap * best.flops / best.gain
        return closer if closer is not None and closer.flops <= needed else best

    def _judged(self, c: ModuleCost) -> _Pick | None:
        """``c`` as a pick (``None``: inside a picked module, or it would free nothing or raise
        kept + peak)."""
        picked = self.picked
        if c.fqn in picked or any(p in picked for p in parent_fqns(c.fqn)):
            return None
        inner = [p for p in picked if within(p, c.fqn)]
        gain = c.saved_bytes - sum(picked[p].saved_bytes for p in inner)
        if gain <= 0:
            return None
        trial = [*self.fixed, *(v for k, v in picked.items() if k not in inner), c]
        new_peak = estimated_peak(trial, self.kept - gain, self.replayed, self.transient)
        benefit = gain + self.peak - new_peak
        if benefit <= 0:
            return None
        flops = max(c.flops - sum(picked[p].flops for p in inner), 1e-9)
        return _Pick(c, inner, gain, new_peak, flops, benefit / flops)


class RecomputePlanner:
    """``recompute.auto``: measure one forward, pick modules under the budget, recompute them.

    Args:
        recompute: the model's :class:`Recompute` (its wrapped modules are the fixed ones).
        budget: keep at most this fraction of the baseline saved bytes.
        on_plan: called after every change of the chosen modules.
        ratio: what compression keeps of each saved storage (see :func:`choose`).
    """

    def __init__(
        self,
        recompute: Recompute,
        budget: float,
        on_plan: Callable[[RecomputePlan | None], None] | None = None,
        ratio: Ratio | None = None,
    ):
        self.recompute = recompute
        self.budget = budget
        self.on_plan = on_plan
        self.ratio = ratio
        self.plan: RecomputePlan | None = None
        self.chosen: tuple[str, ...] = ()
        self._watch: Watch | None = None
        self._recorder: StepRecorder | None = None
        self._contexts = ExitStack()

    @property
    def fixed(self) -> tuple[str, ...]:
        return tuple(f for f in self.recompute.wrapped if f not in self.chosen)

    def install(self) -> None:
        """Measure the first training forward of the model and apply the plan after it."""
        root = self.recompute.model
        self._watch = ScopeTracker.of(root).watch(self, [""], first=True)

    def remove(self) -> None:
        """Stop measuring (the recomputed modules stay until ``Recompute.remove``)."""
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        self._stop()

    def _contexts_of_the_pass(self) -> list[Callable[[], Any]]:
        """Compression suspended, recomputed modules run plainly, and compiled code runs eagerly
        while measuring (a compiled graph hides its modules from the recorder)."""
        suspend = self.recompute.suspend
        return [
            *([suspend] if suspend is not None else []),
            self.recompute.bypassed,
            eagerly,
        ]

    def _stop(self) -> Measurement | None:
        recorder, self._recorder = self._recorder, None
        measurement = recorder.stop() if recorder is not None else None
        self._contexts.close()
        return measurement

    def plan_now(self, run: Callable[[], Any], budget: float | None = None) -> RecomputePlan:
        """Measure ``run()`` now (see :func:`measure`), replace the previous plan, apply it."""
        self.remove()
        self.recompute.unwrap(self.chosen)
        self.chosen, self.plan = (), None
        try:
            measurement = measure(self.recompute.model, run, self._contexts_of_the_pass())
        except BaseException:
            if self.on_plan is not None:
                self.on_plan(None)
            raise
        budget = self.budget if budget is None else budget
        return self._apply(choose(measurement, budget, self.fixed, self.ratio))

    def misfit(self, fqns: Sequence[str]) -> str | None:
        """Why a plan restored from a state dict cannot be adopted (``None``: it can)."""
        names = {f for f, _ in self.recompute.model.named_modules()}
        bad = [f for f in fqns if f not in names or f == ""]
        overlap = [
            f for f in fqns if any(f == x or within(f, x) or within(x, f) for x in self.fixed)
        ]
        if bad or overlap or len(outermost(fqns)) != len(fqns):
            return f"state_dict recompute plan {list(fqns)[:5]} does not fit this model: " + (
                f"no module named {bad[:3]}" if bad else "its modules overlap"
            )
        return None

    def adopt(self, fqns: Sequence[str]) -> None:
        """Recompute exactly these modules (a plan restored from a state dict), no measuring."""
        problem = self.misfit(fqns)
        if problem is not None:
            raise ConfigError(problem)
        self.remove()
        self.recompute.unwrap(self.chosen)
        self.chosen = tuple(self.recompute.wrap(fqns))
        self.plan = None
        log.info("memopt: recompute plan restored: %s", ", ".join(self.chosen) or "nothing")
        if self.on_plan is not None:
            self.on_plan(None)

    def enter(self, fqn: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        # Not where saved-tensor hooks are disabled: the recorder pushes some (measured later).
        hooks = torch._C._autograd._saved_tensors_hooks_is_enabled()
        if self._recorder is None and torch.is_grad_enabled() and module.training and hooks:
            for context in self._contexts_of_the_pass():
                self._contexts.enter_context(context())
            batch = tensors_in((args, kwargs))
            self._recorder = StepRecorder(module, batch, watch_root=False).start()

    def exit(self, fqn: str, module: nn.Module, args: tuple, output: Any) -> None:
        measurement = self._stop()
        if measurement is None or sys.exc_info()[0] is not None:
            return  # not measuring, or the forward failed: measure the next one
        self.remove()
        if not measurement.costs and any(True for _ in module.children()):
            log.warning(
                "memopt: recompute.auto could not measure the first training forward: the model "
                "runs as one compiled graph, which hides its modules. Call "
                "plan_recompute(opt, loss_fn) before training instead (it measures the "
                "model eagerly), or compile per block."
            )
            return
        self._apply(choose(measurement, self.budget, self.fixed, self.ratio))

    def _apply(self, plan: RecomputePlan) -> RecomputePlan:
        # Each rank measured its own batch (other shapes choose other modules): all take rank
        # 0's plan, so they save, compress and check the same modules.
        plan = from_rank_zero(plan)
        self.chosen = tuple(self.recompute.wrap(plan.chosen))
        self.plan = plan
        level = logging.INFO if plan.met else logging.WARNING
        log.log(level, "memopt: %s", plan)
        if self.on_plan is not None:
            self.on_plan(plan)
        return plan
