"""Lightning callbacks for memopt, installed as ``memopt_plugins.callbacks``."""

from .memopt_callback import MemOptCallback

__all__ = ["MemOptCallback"]
