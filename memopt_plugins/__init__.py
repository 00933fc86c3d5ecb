"""memopt: cut the activation memory of PyTorch training (README.md and docs/ describe the API)."""

from .config import ConfigError, MemOptConfig
from .engine import MemoryOptimizer, plan_recompute
from .recompute.wrap import RecomputeError

__all__ = ["ConfigError", "MemOptConfig", "MemoryOptimizer", "RecomputeError", "plan_recompute"]
__version__ = "0.1.0"
