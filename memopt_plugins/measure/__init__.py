"""The measurement layer: module scopes, storage identity and one measured forward.

Shared by compression, the drift check, the recompute planner and the profiler.
"""

from .scopes import ScopeObserver, ScopeTracker, Watch, eagerly
from .step import Measurement, ModuleCost, SavedStorage, StepRecorder, measure
from .storage import ModelStorages, StorageKey, storage_key, tensor_version

__all__ = [
    "Measurement",
    "ModelStorages",
    "ModuleCost",
    "SavedStorage",
    "ScopeObserver",
    "ScopeTracker",
    "StepRecorder",
    "StorageKey",
    "Watch",
    "eagerly",
    "measure",
    "storage_key",
    "tensor_version",
]
