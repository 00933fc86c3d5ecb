"""Memory meter: bytes retained for backward after the forward, and the peak over a step.

CUDA: ``memory_allocated`` / ``max_memory_allocated``. CPU: the process's resident set (RSS);
glibc is told at first use to serve blocks of 4 KiB and more with mmap and to return freed memory
at once (as ``MALLOC_MMAP_THRESHOLD_=4096 MALLOC_TRIM_THRESHOLD_=0`` would), free heap pages are
given back (``malloc_trim``) before each reading, and the peak is the kernel's high-water mark
(``VmHWM``), reset before each step. The threshold is that low because compressed activations come
with small per-group tables (scale and zero point), and blocks under it are served from heap pages
already resident, which RSS does not see. Smaller blocks still hide; tests therefore take
``max(retained, packed)`` as what a compressed step holds.

This is the reading of a fresh process (the benchmarks and the memory tests spawn one per
figure). ``memopt profile`` reads the allocator's own live bytes instead
(:mod:`memopt_plugins.measure.timeline`): in a process that has run other work, RSS also counts
library code a first call pages in and heap pages the allocator keeps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..compress.stats import SavedStats
from ..measure.process import current_bytes, peak_bytes, reset_peak

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc (``None`` under another C library), told once to serve blocks of 4 KiB and more with
    mmap and to return freed memory at once."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return None
    libc.mallopt(_M_MMAP_THRESHOLD, 4096)
    libc.mallopt(_M_TRIM_THRESHOLD, 0)
    return libc


def _release_free_heap() -> None:
    """Give free heap memory back to the kernel (``malloc_trim``), so that RSS counts only live
    blocks: without it, blocks freed inside the heap by earlier work stay resident, and new
    blocks served from them add nothing to RSS (a long test process read 0 retained bytes)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@dataclass(frozen=True)
class MemoryReading:
    """One training step's memory, in bytes above what was held before the step."""

    retained: int  # held for backward after the forward
    peak: int  # most held at any time during forward + backward
    packed: int  # compact bytes the compression hooks held after the forward
    device: str


class MemoryMeter:
    """Measures a forward/backward step on ``device`` (``"cpu"`` or a CUDA device)."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        if self.device.type == "cpu":
            _glibc()  # tune malloc before the first reading

    def current(self) -> int:
        return current_bytes(self.device)

    def reset_peak(self) -> None:
        reset_peak(self.device)

    def peak(self) -> int:
        return peak_bytes(self.device)

    def _settle(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        else:
            _release_free_heap()

    def measure(
        self,
        forward: Callable[[], torch.Tensor],
        stats: SavedStats | None = None,
        backward: bool = True,
    ) -> MemoryReading:
        """Run ``forward()`` (returns a scalar loss), then its backward; read memory around both."""
        self._settle()
        before = self.current()
        self.reset_peak()
        loss = forward()
        self._settle()
        retained = self.current() - before
        packed = stats.held_bytes if stats is not None else 0
        if backward:
            loss.backward()
        del loss
        self._settle()
        peak = self.peak() - before
        return MemoryReading(retained, max(peak, retained), packed, str(self.device))
