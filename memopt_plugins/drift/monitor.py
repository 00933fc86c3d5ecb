"""The drift monitor: schedules checks, runs them, escalates (and with ``drift.lower`` lowers)
bits, keeps counters and history."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import astuple, dataclass, field
from typing import Any

import torch
from torch import nn

from ..config import OFF_BITS, DriftConfig, checked_bits
from ..config_io import reading_state, state_count, state_list, state_map, state_name
from ..distributed import is_rank_zero, max_over_ranks
from ..measure.scopes import eagerly
from .budget import Pricing, log_outcome, solve, step_size
from .judges import (
    NOT_FINITE,
    PARAMS,
    TENSORS,
    Judge,
    NoiseScale,
    Whole,
    find_judges,
    module_drifts,
)
from .passes import (
    CheckedParameters,
    PassGradients,
    PassRecorder,
    SampleInputs,
    SignedHalves,
    gradients,
    merged,
    preserved_state,
    scalar_loss,
    summed_over_shards,
)
from .report import (
    BUDGET_TOLERANCE,
    CALLS_DIFFER,
    HISTORY_LIMIT,
    NEGLIGIBLE,
    NON_FINITE,
    SAVES_NOTHING,
    DriftReport,
    describe_check,
    next_rung,
    rung_below,
)

log = logging.getLogger("memopt")


@dataclass
class Round:
    """One round of compressed passes at the bits of the moment."""

    drift: dict[str, float]  # measurable drift per module (max over ranks)
    unmeasured: dict[str, str]  # why the others have none
    parts: dict[str, tuple[float, float]]  # metric sgd: (error ratio, noise scale / batch)
    total: Whole | None = None  # metric sgd: the whole parameter gradient (max over ranks)
    energy: dict[str, float] = field(default_factory=dict)  # sgd: each module's own error


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
    def check(
        self,
        model: nn.Module,
        loss_fn: Callable[[], torch.Tensor],
        bits: Mapping[str, int],
        *,
        set_bits: Callable[[str, int], None],
        suspend: Callable[[], AbstractContextManager],
        as_training: Callable[[tuple[int, int] | None], AbstractContextManager] | None = None,
        generators: Sequence[torch.Generator] = (),
        scopes: Sequence[str] | None = None,
        min_numel: int = 0,
        reduce_max: Callable[[torch.Tensor], torch.Tensor] = max_over_ranks,
        step: int | None = None,
        max_rounds: int | None = None,
        pricing: Callable[[], Pricing | None] | None = None,
        batch_size: int | None = None,
        speaks: Callable[[], bool] | None = None,
        cut: Callable[[int], Sequence[Callable[[], torch.Tensor]]] | None = None,
        most: int = 0,
    ) -> DriftReport:
        """Measure the drift of the modules in ``bits`` and escalate those over the threshold.

        Args:
            model: the patched model (the one ``loss_fn`` runs; see the module notes on DDP).
            loss_fn: ``loss_fn() -> scalar loss`` on a small batch; called once exact and once per
                round compressed.
            bits: ``{fqn: bits}`` of the compressed modules.
            set_bits: changes the bits of one module (takes effect at its next forward).
            suspend: a context in which nothing is compressed.
            as_training: ``as_training((samples, batch))``: a context in which compression keeps
                or compresses each tensor saved on the check's samples as it does its
                counterpart in a training forward on ``batch`` samples (``None``: by its own
                size against ``min_numel``).
            generators: private generators the compressed pass draws from (stochastic rounding);
                restored after the check so that training is unaffected.
            scopes: every module with a compression scope (default: those in ``bits``), so that
                a tensor saved inside a 32-bit scope is not counted for a compressed ancestor.
            min_numel: saved tensors smaller than this in a training forward are not
                compressed (judged at the training batch's size with ``batch_size``).
            reduce_max: element-wise max over ranks of a float64 tensor (the integration's
                reduce; identity without torch.distributed).
            step: the step recorded in the report (default: the counted optimizer steps).
            max_rounds: compressed passes at most; ``None`` re-checks until no module escalates,
                ``1`` escalates at most one rung per call.
            pricing: ``quantize.budget``: called after the first compressed pass, what each
                module keeps at each width and the target (:class:`~.budget.Pricing`; ``None``:
                not known yet); the bits are then solved for it (:meth:`_fit_budget`).
            batch_size: samples in the training batch the check's sample was cut from (metric
                ``sgd``; default: the sample's own).
            speaks: whether this process writes the check's lines (default: :attr:`speaks`).
            cut: ``cut(n)``: the loss on equal pieces of at most ``n`` samples of the sample
                (:func:`~.passes.cut_sample`), run in turn by every pass in place of
                ``loss_fn``, so that no pass holds more than a piece's activations (a piece's
                saves judged at its training size, :class:`_Passes`); ``most``: that ``n``
                (:func:`~.passes.piece_samples`, the least over ranks is taken).
        """
        if speaks is not None:
            self.speaks = speaks
        cfg = self.config
        step = self.steps if step is None else step
        current = dict(bits)
        fqns = sorted(current)
        limit = len(cfg.ladder) + 1 if max_rounds is None else max(1, max_rounds)
        if not fqns:
            return self._record(DriftReport(step, threshold=cfg.threshold, metric=cfg.metric))

        checked = CheckedParameters(model)
        params, sharded = checked.params, checked.sharded
        device = params[0].device if params else None
        param_free = [f for f in fqns if not checked.own(f)]
        start = dict(current)
        trail: dict[str, list[int]] = {}  # the bits each raised module went through
        first_parts: dict[str, tuple[float, float]] = {}
        first_drift: dict[str, float] = {}
        first_total: Whole | None = None
        lowered_now: dict[str, tuple[int, int]] = {}
        skipped: set[str] = set()
        round_max: list[float] = []
        pieces: Sequence[Callable[[], torch.Tensor]] = [loss_fn]
        if cut is not None and most > 0:  # every rank cuts alike (sharded folds are collectives)
            pieces = cut(int(-_max_of(reduce_max, [-float(most)], device)[0]))
        passes = _Passes(model, checked, param_free, pieces)
        # Eagerly: modules inside compiled graphs are judged too (their hooks fire).
        with eagerly(), preserved_state(model, generators) as one_pass:
            with one_pass(), suspend():
                exact = passes.exact(
                    fqns, fqns if scopes is None else scopes, min_numel, batch_size
                )
            judges, unmeasured, finished = passes.judges, passes.unmeasured, passes.finished
            exact_sq = summed_over_shards(exact.sq, sharded)
            usable = torch.where(torch.isfinite(exact_sq), exact_sq, torch.zeros_like(exact_sq))
            floors = {
                PARAMS: NEGLIGIBLE * float(usable[: len(params)].sum().sqrt()),
                TENSORS: NEGLIGIBLE * float(usable[len(params) :].sum().sqrt()),
            }
            variance, samples = None, 0
            if cfg.metric in ("noise", "sgd"):  # an exact pass, its halves weighted +1 and -1
                with one_pass(), suspend():
                    variance, samples = passes.signed_halves()
                if variance is None:  # no output with the samples: the halves run on their own
                    with one_pass(), suspend():
                        variance, samples = passes.halves_apart(exact_sq[len(params) :])
                if variance is None and cfg.metric == "noise":
                    raise ValueError(
                        "drift.metric noise needs two halves of the sample: the model was called "
                        "with no tensor of 2 or more samples along dim 0; use sample_size >= 2, "
                        "or metric rel_l2 / cosine"
                    )

            metric = cfg.metric
            if metric == "sgd" and variance is None:
                metric = "cosine"
                if not self._noted_no_variance and self.speaks():
                    self._noted_no_variance = True
                    log.warning(
                        "memopt: drift.metric sgd needs the gradient's sampling noise: the "
                        "model was called with no tensor of 2 or more samples along dim 0 (or "
                        "sample_size is 1); these checks judge by cosine instead"
                    )
            scales = None
            if metric == "sgd":
                scales = self._noise_scales(
                    judges,
                    exact_sq,
                    exact.finite,
                    variance,
                    samples,
                    batch_size or samples,
                    len(params),
                )
                if scales[None] == float("inf") and not self._noted_no_scale and self.speaks():
                    self._noted_no_scale = True
                    log.info(
                        "memopt: at step %d the gradient noise scale is not known yet (the "
                        "gradient's signal has not stood above its sampling noise in the checks "
                        "so far): until it is, sgd judges costs at their bound for any noise "
                        "scale, error / (1 + error)",
                        step,
                    )

            def measured() -> Round:
                """One compressed pass at the current bits, each piece judged at its training
                size: each module's drift (max over ranks), the unmeasured and the skipped."""
                training = nullcontext() if as_training is None else as_training(passes.sample)
                with one_pass(), training:
                    approx = passes.run()
                found = module_drifts(
                    fqns,
                    judges,
                    floors,
                    exact,
                    exact_sq,
                    approx,
                    metric,
                    variance,
                    scales,
                    len(params),
                )
                del approx
                whole = found.total
                # sgd: the whole gradient and each module's own error, max over ranks (a fixed
                # size on every rank: -1 where this rank has none)
                extra = []
                if metric == "sgd":
                    errors = found.errors
                    own = [
                        float(errors[list(checked.own(f))].sum())
                        if errors is not None and checked.own(f)
                        else 0.0
                        for f in fqns
                    ]
                    head = [-1.0] * 4 if whole is None else [*astuple(whole)]
                    extra = head + own
                reduced = _max_of(reduce_max, [*found.values, *extra], device)
                drift = reduced[: len(fqns)]
                total, energy = None, {}
                if extra and reduced[len(fqns)] >= 0:
                    cost, error_sq, spread, scale, *own = reduced[len(fqns) :]
                    total = Whole(cost, error_sq, spread, scale)
                    energy = {f: e for f, e in zip(fqns, own, strict=True) if e > 0}
                per = {f: d for f, d in zip(fqns, drift, strict=True) if 0 <= d < NOT_FINITE}
                bad = {f for f, d in zip(fqns, drift, strict=True) if d == NOT_FINITE}
                skipped.update(bad)
                absent = {**unmeasured, **found.missing, **dict.fromkeys(bad, NON_FINITE)}
                absent = {f: r for f, r in absent.items() if f not in per}
                parts = {f: p for f, p in found.parts.items() if f in per}
                return Round(per, absent, parts, total, energy)

            first, kept, last = None, None, None
            if pricing is not None:  # quantize.budget: the bits are solved from the first pass
                first = measured()
                round_max.append(max(first.drift.values(), default=0.0))
                first_parts, first_drift = first.parts, dict(first.drift)
                priced = _reduced(pricing(), reduce_max, device)
                if priced is not None:
                    last, kept = self._fit_budget(
                        first, current, priced, set_bits, step, measured, round_max, limit
                    )
            moved: dict[str, tuple[int, int]] = {}
            while kept is None:
                if first is None:
                    last = measured()
                    round_max.append(max(last.drift.values(), default=0.0))
                    if len(round_max) == 1:
                        first_parts, first_drift = last.parts, dict(last.drift)
                else:
                    last, first = first, None
                if len(round_max) == 1:
                    first_total = last.total
                moved = self._escalate(last, current, set_bits, finished)
                for fqn, (old, new) in moved.items():
                    trail.setdefault(fqn, [old]).append(new)
                if not moved or len(round_max) >= limit:
                    break
            if kept is None and cfg.lower and not moved:
                calm = {f: d for f, d in last.drift.items() if f not in trail}
                lowered = self._lower(calm, current, set_bits, measured, round_max)
                if lowered is not None and lowered[1]:  # the probe's bits are the ones kept
                    last, lowered_now = lowered
        escalated = {f: (start[f], b) for f, b in current.items() if b > start[f]}
        if kept is not None:
            lowered_now = {f: (start[f], b) for f, b in current.items() if b < start[f]}
        # Nothing measured, nothing judged: no cost of the whole gradient to claim either.
        blind = not first_drift and not skipped
        report = DriftReport(
            step,
            last.drift,
            last.unmeasured,
            escalated,
            tuple(round_max),
            lowered_now,
            threshold=cfg.threshold,
            metric=metric,
            budget=kept,
            skipped=tuple(sorted(skipped)),
            first=first_drift,
            parts=first_parts,
            total=(None, None)
            if blind
            else (
                None if first_total is None else first_total.cost,
                None if last is None or last.total is None else last.total.cost,
            ),
            blind=blind,
        )
        self.skipped += len(skipped)
        self.blind += blind
        if self.speaks():
            _log_check(report, trail, len(fqns))
            if blind:
                _warn_blind(report, len(fqns), passes.sample is None)
        return self._record(report)

    def _noise_scales(
        self,
        judges: Mapping[str, Judge],
        exact_sq: torch.Tensor,
        finite: torch.Tensor,
        variance: torch.Tensor,
        samples: int,
        batch: int,
        params: int,
    ) -> dict[str | None, float]:
        """This check's measurement added to the smoothed noise scales (:class:`NoiseScale`) of
        the whole parameter gradient (key ``None``) and of each judged module, and each one's
        last good ``B_noise / batch`` (``inf`` where none has been finite and positive yet:
        one check's infinite, NaN or negative estimate is never decided on). The first
        ``params`` targets are the model's parameters."""
        groups: dict[str | None, list[int]] = {None: [i for i in range(params) if bool(finite[i])]}
        groups.update({f: list(j.indices) for f, j in judges.items()})
        out: dict[str | None, float] = {}
        for key, idx in groups.items():
            noise = self.noise_whole if key is None else self.noise.setdefault(key, NoiseScale())
            if idx and max(idx) < len(variance):
                noise.update(float(exact_sq[idx].sum()), float(variance[idx].sum()), samples)
            out[key] = float("inf") if noise.good is None else noise.good / batch
        return out

    def _escalate(
        self,
        found: Round | Mapping[str, float],
        current: dict[str, int],
        set_bits: Callable[[str, int], None],
        finished: Mapping[str, int] | None = None,
    ) -> dict[str, tuple[int, int]]:
        """Every module over the threshold one rung up (the check's INFO line says which).

        ``found``: a round, or the drifts of modules chosen to go up. With the whole gradient's
        cost (metric ``sgd``) the threshold judges that (:func:`_over`).

        A module over it at 32 bits keeps nothing compressed: its drift is inherited, carried
        back by backward from modules whose forward ended after its own (``finished``: when each
        ended in the exact pass), and those still compressed go one rung up instead."""
        cfg = self.config
        per_module = found.drift if isinstance(found, Round) else found
        over = _over(found, cfg.threshold) if isinstance(found, Round) else sorted(per_module)
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
            set_bits(fqn, new)
            current[fqn] = new
            moved[fqn] = (old, new)
            self.escalations += 1
            self.calm[fqn] = 0
            if fqn in self.lowered:  # back over the threshold after a lowering: wait longer
                self._back_off(fqn)
        return moved

    def _back_off(self, fqn: str) -> None:
        base = self.config.lower_after
        self.wait[fqn] = min(8 * base, 2 * self.wait.get(fqn, base))

    def _lower(
        self,
        per_module: Mapping[str, float],
        current: dict[str, int],
        set_bits: Callable[[str, int], None],
        measured: Callable[[], Round],
        round_max: list[float],
    ) -> tuple[Round, dict[str, tuple[int, int]]] | None:
        """``drift.lower``: modules calm for ``lower_after`` checks go down one rung, probed by
        one round; a module whose probe is not calm goes back up and waits longer. Returns the
        probe and the lowerings kept (``None``: no module was due). Every rank decides the same:
        drifts are max-reduced over ranks."""
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
            # module's drift is mostly the other modules' rounding (backward carries it), which
            # no scaling of its own drift by the step size (1 / (2^b - 1)) predicts.
            calm = drift <= calm_below
            self.calm[fqn] = self.calm.get(fqn, 0) + 1 if calm else 0
            if self.calm[fqn] >= self.wait.get(fqn, cfg.lower_after):
                due[fqn] = (old, lower)
        if not due:
            return None
        for fqn, (_, lower) in due.items():
            set_bits(fqn, lower)
            current[fqn] = lower
        probe = measured()
        round_max.append(max(probe.drift.values(), default=0.0))
        kept: dict[str, tuple[int, int]] = {}
        # The threshold stays a hard cap: a module pushed over it by the lowered ones around it
        # undoes them all.
        others_over = any(d > cfg.threshold for f, d in probe.drift.items() if f not in due)
        if probe.total is not None:  # sgd: the whole model's cost is what the threshold caps
            others_over = probe.total.cost > cfg.threshold
        for fqn, (old, lower) in due.items():
            self.calm[fqn] = 0
            drift = probe.drift.get(fqn)
            if others_over or (drift is not None and drift > calm_below):  # back up
                set_bits(fqn, old)
                current[fqn] = old
                self._back_off(fqn)
                probe.drift[fqn] = per_module[fqn]  # its drift at the bits it keeps
                continue
            kept[fqn] = (old, lower)
            self.lowered.add(fqn)
            self.deescalations += 1
        return probe, kept

    # ----------------------------------------------------------------- quantize.budget
    def _fit_budget(
        self,
        first: Round,
        current: dict[str, int],
        priced: Pricing,
        set_bits: Callable[[str, int], None],
        step: int,
        measured: Callable[[], Round],
        round_max: list[float],
        limit: int,
    ) -> tuple[Round, tuple[float, float]]:
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
        cfg = self.config
        found = first
        per_module, unmeasured = found.drift, found.unmeasured
        at = dict(current)  # the bits the last pass ran at
        self.held = {f: (w, n - 1) for f, (w, n) in self.held.items() if n > 1}
        short: dict[str, float] = {}  # modules the budget holds under what the threshold wants
        verified = not _over(found, cfg.threshold)
        if verified:  # sensitivities from calm passes only: an over one is others' rounding
            self._learn(per_module, unmeasured, current)
        self._hold_over(found, current, set_bits, priced, short)
        calm, reverted = (first if verified else None), False
        for _ in range(limit):
            unknown = max(self.sensitivity.values(), default=1.0)  # never measured below 32
            sensitivity = {f: self.sensitivity.get(f, unknown) for f in current}
            floors = {f: w for f, (w, _) in self.held.items()}
            plan = solve(current, priced, sensitivity, priced.widths, floors, cfg.threshold)
            changes = {f: (current[f], b) for f, b in plan.items() if b != current[f]}
            if not changes and verified:
                break
            for fqn, (old, new) in changes.items():
                drift = (per_module.get(fqn), at[fqn])
                self._budget_move(fqn, old, new, drift, set_bits, current, step)
            found = measured()
            per_module, unmeasured = found.drift, found.unmeasured
            round_max.append(max(per_module.values(), default=0.0))
            at = dict(current)
            over = _over(found, cfg.threshold)
            reverted = False
            if not over:
                self._learn(per_module, unmeasured, current)
                verified, calm = True, found
                continue
            lowered = {f: old for f, (old, new) in changes.items() if new < old}
            if lowered:  # undo this round (its raises paid for by its lowerings): the state
                reverted = True  # before it stands again, and the lowered ones are held
                for fqn, (old, _) in changes.items():
                    self._budget_move(fqn, current[fqn], old, (None, 0), set_bits, current, step)
                for fqn, old in lowered.items():
                    self.held[fqn] = (old, self.wait.get(fqn, cfg.lower_after))
                    self._back_off(fqn)
                if self.speaks():
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
                verified = not self._hold_over(found, current, set_bits, priced, short)
        if reverted and calm is not None:  # the last probe's bits are gone: the calm pass's
            found = calm
        kept = priced.total(current)
        floor = min(priced.widths, default=cfg.ladder[0])
        held = sorted(f for f, (w, _) in self.held.items() if current.get(f, floor) > floor)
        log_outcome(priced, kept, held, floor, step)
        if short and self.speaks():
            log.warning(
                "memopt: quantize.budget %.2f MiB holds %d module(s) at step %d that "
                "drift.threshold %.4f would raise: %s; a rung up for them needs %.2f MiB more",
                priced.target * priced.scale / 2**20,
                len(short),
                step,
                cfg.threshold,
                ", ".join(f or "<root>" for f in sorted(short)[:8])
                + (", ..." if len(short) > 8 else ""),
                sum(short.values()) * priced.scale / 2**20,
            )
        return found, (priced.target * priced.scale, kept * priced.scale)

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
        found: Round,
        current: dict[str, int],
        set_bits: Callable[[str, int], None],
        priced: Pricing,
        short: dict[str, float],
    ) -> dict[str, tuple[int, int]]:
        """Modules over the threshold go one rung up while the bits fit the budget (most drift
        first), and the budget's solver may not take them under it for the next checks (their
        wait, doubled each time, at most 8x lower_after); the others are noted in ``short``
        with the bytes their rung up would add."""
        cfg = self.config
        over = _over(found, cfg.threshold)
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
        moved = self._escalate(allowed, current, set_bits)
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
        if self.speaks():
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


class _Passes:
    """The check's passes, each over the same equal pieces of its sample in turn (one piece:
    the whole sample), so that the gradients compared are of one function and no pass holds more
    than a piece's activations; a pass's gradients are its pieces' merged (:func:`merged`).

    :meth:`exact` runs first: it says what judges each module (:attr:`judges`, by its first
    piece), and the size training judges a piece's saved tensors at (:attr:`sample`)."""

    def __init__(
        self,
        model: nn.Module,
        checked: CheckedParameters,
        param_free: Sequence[str],
        pieces: Sequence[Callable[[], torch.Tensor]],
    ):
        self.model, self.checked, self.param_free, self.pieces = model, checked, param_free, pieces
        self.wanted: list[int] = []  # the recorded tensors a piece's judges read
        self.layout: tuple = ()
        self.judges: dict[str, Judge] = {}
        self.unmeasured: dict[str, str] = {}
        #: when each module that saved something for compression finished (inherited drift)
        self.finished: dict[str, int] = {}
        self.samples = 0  # in a piece
        #: ``(samples in a piece, training batch)``: a piece's saves judged at training's sizes
        #: (:func:`~memopt_plugins.policy.min_numel_at`); ``None``: at their own
        self.sample: tuple[int, int] | None = None

    def run(
        self,
        loss_of: Callable[[int, Callable[[], torch.Tensor]], torch.Tensor | None] | None = None,
        recorder: Callable[[], PassRecorder] | None = None,
        squares_only: bool = False,
        first: Callable[[PassRecorder], None] | None = None,
    ) -> PassGradients | None:
        """One pass: ``loss_of(index, piece)`` per piece (default: the piece's loss), recorded by
        ``recorder()``; ``first(rec)`` after the first piece's forward. ``None`` where
        ``loss_of`` returns ``None``: the pass ends there, with no backward."""
        params, sharded = self.checked.params, self.checked.sharded
        parts = []
        for index, piece in enumerate(self.pieces):
            rec = recorder() if recorder else PassRecorder(self.model, self.param_free)
            with rec:
                loss = loss_of(index, piece) if loss_of else scalar_loss(piece)
            if loss is None:
                return None
            if first is not None and not index:
                first(rec)
            tensors = [rec.tensors[i] for i in self.wanted] if rec.layout() == self.layout else []
            targets = self.checked.targets(rec.running) + tensors
            only = squares_only and len(self.pieces) == 1  # pieces merge by their folds
            parts.append(gradients(loss, targets, sharded, squares_only=only))
            del loss, rec, tensors, targets
        return merged(parts, len(params), len(self.wanted), sharded)

    def exact(
        self, fqns: Sequence[str], scopes: Sequence[str], min_numel: int, batch_size: int | None
    ) -> PassGradients:
        """The exact pass (compression suspended by the caller). A piece of ``n`` samples cut
        from a training batch of ``batch_size`` is judged at its training size: ``(n,
        batch_size)`` where the sample holds 2 or more samples and a piece fewer than the batch.
        A piece's recorded tensors are targets of their own (a judge's indices, piece by piece);
        a piece that recorded other tensors than the first leaves them unjudged."""
        inputs = SampleInputs(self.model)

        def counted(index: int, piece: Callable[[], torch.Tensor]) -> torch.Tensor:
            with inputs:
                return scalar_loss(piece)

        def first(rec: PassRecorder) -> None:
            self.samples = inputs.samples
            if batch_size and self.samples * len(self.pieces) >= 2 and self.samples < batch_size:
                rec.sample = self.sample = (self.samples, batch_size)
            self.judges, self.unmeasured = find_judges(fqns, self.checked, rec)
            self.wanted = sorted(
                {i for j in self.judges.values() if j.kind == TENSORS for i in j.indices}
            )
            self.layout = rec.layout()
            self.finished = {f: t for f, t in rec.finished.items() if rec.saved.get(f, 0)}

        exact = self.run(
            counted,
            lambda: PassRecorder(self.model, self.param_free, scopes, min_numel),
            first=first,
        )
        assert exact is not None
        params, count, wanted = len(self.checked.params), len(self.pieces), self.wanted
        if len(exact.folds) < params + count * len(wanted):
            for f in [f for f, j in self.judges.items() if j.kind == TENSORS]:
                del self.judges[f]
                self.unmeasured[f] = CALLS_DIFFER
        position = {i: params + k for k, i in enumerate(wanted)}
        self.judges = {
            f: j
            if j.kind == PARAMS
            else Judge(
                j.kind,
                tuple(position[i] + n * len(wanted) for n in range(count) for i in j.indices),
            )
            for f, j in self.judges.items()
        }
        return exact

    def signed_halves(self) -> tuple[torch.Tensor | None, int]:
        """The sampling variance of the exact gradient per target and the sample's count, from
        one exact pass with its halves weighted +1 and -1 (:class:`SignedHalves`, each piece's
        rows by their half of the whole sample); ``(None, 0)`` where the model's output holds
        no tensor with the samples."""
        signed: list[SignedHalves] = []

        def weighted(index: int, piece: Callable[[], torch.Tensor]) -> torch.Tensor | None:
            with SignedHalves(self.model, piece=(index, len(self.pieces))) as halves:
                loss = scalar_loss(piece)
            signed.append(halves)
            return loss if halves.scale else None

        spread = self.run(weighted, squares_only=True)
        if spread is None:
            return None, 0
        variance = summed_over_shards(spread.sq, self.checked.sharded) * signed[-1].scale
        return variance, signed[-1].samples

    def halves_apart(self, tensors_sq: torch.Tensor) -> tuple[torch.Tensor | None, int]:
        """:meth:`signed_halves` for a model whose output holds no tensor with the samples (a
        loss computed inside it): each piece's rows in the whole sample's first half ``A`` and
        in its second ``B`` run on their own (:class:`SampleInputs`), their losses weighted so
        that the pieces' mean gradient is ``(g_A - g_B) / 2`` for a loss that is a mean over
        samples. After the parameters, the recorded tensors, whose rows are each sample's own:
        their exact squared norms ``tensors_sq`` (as :class:`SignedHalves` gives for equal
        halves). ``(None, samples)`` when the sample holds fewer than 2."""
        rows, count = self.samples, len(self.pieces)
        n = rows * count
        if n < 2:
            return None, n
        a, b = (n + 1) // 2, n // 2

        def apart(index: int, piece: Callable[[], torch.Tensor]) -> torch.Tensor:
            split = min(rows, max(0, a - index * rows))  # this piece's rows in A
            halves = (
                (slice(0, split), split / (2 * a)),
                (slice(split, rows), (split - rows) / (2 * b)),
            )
            losses = []
            for part, weight in halves:
                if part.stop > part.start:
                    with SampleInputs(self.model, part):
                        losses.append(scalar_loss(piece) * (weight * count))
            return sum(losses[1:], losses[0])

        spread = self.run(apart, lambda: PassRecorder(self.model, ()), squares_only=True)
        assert spread is not None
        scale = 4.0 / (n * (1 / a + 1 / b))
        params = summed_over_shards(spread.sq, self.checked.sharded) * scale
        return torch.cat([params[: len(self.checked.params)], tensors_sq]), n


def _reduced(
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


#: A rung up cuts a module's own rounding error about this much (one more bit halves a step;
#: 4 -> 8 bits: 16x).
RUNG_CUT = 1 / 16
#: sgd: modules are chosen until the whole gradient's cost is predicted under this share of the
#: threshold, so that the probe finds it under (a module's own error is not all it removes).
MARGIN = 0.8


def _over(found: Round, threshold: float) -> list[str]:
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
