"""``quantize.budget`` and ``quantize.memory``: the widths that minimise the summed squared
predicted drift within a byte target (greedy over the ladder), and the predictions it runs on.

A module's drift at width ``b`` is predicted from its drift at its current width, scaled by the
quantization step ``1 / (2^b - 1)`` (:func:`step_size`): the sensitivity of ActNN and GACT, read
from the check's own pass. The prediction only orders the choices: a module's drift is partly the
other modules' rounding carried back through backward, which no scaling of its own width predicts,
so the monitor probes every solved allocation with one compressed pass and the threshold stays
the hard cap (docs/drift.md, "A memory target").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..config import HALF_BITS, OFF_BITS
from ..distributed import is_rank_zero
from .report import BUDGET_TOLERANCE

log = logging.getLogger("memopt")

#: Relative step of a bfloat16 copy: 8 significant bits, rounded to nearest per value (about
#: half an 8-bit group code's step relative to the values it holds).
HALF_STEP = 1 / 511


def step_size(bits: int) -> float:
    """The quantization step at ``bits`` relative to a group's range (0 at 32: exact)."""
    if bits >= OFF_BITS:
        return 0.0
    if bits == HALF_BITS:
        return HALF_STEP
    return 1 / (2**bits - 1)


@dataclass(frozen=True)
class Pricing:
    """What the allocation costs: ``costs[fqn][bits]``, the bytes module ``fqn`` keeps at each
    width (of the check's sample), the ``target`` in the same units, and ``scale``: bytes of a
    training forward per byte of the sample (1.0 when no training forward was counted);
    ``key`` names the config key(s) the target comes from, for the log."""

    costs: dict[str, dict[int, float]]
    target: float
    scale: float = 1.0
    key: str = "quantize.budget"

    @property
    def widths(self) -> tuple[int, ...]:
        """Every width priced, narrowest first: what the solver chooses from."""
        return tuple(sorted({b for c in self.costs.values() for b in c}))

    def total(self, bits: Mapping[str, int]) -> float:
        """The bytes kept at ``bits`` (modules not priced keep none)."""
        return sum(c[bits[f]] for f, c in self.costs.items() if f in bits)


def priced_widths(ladder: Iterable[int], bits: Iterable[int]) -> tuple[int, ...]:
    """The widths a budget prices: ``drift.ladder`` and every width a module starts from or stands
    at (``quantize.bits`` under the ladder's first rung, a width set by hand), so that a module's
    own bits are always one of the solver's choices, and its start bits a rung to come back to."""
    return tuple(sorted({*ladder, *bits}))


def solve(
    current: Mapping[str, int],
    pricing: Pricing,
    sensitivity: Mapping[str, float],
    widths: Sequence[int],
    floors: Mapping[str, int],
    threshold: float,
) -> dict[str, int]:
    """Widths for the priced modules: from ``current``, lower the module whose next rung down
    adds the least predicted squared drift per byte saved until the total is within the target
    (first those predicted to stay under ``threshold``), then raise the one whose next rung up
    removes the most per byte added while a raise still fits. Never under ``floors``; modules
    not priced keep their bits. Deterministic (ties by name), so every rank solves the same."""
    out = dict(current)
    costs = pricing.costs
    total = pricing.total(out)

    def drift(fqn: str, bits: int) -> float:
        return sensitivity.get(fqn, 0.0) * step_size(bits)

    def below(bits: int) -> int | None:
        return next((w for w in reversed(widths) if w < bits), None)

    def above(bits: int) -> int | None:
        return next((w for w in widths if w > bits), None)

    while total > pricing.target:
        best = None
        for fqn in sorted(costs):
            bits = out[fqn]
            lower = below(bits)
            if lower is None or lower < floors.get(fqn, widths[0]):
                continue
            saved = costs[fqn][bits] - costs[fqn][lower]
            if saved <= 0:
                continue
            added = drift(fqn, lower) ** 2 - drift(fqn, bits) ** 2
            key = (drift(fqn, lower) > threshold, added / saved, fqn)
            if best is None or key < best[0]:
                best = (key, fqn, lower, saved)
        if best is None:
            break
        _, fqn, lower, saved = best
        out[fqn] = lower
        total -= saved
    while True:
        best = None
        for fqn in sorted(costs):
            bits = out[fqn]
            upper = above(bits)
            if upper is None:
                continue
            extra = costs[fqn][upper] - costs[fqn][bits]
            gain = drift(fqn, bits) ** 2 - drift(fqn, upper) ** 2
            if extra <= 0 or gain <= 0 or total + extra > pricing.target:
                continue
            key = (-gain / extra, fqn)
            if best is None or key < best[0]:
                best = (key, fqn, upper, extra)
        if best is None:
            return out
        _, fqn, upper, extra = best
        out[fqn] = upper
        total += extra


def log_outcome(priced: Pricing, kept: float, held: Sequence[str], floor: int, step: int) -> None:
    """The check's line on the budget (rank 0): the bytes the bits keep (INFO), or by how much
    they miss it and the modules ``drift.threshold`` holds above ``floor`` bits (WARNING)."""
    if not is_rank_zero():
        return
    target, scale = priced.target * priced.scale, priced.scale
    share = kept / priced.target if priced.target else float("inf")
    if share <= 1 + BUDGET_TOLERANCE:
        log.info(
            "memopt: %s %s: the bits keep %s (%.1f%%) at step %d",
            priced.key,
            _mib(target),
            _mib(kept * scale),
            100 * share,
            step,
        )
        return
    log.warning(
        "memopt: %s %s missed by %s (%.1f%%) at step %d: %s",
        priced.key,
        _mib(target),
        _mib((kept - priced.target) * scale),
        100 * (share - 1),
        step,
        "drift.threshold holds " + ", ".join(f or "<root>" for f in held)
        if held
        else f"the modules keep more even at {floor} bits",
    )


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"
