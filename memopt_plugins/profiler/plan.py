"""``memopt plan``: a config for a memory budget, chosen by the recompute planner's :func:`choose`.

The plan recomputes exactly what ``recompute.auto: {budget: b}`` would pick from the same
measurement (one planner, one rule), and adds compression on top only when it is asked for
(``bits``) or when recompute alone cannot reach the budget: then the rest is compressed at the
largest bit width (16, 8, 4, 2) whose estimate meets it, and the planner picks again for what
compression leaves. Estimates use the codec's own storage cost (:func:`packed_nbytes`).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import yaml

from ..compress.estimate import storage_ratio
from ..config import HALF_BITS, OFF_BITS, ConfigError, MemOptConfig, QuantizeConfig
from ..measure.step import Measurement
from ..recompute.planner import RecomputePlan, choose
from .report import LOSS_ROW, ProfileReport, human_bytes


def _escape_glob(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def compact_globs(picked: list[str], names: list[str]) -> list[str]:
    """Globs naming exactly ``picked`` among ``names``: ``layer.0.mlp``, ``layer.1.mlp`` ... become
    ``layer.*.mlp`` when that glob matches nothing else."""
    groups: dict[str, list[str]] = {}
    for fqn in picked:
        parts = ["*" if part.isdigit() else _escape_glob(part) for part in fqn.split(".")]
        groups.setdefault(".".join(parts), []).append(fqn)
    globs = []
    for glob, members in groups.items():
        matched = [n for n in names if fnmatch.fnmatchcase(n, glob)]
        if len(members) > 1 and sorted(matched) == sorted(members):
            globs.append(glob)
        else:
            globs.extend(_escape_glob(m) for m in members)
    return globs


@dataclass(frozen=True)
class Suggestion:
    """A config proposed for a memory budget, with the estimate it was chosen by."""

    budget: float  # fraction of the measured saved-activation bytes to keep
    baseline: int  # saved-activation bytes measured without memopt
    estimate: int  # bytes estimated to stay saved under ``config``
    recompute: tuple[str, ...]  # modules recomputed (the planner's choice), in model order
    bits: int  # bits of the compressed rest (32: no compression)
    config: MemOptConfig
    freed: int = 0  # bytes the recompute frees (estimated, at these bits)
    recompute_flops: float = 0.0  # forward operations of the recomputed modules (clock-free)

    @property
    def reached(self) -> bool:
        return self.estimate <= self.budget * self.baseline

    def to_yaml(self) -> str:
        """The config as YAML (only keys that differ from the defaults), with a commented header;
        :meth:`MemOptConfig.from_yaml` reads it back."""
        share = self.estimate / self.baseline if self.baseline else 0.0
        budget, baseline = human_bytes(self.budget * self.baseline), human_bytes(self.baseline)
        lines = [
            f"# memopt plan: keep at most {self.budget:.0%} of the saved-activation bytes "
            f"({budget} of {baseline} measured)",
            f"# estimated with this config: {human_bytes(self.estimate)} ({share:.0%})"
            + ("" if self.reached else " - the budget is out of reach at these bits"),
            f"# recompute {len(self.recompute)} module(s): frees {human_bytes(self.freed)} for "
            f"{self.recompute_flops / 1e9:.3f} GFLOP of forward recomputed per step",
            "# compress: "
            + ("nothing" if self.bits >= OFF_BITS else f"the rest to {self.bits} bits"),
        ]
        if self.bits < 8:
            lines.append(
                "# the drift check raises the bits of modules whose gradients drift too far"
            )
        defaults = MemOptConfig().to_dict()
        data = {
            section: {k: v for k, v in values.items() if v != defaults[section][k]}
            for section, values in self.config.to_dict().items()
        }
        data = {section: values for section, values in data.items() if values}
        text = yaml.safe_dump(data, sort_keys=False) if data else "{}\n"
        return "\n".join(lines) + "\n" + text


def estimate_saved(
    report: ProfileReport, recompute: set[str], bits: int, quantize: QuantizeConfig | None = None
) -> int:
    """Bytes still saved when the modules in ``recompute`` are recomputed (each region keeps
    only its inputs) and the model's other floating-point tensors are compressed to ``bits``
    (with the group size and ``min_numel`` of ``quantize``, the report's config by default)."""
    ratio = storage_ratio(bits, quantize or report.config.quantize)
    return report.measurement.kept_bytes(recompute, ratio)


def _plan_at(
    measurement: Measurement, bits: int, budget: float, q: QuantizeConfig
) -> RecomputePlan:
    """The planner's choice when everything compressible is stored at ``bits``."""
    return choose(measurement, budget, ratio=storage_ratio(bits, q) if bits < OFF_BITS else None)


def suggest_config(
    report: ProfileReport,
    budget: float,
    base: MemOptConfig | None = None,
    bits: int | None = None,
) -> Suggestion:
    """Propose a config that keeps at most ``budget`` of the measured saved-activation bytes.

    ``bits=None``: recompute what the planner picks under the budget (as ``recompute.auto``
    would); only when that cannot reach it, compress the rest at the largest of 16, 8, 4, 2 bits
    that can. ``bits=b``: compress at ``b`` and let the planner recompute for what remains. Every
    other key of ``base`` (default: the report's config) is kept, its ``recompute.modules`` with
    the planner's picks added.
    """
    base = base or report.config
    if not 0 < budget <= 1:
        raise ValueError(f"budget must be in (0, 1], got {budget!r}")
    widths = (OFF_BITS, HALF_BITS, 8, 4, 2) if bits is None else (bits,)
    if any(b not in (2, 4, 8, HALF_BITS, OFF_BITS) for b in widths):
        raise ConfigError(f"plan bits: {bits!r} is not one of 2, 4, 8, 16, 32")
    q = base.quantize
    for width in widths:
        plan = _plan_at(report.measurement, width, budget, q)
        if plan.kept_bytes <= budget * report.measurement.baseline_bytes:
            break
    names = [row.fqn for row in report.modules if row.fqn != LOSS_ROW]
    # the base's own recompute globs stay, the planner's picks come after them
    picked = [g for g in compact_globs(list(plan.chosen), names) if g not in base.recompute.modules]
    config = base.with_changes(
        recompute={"modules": [*base.recompute.modules, *picked]}, quantize={"bits": width}
    )
    compressed_only = estimate_saved(report, set(), width, q)
    return Suggestion(
        budget=budget,
        baseline=report.saved_total,
        estimate=plan.kept_bytes,
        recompute=plan.chosen,
        bits=width,
        config=config,
        freed=compressed_only - plan.kept_bytes,
        recompute_flops=sum(report.measurement.costs[fqn].flops for fqn in plan.chosen),
    )
