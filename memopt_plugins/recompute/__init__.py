"""Selective recompute: wrapping modules in checkpoints (:mod:`.wrap`) and the planner
(:mod:`.planner`) that picks them under a memory budget."""

from .planner import RecomputePlan, RecomputePlanner, choose, estimated_peak
from .wrap import (
    IN_RECOMPUTE,
    RECOMPUTE,
    Recompute,
    RecomputeError,
    existing_checkpointing,
    recompute_targets,
    region_actions,
)

__all__ = [
    "IN_RECOMPUTE",
    "RECOMPUTE",
    "Recompute",
    "RecomputeError",
    "RecomputePlan",
    "RecomputePlanner",
    "choose",
    "estimated_peak",
    "existing_checkpointing",
    "recompute_targets",
    "region_actions",
]
