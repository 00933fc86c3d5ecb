"""MemoryOptimizer: turns a config and a model into a plan, applies it, removes it, owns state.

Users hold :class:`MemoryOptimizer`'s twelve names and :func:`plan_recompute`; the integrations
(Lightning, Accelerate, transformers) go through :class:`~.session.MemOptSession`, which reads
the rest through the one member :attr:`MemoryOptimizer.internal`.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from .batchnorm import BatchNormPatch
from .compress.bits import BitTable
from .compress.codec import NoiseGenerators
from .compress.estimate import storage_ratio
from .compress.face import Compression, device_of
from .compress.hooks import CompressionHooks
from .compress.stats import ModuleSaved
from .config import OFF_BITS, ConfigError, MemOptConfig, load_config
from .distributed import is_rank_zero, max_over_ranks, process_rank
from .drift.budget import Pricing, priced_widths
from .drift.monitor import DriftMonitor
from .drift.passes import cut_sample, piece_samples
from .drift.report import DriftReport
from .drift.request import CheckSample, CompressionFace, DriftCheck
from .dropout import DropoutPatch
from .lean.patch import LeanOps
from .logs import release_console, show_on_console
from .loss_fn import bind_loss, takes_model_and_batch
from .measure.process import batch_fits
from .measure.scopes import InterruptGuard, ScopeTracker, scripted_modules
from .policy import resolve_bits
from .recompute.planner import RecomputePlan, RecomputePlanner
from .recompute.wrap import IN_RECOMPUTE, RECOMPUTE, Recompute, recompute_targets, region_actions
from .saved_state import SavedState, read_state, resumed_bits
from .select import layer_kind, parent_fqns
from .tree import batch_size_of, slice_batch

__all__ = [
    "COMPRESS",
    "IN_RECOMPUTE",
    "KEEP",
    "RECOMPUTE",
    "DriftReport",
    "MemoryOptimizer",
    "ModulePlan",
    "Plan",
    "patched_by",
    "plan_recompute",
]

log = logging.getLogger("memopt")

#: Every model a MemoryOptimizer is applied to, so that patching one twice is refused. Both
#: held weakly: the optimizer holds its model, and a strong value would keep a model dropped
#: without remove() alive for the rest of the process.
_PATCHED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[MemoryOptimizer]] = (
    weakref.WeakKeyDictionary()
)


def patched_by(model: nn.Module) -> MemoryOptimizer | None:
    """The :class:`MemoryOptimizer` applied to ``model`` now, or ``None``."""
    ref = _PATCHED.get(model)
    return ref() if ref is not None else None


def _refuse_nested(model: nn.Module) -> None:
    """Raise when ``model``, a module inside it or a model holding it is patched already: the
    scopes of both would act on the same modules, the innermost deciding, while each optimizer
    reports and changes its own bits only."""
    for fqn, module in model.named_modules():
        opt = patched_by(module)
        if opt is not None:
            where = f"its submodule {fqn!r}" if fqn else "it"
            raise RuntimeError(
                f"{type(model).__name__}: {where} ({type(module).__name__}) is already patched "
                f"by {_named(opt)}; call remove() on that one before applying another"
            )
    for outer, ref in list(_PATCHED.items()):
        opt = ref()
        if opt is None or outer is model:
            continue
        fqn = next((f for f, m in outer.named_modules() if m is model), None)
        if fqn is not None:
            raise RuntimeError(
                f"{type(model).__name__} is module {fqn!r} of a {type(outer).__name__} already "
                f"patched by {_named(opt)}; call remove() on that one before applying another"
            )


def _named(opt: MemoryOptimizer) -> str:
    return f"MemoryOptimizer at {id(opt):#x}"


#: Plan actions: compressed, left as it is (and RECOMPUTE, IN_RECOMPUTE from the recompute package).
COMPRESS = "compress"
KEEP = "keep"


@dataclass(frozen=True)
class ModulePlan:
    """What the optimizer does with one module."""

    kind: str
    action: str
    bits: int
    lean: str | None = None  # the lean op it runs as (``ops``), e.g. "lean swiglu"


class Plan(dict):
    """``{fqn: ModulePlan}`` for every module of the model; ``str(plan)`` is a table.

    Attributes:
        recomputed: fqns of the modules recomputed in backward (config and planner), in the
            order they were wrapped.
        recompute: the recompute planner's last plan (``recompute.auto`` or
            :func:`plan_recompute`; printable), or ``None``.
    """

    def __init__(
        self, recomputed: tuple[str, ...] = (), recompute: RecomputePlan | None = None
    ) -> None:
        super().__init__()
        self.recomputed = recomputed
        self.recompute = recompute

    def __str__(self) -> str:
        rows = [("module", "kind", "action", "bits", "op")]
        rows += [
            (
                fqn or "<root>",
                p.kind,
                p.action,
                str(p.bits) if p.action == COMPRESS else "-",
                p.lean or "-",
            )
            for fqn, p in self.items()
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        )


def _count(actions: Mapping[str, str]) -> str:
    """``{"a": "lean swiglu", "b": "lean swiglu"}`` -> ``"lean swiglu x2"``."""
    counts: dict[str, int] = {}
    for action in actions.values():
        counts[action] = counts.get(action, 0) + 1
    return ", ".join(f"{a} x{n}" if n > 1 else a for a, n in counts.items())


def noise_seed(seed: int | None) -> Callable[[], int]:
    """The seed of a run's stochastic-rounding noise: ``seed`` (``quantize.seed``), else
    ``torch.initial_seed()`` (read now), mixed with the rank (rank 0 keeps it). The rank is read
    at the first draw, so a model patched before the process group was created still rounds
    with noise of its own on every rank (:func:`~.distributed.process_rank`)."""
    base = torch.initial_seed() if seed is None else seed
    return lambda: (base + process_rank() * 0x9E3779B97F4A7C15) % 2**63


class MemoryOptimizer:
    """Applies a memopt config to a model.

    Args:
        config: a :class:`MemOptConfig`, a preset's name (``"int4_drift"``, ``memopt presets``),
            a dict in the YAML schema, a path to a YAML file, or ``None`` for the defaults (which
            change nothing).

    Its whole face: :attr:`config`; :meth:`apply` and :meth:`remove`; :attr:`plan` and
    :attr:`bits` (read), :meth:`set_bits` (write); :meth:`check_drift`, :meth:`count_step` and
    :meth:`metrics` in the training loop; :meth:`state_dict` and :meth:`load_state_dict`.
    :func:`plan_recompute` plans recompute on a batch before training. :attr:`internal` is
    :class:`~.session.MemOptSession`'s and the integrations', not the user's.

    Attributes:
        config: the validated :class:`MemOptConfig`.
    """

    def __init__(self, config: MemOptConfig | Mapping[str, Any] | str | os.PathLike | None = None):
        self.config = load_config(config)
        self._reduce_max: Callable[[torch.Tensor], torch.Tensor] = max_over_ranks
        self._speaks: Callable[[], bool] = is_rank_zero  # writes the checks' lines (rank 0)
        self._model: nn.Module | None = None
        self._table = BitTable()
        self._compression: Compression | None = None
        self._drift = DriftMonitor(self.config.drift, budget=self.config.quantize.targets_memory)
        self._recompute: Recompute | None = None
        self._planner: RecomputePlanner | None = None
        self._pending: SavedState | None = None  # a state loaded before apply, laid at apply
        self._dropout: DropoutPatch | None = None
        self._batchnorm: BatchNormPatch | None = None
        self._guard: InterruptGuard | None = None
        self._lean = LeanOps(self.config.ops)
        self._logged_bits: dict[str, int] = {}  # what metrics() last reported per module
        self._budget_waits_noted = False
        self._fits_measured: float | None = None  # measured_fits
        self._fits_base: float | None = None  # the estimate at the step it was measured for
        #: (step, counted steps) of the last check ``if_due``: one per optimizer step
        self._checked_at: tuple[int, int] | None = None

    # ----------------------------------------------------------------- public API
    @property
    def bits(self) -> dict[str, int]:
        """``{fqn: current bits}`` of every compressed module (a copy)."""
        return self._table.compressed

    @property
    def internal(self) -> EngineInternals:
        """What :class:`~.session.MemOptSession`, the profiler and the integrations read and set
        of the patch (not part of the user's API)."""
        return EngineInternals(self)

    @property
    def plan(self) -> Plan:
        """Per-module decision with the current bits, and what is recomputed; printable."""
        model = self._require_model()
        recomputed = self._recompute.wrapped if self._recompute is not None else ()
        plan = Plan(recomputed, self._planner.plan if self._planner is not None else None)
        regions = self._region_fqns()
        compressed = self._table.compressed
        lean = self._lean.actions
        for fqn, module in model.named_modules():
            bits = compressed.get(fqn)
            if regions.get(fqn) == RECOMPUTE:  # the bits its boundary input is kept at
                action, bits = RECOMPUTE, self._boundary_bits(fqn)
            elif fqn in regions:
                action, bits = regions[fqn], OFF_BITS
            elif bits is not None:
                action = COMPRESS
            else:
                action, bits = KEEP, OFF_BITS
            plan[fqn] = ModulePlan(layer_kind(module), action, bits, lean.get(fqn))
        return plan

    def apply(self, model: nn.Module) -> nn.Module:
        """Patch ``model`` in place and return it. A model can be patched once. memopt's lines
        reach the console from here on unless logging is configured (:mod:`.logs`)."""
        if self._model is not None:
            raise RuntimeError("this MemoryOptimizer is already applied; call remove() first")
        _refuse_nested(model)
        show_on_console()
        targets = recompute_targets(model, self.config.recompute)  # validates first
        scopes = resolve_bits(model, self.config.quantize)
        scripted = scripted_modules(model)  # no scopes there: their callers' scopes hold them
        scopes = {f: b for f, b in scopes.items() if f not in scripted}
        # recompute wins: no scope inside a region; the recomputed module's own scope packs
        # its boundary input only (BitTable)
        in_regions = region_actions(scopes, targets)
        # All or nothing: a failure part-way takes off what went on (remove() undoes each part).
        self._model = model
        _PATCHED[model] = weakref.ref(self)
        try:
            self._patch(model, targets, scopes, in_regions)
        except BaseException:
            self.remove()
            raise
        return model

    def _patch(
        self,
        model: nn.Module,
        targets: list[str],
        scopes: dict[str, int],
        in_regions: dict[str, str],
    ) -> None:
        """The patching half of :meth:`apply`, after validation."""
        # Lean ops first: they validate against the model too, and recompute wraps what they make.
        lean = self._lean.apply(model)
        if lean:
            log.info("memopt: %d modules run as memory-lean ops (%s)", len(lean), _count(lean))
        configured = {f: b for f, b in scopes.items() if in_regions.get(f) != IN_RECOMPUTE}
        self._table.install(configured)
        self._drift.start(configured)  # drift.lower never goes under the configured bits
        # Dropout/BN patches go in before the hooks and recompute wrappers (removed after them).
        if self.config.dropout.mode != "keep":
            self._dropout = DropoutPatch(self.config.dropout.mode)
            self._dropout.apply(model)
        if self.config.batchnorm.mode == "running":
            self._batchnorm = BatchNormPatch(
                self.config.batchnorm.warmup_steps, lambda: self._drift.steps
            )
            self._batchnorm.apply(model)
        compression = Compression(
            self._table,
            group_size=self.config.quantize.group_size,
            stochastic=self.config.quantize.rounding == "stochastic",
            min_numel=self.config.quantize.min_numel,
            noise=NoiseGenerators(noise_seed(self.config.quantize.seed)),
        )
        # Before install: remove() takes off what a failing install put on. The model's hooks
        # keep this optimizer alive (_PATCHED holds it weakly).
        self._compression = compression
        compression.install(model, list(self._table.scopes), self, device_of(model))
        self._recompute = Recompute(model, suspend=self._region_context)
        self._recompute.wrap(targets)
        self._recompute_changed()
        if targets:
            log.info("memopt: recomputing %d modules in backward", len(targets))
        if self.config.recompute.auto is not None:
            q = self.config.quantize
            planner = RecomputePlanner(
                self._recompute,
                self.config.recompute.auto.budget,
                self._recompute_changed,
                # what it keeps is counted compressed: recompute only for what compression leaves
                ratio=storage_ratio(q.bits, q) if q.bits < OFF_BITS else None,
            )
            self._planner = planner
            planner.install()
        self._lay_pending()
        compressed = self._table.compressed
        if compressed:
            log.info("memopt: %s", _scopes_line(model, compressed))
        # Last on, first off: whatever interrupts the model's forward leaves its scopes.
        if not isinstance(model, torch.jit.ScriptModule):  # opaque: no scopes (ScopeTracker)
            self._guard = InterruptGuard(model)

    def remove(self) -> None:
        """Undo :meth:`apply`: the model is exactly as before (modules, hooks, buffers), and the
        calling thread holds none of the contexts its scopes entered (an interrupt left them)."""
        if self._model is None:
            return
        ScopeTracker.leave_abandoned(self._model)
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        if self._planner is not None:
            self._planner.remove()
        if self._recompute is not None:
            self._recompute.remove()
        self._planner = self._recompute = None
        if self._compression is not None:
            self._compression.remove()
        if self._batchnorm is not None:
            self._batchnorm.remove()
        if self._dropout is not None:
            self._dropout.remove()
        self._batchnorm = self._dropout = None
        self._lean.remove()
        self._logged_bits = {}  # a re-applied optimizer reports every module's bits again
        _PATCHED.pop(self._model, None)
        if not _PATCHED:
            release_console()
        self._model = None
        self._compression = None
        self._table.clear()

    def set_bits(self, fqn: str, bits: int) -> None:
        """Change the bits of one compressed module; takes effect at its next forward.

        Raises:
            ValueError: ``bits`` is not one of 2, 4, 8, 16 (half cast) or 32 (off).
            KeyError: ``fqn`` is not a compressed module.
        """
        self._table.set(fqn, bits)

    # ----------------------------------------------------------------- recompute
    def _region_fqns(self) -> dict[str, str]:
        """``{fqn: action}`` of the recomputed modules and every module inside them."""
        return self._recompute.actions() if self._recompute is not None else {}

    def _recompute_changed(self, plan: RecomputePlan | None = None) -> None:
        """Modules inside a recompute region are not compressed: park their bits meanwhile; the
        recomputed modules' scopes keep their boundary inputs only."""
        regions = self._region_fqns()
        self._table.park(
            {f for f, action in regions.items() if action == IN_RECOMPUTE},
            [f for f, action in regions.items() if action == RECOMPUTE],
        )

    def _boundary_bits(self, fqn: str) -> int:
        """The bits recomputed module ``fqn``'s boundary input is packed at: its own scope's,
        else the nearest enclosing scope's (none: not compressed)."""
        scopes = self._table.scopes
        owner = next((f for f in (fqn, *parent_fqns(fqn)) if f in scopes), None)
        return scopes[owner] if owner is not None else OFF_BITS

    @contextmanager
    def _region_context(self) -> Iterator[None]:
        """Entered inside every recomputed module: no compression, functional dropout routed."""
        with self._compression.suspend():
            if self._dropout is None:
                yield
            else:
                with self._dropout.active():
                    yield

    # ----------------------------------------------------------------- drift
    def count_step(self) -> int:
        """Count one optimizer step (call it after ``optimizer.step()``); returns the steps
        counted (restored by :meth:`load_state_dict`)."""
        self._drift.steps += 1
        if self._compression is not None:
            self._compression.end_step()  # the next forward starts the step's counts afresh
        return self._drift.steps

    def _measure_afresh(self) -> None:
        """Measure the next training step as the first after :meth:`apply`
        (``memopt/peak_bytes``, ``memopt/batch_fits_x``): forwards run outside the training
        loop's steps (a batch-size finder's trials, which count no steps) are not its."""
        if self._compression is not None:
            self._compression.measure_afresh()

    def _should_check(self, step: int | None = None) -> bool:
        """True when a drift check is due at ``step`` (default: the steps counted).

        Due at step 0 and every ``drift.check_every`` steps, when ``drift.enabled`` and some
        module is compressed below 32 bits (with ``drift.lower`` or a memory target,
        ``quantize.budget`` or ``quantize.memory``: some
        module is compressed).
        """
        compressed = self._table.compressed.values()
        moves_down = self.config.drift.lower or self.config.quantize.targets_memory
        lowering = moves_down and bool(compressed)  # a module at 32 may come down
        due = lowering or any(b < OFF_BITS for b in compressed)
        return due and self._drift.should_check(step)

    def check_drift(
        self,
        loss_fn: Callable[..., torch.Tensor],
        *,
        batch: Any = None,
        step: int | None = None,
        batch_size: int | None = None,
        max_rounds: int | None = None,
        if_due: bool = False,
    ) -> DriftReport | None:
        """Compare compressed and exact gradients of the loss and escalate drifting modules.

        ``loss_fn(model, batch) -> scalar loss`` runs on the patched model and the first
        ``drift.sample_size`` samples of ``batch``, the training batch (:func:`slice_batch`);
        ``batch_size`` defaults to ``batch``'s. A closure ``loss_fn()`` is accepted too: it
        returns the loss on a small batch and calls the patched model itself (under DDP:
        ``ddp.module``). ``batch_size``: samples in the training batch the small one was cut
        from: the check compresses what a training forward on that batch does (its small
        tensors are judged against ``quantize.min_numel`` at their training size) and
        ``drift.metric: sgd`` judges the cost at that batch; default: the small batch's own,
        which overstates the cost and may leave the check nothing compressed to measure (it then
        warns and counts in ``memopt/drift_blind``). Training is unaffected:
        RNG streams, buffers, ``.grad`` and the saved-bytes statistics are as before the call.
        ``max_rounds=None`` re-checks until no module escalates (one compressed pass per round;
        a check that escalates nothing costs one exact and one compressed pass); ``1`` escalates
        at most one rung per call. Runs whether or not ``drift.enabled``.

        ``if_due=True``, for a training loop: check only when a check is due at ``step`` (default:
        the steps :meth:`count_step` counted; due at step 0 and every ``drift.check_every`` steps
        when ``drift.enabled`` and something is compressed) and none ran at this optimizer step
        yet, else return ``None``: under gradient accumulation every micro-batch of a step may
        call it with the same ``step`` and the step is checked once. See
        :mod:`memopt_plugins.drift`.
        """
        if if_due:
            return self._check_if_due(loss_fn, batch, step, batch_size, max_rounds)
        model = self._require_model()
        compression = self._compression
        sample = self._check_sample(model, loss_fn, batch, batch_size)
        # Its per-module counts price the memory target when they cover all of it (nothing compiled)
        eager = compression.stats.forward_original == compression.stats.saved_original
        # The check's passes are no training forward: the counts are as before once it is done.
        # ``trained``: the last training forward's saved bytes, for quantize.memory.
        with compression.snapshot() as (kept_modules, trained):
            pricing = None
            if self.config.quantize.targets_memory:
                pricing = self._pricing(trained, kept_modules if eager else {})
            check = DriftCheck(
                sample,
                self._compression_face(model),
                step=step,
                max_rounds=max_rounds,
                pricing=pricing,
                reduce_max=self._reduce_max,
                speaks=self._speaks,
            )
            return self._drift.check(check)

    def _check_sample(
        self,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor],
        batch: Any,
        batch_size: int | None,
    ) -> CheckSample:
        """What a check's passes run: ``loss_fn`` bound to the model and the first
        ``drift.sample_size`` samples of ``batch`` (where given), cut in pieces that fit what
        the compressed training forward kept when it takes ``(model, batch)``."""
        cut, most = None, 0
        if batch is not None:
            batch_size = batch_size_of(batch) if batch_size is None else batch_size
            batch = slice_batch(batch, self.config.drift.sample_size)
            if takes_model_and_batch(loss_fn):  # the check's passes may run it in pieces
                samples = batch_size_of(batch) or 1
                stats = self._compression.stats
                most = piece_samples(samples, batch_size, stats.saved_stored, stats.saved_original)
                cut = partial(cut_sample, loss_fn, model, batch)
        bound = bind_loss(loss_fn, model, batch)
        return CheckSample(model, bound, batch_size=batch_size, cut=cut, most=most)

    def _compression_face(self, model: nn.Module) -> CompressionFace:
        """What a drift check may do to compression: the bits, :meth:`set_bits`, the hooks'
        suspension and training-size contexts, and the noise generators of the model's
        devices."""
        compression = self._compression
        devices = sorted({p.device for p in model.parameters()} - {torch.device("meta")}, key=str)
        # No drift-recorder hooks inside a recompute region (a planner's pick keeps its scopes
        # there): they would hide the region's saved tensors from the checkpoint. A recomputed
        # module's own scope is outside its region: it counts the boundary input.
        inside = {f for f, action in self._region_fqns().items() if action == IN_RECOMPUTE}
        return CompressionFace(
            self._table.compressed,
            self.set_bits,
            compression.suspend,
            as_training=compression.as_training,
            generators=[compression.noise(d) for d in devices],
            scopes=[f for f in self._table.scopes if f not in inside],
            min_numel=self.config.quantize.min_numel,
        )

    def _pricing(
        self, trained: int, counts: Mapping[str, ModuleSaved]
    ) -> Callable[[], Pricing | None]:
        """The memory target's prices (``quantize.budget``, ``quantize.memory``): each compressed
        module's bytes at every width, from its scope's saved tensors and the codec's packed sizes
        (:func:`~.compress.estimate.stored_nbytes`), and the target in the same units. The
        tensors are those of the last training forward (``counts``) where its eager hooks saw
        all of it, else those of the check's compressed pass just run (the only ones for a model
        with compiled graphs), bytes of a training forward then scaled by its saved bytes over
        the pass's. ``None`` for ``quantize.memory`` before any training forward."""
        group = self.config.quantize.group_size
        ladder = self.config.drift.ladder

        def priced() -> Pricing | None:
            compressed = self._table.compressed
            widths = priced_widths(ladder, [*compressed.values(), *self._drift.floor.values()])
            found = self._compression.take_modules()  # the next pass counts afresh
            if counts:
                found, trained_here = counts, sum(m.original for m in counts.values())
            else:
                trained_here = trained
            original = sum(m.original for m in found.values())
            costs = {
                f: {b: float(found[f].bytes_at(b, group)) if f in found else 0.0 for b in widths}
                for f in compressed
            }
            counted = bool(trained_here and original)  # a training forward's bytes are known
            scale = trained_here / original if counted else 1.0
            target = self._memory_target(original, scale if counted else None)
            return None if target is None else Pricing(costs, target[0], scale, target[1])

        return priced

    def _memory_target(self, original: int, scale: float | None) -> tuple[float, str] | None:
        """The target in bytes of the check's sample and the key(s) it comes from: the fraction
        ``quantize.budget`` of ``original`` (the sample's bytes uncompressed), the amount
        ``quantize.memory`` over ``scale`` (a training forward's bytes per byte of the sample;
        ``None``: none counted yet, so no target, noted once), both set: the tighter."""
        q = self.config.quantize
        fraction = None if q.budget is None else q.budget * original
        if q.memory is None:
            return None if fraction is None else (fraction, "quantize.budget")
        if scale is None:
            if not self._budget_waits_noted:
                self._budget_waits_noted = True
                log.info(
                    "memopt: quantize.memory waits for a training forward to be counted (no "
                    "bits solved at this check)"
                )
            return None
        amount = q.memory / scale
        if fraction is None:
            return amount, "quantize.memory"
        return min(fraction, amount), "the tighter of quantize.budget and quantize.memory"

    def _check_if_due(
        self,
        loss_fn: Callable[..., torch.Tensor],
        batch: Any,
        step: int | None,
        batch_size: int | None,
        max_rounds: int | None,
    ) -> DriftReport | None:
        """:meth:`check_drift` with ``if_due=True``."""
        if self._model is None or not self._should_check(step):
            return None
        steps = self._drift.steps
        at = (steps if step is None else step, steps)
        if at == self._checked_at:
            return None
        report = self.check_drift(
            loss_fn, batch=batch, step=step, batch_size=batch_size, max_rounds=max_rounds
        )
        self._checked_at = at
        return report

    def metrics(self, drift: bool = True) -> dict[str, float]:
        """The ``memopt/*`` values for a logger: a compact set whatever the model's size
        (docs/logging.md).

        * ``memopt/bits_mean``: mean bits of the compressed modules, weighted by the bytes each
          saved uncompressed in the last forward; ``memopt/bits_modules/<bits>``: modules at
          each width;
        * ``memopt/kept_bytes``: the bytes the last training forward kept for backward;
          ``memopt/compression_ratio``: those bytes uncompressed ÷ kept (a forward without
          gradients, an eval pass, leaves both as the training forward made them);
        * ``memopt/escalations``, ``memopt/lowerings`` (with ``drift.lower`` or a budget),
          ``memopt/drift_skipped``: so far; ``memopt/drift_max``: the last check's largest
          module drift (``drift=False`` leaves it out: integrations log it at a check's step);
        * ``memopt/peak_bytes``: the last step's peak above the step's start
          (:class:`~.measure.process.StepPeak`: the allocator's, exact on CUDA when the step
          raised its high-water mark, else the most held at a forward's end, a lower bound); no
          process-wide counter is ever reset;
        * ``memopt/batch_fits_x``: how many times larger a batch fits than without memopt
          (:meth:`EngineInternals.batch_fits`);
        * ``memopt/kept_as_is_bytes``: of ``memopt/kept_bytes``, what the hooks kept as it is
          (integer and bool tensors, workspaces, tensors under ``min_numel``, unencodable ones);
        * ``memopt/unencodable``: saved tensors kept as they are since apply because the codec
          cannot take them (sparse layouts, tensor subclasses other than DTensor), once there
          was one.

        ``log.per_module`` adds ``memopt/bits/<fqn>`` (at the first call, then for modules whose
        bits changed; the root module is ``<root>``) and ``memopt/drift/<fqn>``.
        """
        logged = self.config.log
        out = self._drift.metrics(per_module=logged.per_module)
        if not drift:
            out = {
                k: v
                for k, v in out.items()
                if k != "memopt/drift_max" and not k.startswith("memopt/drift/")
            }
        bits = self._table.compressed
        if logged.per_module:
            for fqn, b in bits.items():  # a module's bits when they changed since the last call
                if self._logged_bits.get(fqn) != b:
                    out[f"memopt/bits/{fqn or '<root>'}"] = float(b)
            self._logged_bits = bits
        if bits:
            out["memopt/bits_mean"] = self._bits_mean(bits)
            for width in sorted(set(bits.values())):
                out[f"memopt/bits_modules/{width}"] = float(sum(b == width for b in bits.values()))
        if self._compression is not None:
            stats = self._compression.stats
            out["memopt/kept_bytes"] = float(stats.saved_stored)
            out["memopt/kept_as_is_bytes"] = float(stats.kept_as_is)
            out["memopt/compression_ratio"] = float(stats.forward_ratio)
            unencodable = sum(stats.unencodable.values())
            if unencodable:
                out["memopt/unencodable"] = float(unencodable)
            peak = self._compression.peak
            if peak is not None:
                out["memopt/peak_bytes"] = float(peak)
        fits = self._batch_fits()
        if fits is not None:
            out["memopt/batch_fits_x"] = fits
        return out

    def _batch_fits(self) -> float | None:
        """How many times larger a batch fits than without memopt (:func:`.process.batch_fits`):
        the step's peak above its start without memopt over the same with it.

        With it: the last step's (:attr:`.StepPeak.peak`; the step's so far while one is open),
        never under the bytes its forward kept for backward.
        Without it: that peak plus what the hooks freed, the saved activations uncompressed less
        as kept (the last training forward's, so the figure follows every change of bits); what
        lean ops and recompute free is in neither, so it reads low for them. A measured figure
        (:meth:`_take_measured_fits`, the profile of the first step) replaces that estimate: later
        steps scale it by the estimate's change since. ``None`` before a training forward was
        measured, or where the allocator cannot be read.
        """
        estimate = self._fits_estimate()
        if estimate is None or self._fits_measured is None:
            return estimate
        if self._fits_base is None:
            self._fits_base = estimate  # the step the measured figure is for
        return self._fits_measured * estimate / self._fits_base

    def _fits_estimate(self) -> float | None:
        compression = self._compression
        if compression is None or not compression.metered:
            return None
        peak = compression.peak_so_far
        original, kept = compression.stats.saved_original, compression.stats.saved_stored
        if peak is None or not original:
            return None
        peak = max(peak, kept)  # the step held at least what its forward kept, then alive
        return batch_fits(peak + original - kept, peak)

    def _take_measured_fits(self, fits: float | None) -> None:
        """Take ``fits``, :meth:`_batch_fits` as measured without and with memopt for the next
        training step (``MemOptProfileCallback``'s profile of it), in place of the estimate."""
        self._fits_measured, self._fits_base = fits, None

    def _bits_mean(self, bits: Mapping[str, int]) -> float:
        saved = self._compression.stats.modules if self._compression is not None else {}
        weights = {f: saved[f].original for f in bits if f in saved}
        total = sum(weights.values())
        if not total:
            return sum(bits.values()) / len(bits)
        return sum(bits[f] * w for f, w in weights.items()) / total

    def state_dict(self) -> dict[str, Any]:
        """Bits of every compressed module, step counter, drift history and this rank's rounding
        generators (plain Python types); before :meth:`apply`, a state loaded meanwhile."""
        if self._model is None and self._pending is not None:
            return self._pending.state_dict()
        state = {"bits": self._table.compressed, "drift": self._drift.state_dict()}
        if self._compression is not None:
            # this rank's rounding generators (a checkpoint written by rank 0 restores rank 0's)
            state["noise"] = {"rank": process_rank(), **self._compression.noise.state_dict()}
        if self._planner is not None and (self._planner.plan is not None or self._planner.chosen):
            state["recompute"] = list(self._planner.chosen)  # the planner's choice, kept on resume
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved: now, or at :meth:`apply` when loaded before.

        The state is checked whole first (a bad value, or a module the model does not have, is a
        :class:`ConfigError` naming it) and a load that fails changes nothing. Where the
        checkpoint's bits differ from the config's, the checkpoint's win unless the config's
        bits for a module changed since the checkpoint's run started; then the config's win, or
        the drift guard's escalation where it is higher (:mod:`.saved_state`). One INFO line says
        which won.
        """
        saved = read_state(state, self._drift, self.config.recompute.auto is not None)
        if self._model is None:
            self._pending = saved
        else:
            self._lay(saved)

    def _lay_pending(self) -> None:
        """Lay the state loaded before :meth:`apply` (kept when it does not fit the model)."""
        if self._pending is not None:
            self._lay(self._pending)
            self._pending = None

    def _lay(self, saved: SavedState) -> None:
        """Lay a read state on the patched model, after checking it names only its modules."""
        model = self._require_model()
        names = {f for f, _ in model.named_modules()}
        unknown = sorted(saved.modules - names)
        if unknown:
            raise ConfigError(
                f"state_dict names modules this model does not have: {unknown[:5]}"
                f"{' ...' if len(unknown) > 5 else ''} (a checkpoint of another model?); "
                f"modules here: {sorted(names - {''})[:5]}"
            )
        if saved.recompute is not None:
            problem = self._planner.misfit(saved.recompute)
            if problem is not None:
                raise ConfigError(problem)
        # Checked: nothing below raises.
        drift = self._drift
        floors = dict(saved.drift.floor) if saved.drift is not None else None  # where it started
        if saved.drift is not None:
            drift.take(saved.drift)
            drift.start(drift.configured)  # a module the checkpoint has no floor for: configured
        if saved.recompute is not None:
            self._planner.adopt(saved.recompute)
        if saved.bits is not None:
            bits, rebased, line = resumed_bits(
                saved.bits, floors, drift.configured, self._table.compressed
            )
            for fqn, b in bits.items():
                self.set_bits(fqn, b)
            drift.floor.update(rebased)
            if line is not None and self._speaks():
                log.info(line)
        noise = saved.noise
        if noise is not None and noise["rank"] == process_rank():  # others keep noise of their own
            self._compression.noise.load_state_dict(noise)

    # ----------------------------------------------------------------- planning
    def _require_model(self) -> nn.Module:
        if self._model is None:
            raise RuntimeError("call apply(model) first")
        return self._model


def plan_recompute(
    opt: MemoryOptimizer,
    loss_fn: Callable[..., Any],
    *,
    batch: Any = None,
    budget: float | None = None,
) -> RecomputePlan:
    """Measure one forward of ``loss_fn(model, batch)`` on ``opt``'s patched model now and
    recompute the modules the planner picks (``loss_fn()``, a closure, is accepted too; then no
    ``batch``); the plan is ``opt.plan.recompute`` from then on.

    Call it before training on a batch of your choice (saved bytes scale with the batch, so
    a small one plans as well) instead of letting ``recompute.auto`` measure the first
    training step, which runs at baseline memory. ``budget`` defaults to
    ``recompute.auto.budget``; RNG streams and buffers are left as they were; a previous
    planner choice is replaced. See :mod:`memopt_plugins.recompute`.
    """
    model = opt._require_model()
    loss_fn = bind_loss(loss_fn, model, batch)
    if opt._planner is None:
        if budget is None:
            raise ConfigError(
                "plan_recompute: no budget; set recompute.auto: {budget: b} or pass budget=b"
            )
        opt._planner = RecomputePlanner(opt._recompute, budget, opt._recompute_changed)
    return opt._planner.plan_now(loss_fn, budget)


class EngineInternals:
    """What :class:`~.session.MemOptSession`, the profiler and the integrations use of a
    :class:`MemoryOptimizer` besides its public face (``opt.internal``); not the user's API.

    Attributes:
        reduce_max: ``reduce_max(t) -> t`` element-wise max of a tensor over all ranks, which the
            drift check uses so that every rank decides the same bits. Integrations set their
            framework's reduce; the default all-reduces over torch.distributed when it is
            initialized (and is the identity otherwise).
        speaks: ``speaks() -> bool``, whether this process writes the drift checks' lines
            (default: rank 0).
    """

    __slots__ = ("_opt",)

    def __init__(self, opt: MemoryOptimizer) -> None:
        self._opt = opt

    @property
    def model(self) -> nn.Module | None:
        """The patched model, or ``None``."""
        return self._opt._model

    @property
    def compression(self) -> Compression | None:
        """Compression of the patched model: its ``stats`` count the bytes held for backward."""
        return self._opt._compression

    @property
    def hooks(self) -> CompressionHooks | None:
        """The saved-tensor hooks themselves (for tests and diagnostics)."""
        compression = self._opt._compression
        return compression.hooks if compression is not None else None

    @property
    def steps(self) -> int:
        """Optimizer steps counted by ``count_step`` (restored by ``load_state_dict``)."""
        return self._opt._drift.steps

    @property
    def reduce_max(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return self._opt._reduce_max

    @reduce_max.setter
    def reduce_max(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._opt._reduce_max = reduce

    @property
    def speaks(self) -> Callable[[], bool]:
        return self._opt._speaks

    @speaks.setter
    def speaks(self, speaks: Callable[[], bool]) -> None:
        self._opt._speaks = speaks

    def should_check(self, step: int | None = None) -> bool:
        """True when a drift check is due at ``step`` (``check_drift(..., if_due=True)``'s test,
        without its once-per-step rule)."""
        return self._opt._should_check(step)

    def batch_fits(self) -> float | None:
        """How many times larger a batch fits than without memopt (``memopt/batch_fits_x``)."""
        return self._opt._batch_fits()

    def take_measured_fits(self, fits: float | None) -> None:
        """Take ``fits`` as measured for the next training step in place of the estimate."""
        self._opt._take_measured_fits(fits)

    def measure_afresh(self) -> None:
        """Measure the next training step as the first after ``apply``."""
        self._opt._measure_afresh()


def _scopes_line(model: nn.Module, compressed: Mapping[str, int]) -> str:
    """What the compression scopes cover, in words: every module with a scope compresses what
    autograd saves while its own code runs, so containers count, and the model's own forward
    (the loss code outside every submodule, where it is in the model) is ``<root>``."""
    named = dict(model.named_modules())
    kinds = Counter(
        "the model's own code (<root>)" if f == "" else layer_kind(named[f]) for f in compressed
    )
    order = ("compute", "activation", "norm", "dropout", "container", "other")
    parts = [f"{kinds[k]} {k}" for k in order if kinds[k]]
    parts += [k for k in kinds if k not in order]
    widths = "/".join(str(b) for b in sorted(set(compressed.values())))
    return (
        f"compressing what autograd saves at {widths} bits in {len(compressed)} module scopes ("
        + ", ".join(parts)
        + "); a scope covers what its module's own code saves, outside its children"
    )
