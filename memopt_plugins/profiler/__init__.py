"""The profiler: memory of one training step per module, its report and chart, and ``memopt plan``.

* :mod:`.meter` -- bytes retained for backward and the peak of a step (RSS on CPU, the allocator
  on CUDA);
* :mod:`.run` -- :func:`profile_model`, the step measured per module and on the allocator's
  timeline (peak, where it is, what is alive there, per sample), as is and under a config;
* :mod:`.report` and :mod:`.plot` -- its table, Markdown, JSON and PNGs (bars, timeline);
* :mod:`.plan` -- :func:`suggest_config`, a config for a memory budget.
"""

from .meter import MemoryMeter, MemoryReading
from .plan import Suggestion, compact_globs, estimate_saved, suggest_config
from .report import LOSS_ROW, ROOT, ModuleProfile, ProfileReport, human_bytes
from .run import profile_model

__all__ = [
    "LOSS_ROW",
    "ROOT",
    "MemoryMeter",
    "MemoryReading",
    "ModuleProfile",
    "ProfileReport",
    "Suggestion",
    "compact_globs",
    "estimate_saved",
    "human_bytes",
    "profile_model",
    "suggest_config",
]
