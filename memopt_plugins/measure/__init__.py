"""The measurement layer: module scopes, storage identity, one measured forward, the
allocator's timeline of a step (:mod:`.timeline`) and the isolation of a pass (:mod:`.isolate`).

Shared by compression, the drift check, the recompute planner and the profiler.
"""
