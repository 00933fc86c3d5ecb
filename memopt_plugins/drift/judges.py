"""Which gradient judges each compressed module, and its drift from the two passes' gradients."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .passes import CheckedParameters, PassRecorder, sq_norms, summed_over_shards
from .report import (
    CALLS_DIFFER,
    NEGLIGIBLE_GRADIENT,
    NEGLIGIBLE_NOISE,
    NOTHING_TO_JUDGE,
    SAVES_NOTHING,
)

#: Drift slot of a module without measurable drift (a max over ranks ignores it).
UNMEASURED = -1.0
#: What a judge's indices point at: parameters, or recorded activation tensors.
PARAMS, TENSORS = "parameters", "tensors"


@dataclass(frozen=True)
class Judge:
    """Which gradients judge a module: indices into a pass's target list."""

    kind: str  # PARAMS or TENSORS
    indices: tuple[int, ...]


def find_judges(
    fqns: Sequence[str], checked: CheckedParameters, rec: PassRecorder
) -> tuple[dict[str, Judge], dict[str, str]]:
    """What judges each module (see :mod:`memopt_plugins.drift`), from the exact pass's record."""
    judges: dict[str, Judge] = {}
    unmeasured: dict[str, str] = {}
    for fqn in fqns:
        if rec.saved.get(fqn, 0) == 0:
            unmeasured[fqn] = SAVES_NOTHING
            continue
        own = checked.own(fqn)
        tensors = rec.inputs.get(fqn) or rec.outputs.get(fqn)
        if own:
            judges[fqn] = Judge(PARAMS, own)
        elif tensors:
            judges[fqn] = Judge(TENSORS, tuple(dict.fromkeys(tensors)))
        else:
            name = fqn  # its own subtree's parameters, else its nearest ancestor's
            own = checked.subtree(name)
            while name and not own:
                name = name.rpartition(".")[0]
                own = checked.subtree(name)
            if own:
                judges[fqn] = Judge(PARAMS, own)
            else:
                unmeasured[fqn] = NOTHING_TO_JUDGE
    return judges, unmeasured


def module_drifts(
    fqns: Sequence[str],
    judges: Mapping[str, Judge],
    floors: Mapping[str, float],
    exact: Sequence[torch.Tensor],
    exact_sq: torch.Tensor,
    approx: Sequence[torch.Tensor],
    metric: str,
    sharded: Sequence[int] = (),
    variance: torch.Tensor | None = None,
) -> tuple[list[float], dict[str, str]]:
    """Per-module drift (``UNMEASURED`` where there is none) and why some have none.

    ``exact``/``approx`` hold only this rank's share of the gradients at the indices ``sharded``
    (``exact_sq`` already summed over ranks there): their sums are summed over ranks as well, so a
    sharded parameter's drift is measured over the whole parameter. ``variance`` (metric
    ``noise``): per target, the sampling variance of its exact gradient; a module whose variance
    is at most ``floors[kind] ** 2`` has no measurable drift.
    """
    n = len(approx)  # recorded tensors are missing when the passes ran differently
    diff_sq = sq_norms([q - g for q, g in zip(approx, exact[:n], strict=True)])
    approx_sq = sq_norms(approx)
    dots = [(q.double() * g.double()).sum() for q, g in zip(approx, exact[:n], strict=True)]
    dot = torch.stack(dots).cpu() if dots else torch.zeros(0, dtype=torch.float64)
    if sharded:
        sums = summed_over_shards(torch.stack([diff_sq, approx_sq, dot]), sharded)
        diff_sq, approx_sq, dot = sums.unbind()
    drift = [UNMEASURED] * len(fqns)
    missing: dict[str, str] = {}
    for i, fqn in enumerate(fqns):
        judge = judges.get(fqn)
        if judge is None:
            continue
        idx = list(judge.indices)
        if any(k >= n for k in idx):
            missing[fqn] = CALLS_DIFFER
            continue
        norm = float(exact_sq[idx].sum().sqrt())
        if norm <= floors[judge.kind] or norm == 0.0:
            missing[fqn] = NEGLIGIBLE_GRADIENT
            continue
        if metric == "noise":
            noise = float(variance[idx].sum()) if max(idx) < len(variance) else None
            if noise is None:
                missing[fqn] = CALLS_DIFFER
            elif noise <= floors[judge.kind] ** 2 or noise == 0.0:
                missing[fqn] = NEGLIGIBLE_NOISE
            else:
                drift[i] = float(diff_sq[idx].sum()) / noise
        elif metric == "cosine":
            denom = norm * float(approx_sq[idx].sum().sqrt())
            drift[i] = 1.0 - float(dot[idx].sum()) / denom if denom > 0 else 1.0
        else:
            drift[i] = float(diff_sq[idx].sum().sqrt()) / norm
    return drift, missing
