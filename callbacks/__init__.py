"""Lightning callbacks for memopt, installed as ``memopt_plugins.callbacks``."""

from .memopt_callback import MemOptCallback
from .memopt_profile import MemOptProfileCallback

__all__ = ["MemOptCallback", "MemOptProfileCallback"]
