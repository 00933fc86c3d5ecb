"""Selective recompute: wrapping modules in checkpoints (:mod:`.wrap`) and the planner
(:mod:`.planner`) that picks them under a memory budget."""
