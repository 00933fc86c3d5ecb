"""The measurement layer: module scopes, storage identity, one measured forward, the
allocator's timeline of a step (:mod:`.timeline`) and the isolation of a pass (:mod:`.isolate`).

Shared by compression, the drift check, the recompute planner and the profiler.
"""

from .isolate import Isolation, isolated
from .scopes import ScopeObserver, ScopeTracker, Watch, eagerly
from .step import Measurement, ModuleCost, Ratio, SavedStorage, StepRecorder, measure
from .storage import ModelStorages, StorageKey, storage_key, tensor_version
from .timeline import PeakSite, StepTimeline, record_step

__all__ = [
    "Isolation",
    "Measurement",
    "ModelStorages",
    "ModuleCost",
    "PeakSite",
    "Ratio",
    "SavedStorage",
    "ScopeObserver",
    "ScopeTracker",
    "StepRecorder",
    "StepTimeline",
    "StorageKey",
    "Watch",
    "eagerly",
    "isolated",
    "measure",
    "record_step",
    "storage_key",
    "tensor_version",
]
