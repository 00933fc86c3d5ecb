"""The memory a process or device holds now, and the most it held since a reset.

CUDA: the caching allocator's ``memory_allocated`` / ``max_memory_allocated`` (tensors only).
CPU: the process's resident set (``VmRSS``) and the kernel's high-water mark (``VmHWM``), reset by
writing 5 to ``/proc/self/clear_refs``; where ``/proc`` is missing, ``ru_maxrss`` (never reset).
:class:`StepPeak`: a training step's peak as memopt samples it, with no reset.
"""

from __future__ import annotations

import resource
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_bytes(device: torch.device) -> int:
    """Bytes held now: allocated on a CUDA device, resident for the process on the CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    kib = _status_kib("VmRSS")
    if kib is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return kib * 1024


def peak_bytes(device: torch.device) -> int:
    """The most bytes held since the last :func:`reset_peak` (or since the process began)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    kib = _status_kib("VmHWM")
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024


def reset_peak(device: torch.device) -> bool:
    """Start a new high-water mark; False where the kernel does not allow it."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class StepPeak:
    """The memory of training steps as memopt sees it, never resetting a process-wide counter
    (the allocator's and the kernel's high-water marks are other monitors' too).

    Samples, taken by the compression hooks: the memory held when a step's first forward begins
    (:meth:`start`: parameters, the optimizer state, the batch) and at the end of each of its
    forwards (:meth:`forward_done`: besides, every activation kept for backward and the output),
    and the allocator's high-water mark around the step on CUDA (:meth:`finish`).

    :attr:`peak` is the last step's peak. On CUDA: the allocator's high-water mark when the step
    raised it (then it is exact), else the most allocated at a forward's end (a lower bound: the
    backward's own peak is not sampled). On the CPU no allocator counts tensors: the most
    resident memory of the process at a forward's end (every page of the process, the
    allocator's free lists included), the one figure that can be read without a reset.

    :attr:`transient_share`: from the first forward measured, the bytes held at its end beyond
    the step's start and the saved activations it kept, per byte those activations would have
    taken uncompressed (the output, the loss's inputs, workspaces: what compression leaves).
    """

    def __init__(self, device: Callable[[], torch.device]) -> None:
        self.device = device  # read at each step: a model may move after it is patched
        self.peak: int | None = None
        self.transient_share: float | None = None
        self._open = False
        self._paused = 0
        self._start = self._seen = self._mark = 0

    def start(self) -> None:
        """A training forward begins; the first of a step opens the step."""
        if self._open or self._paused:
            return
        device = self.device()
        self._open = True
        self._start = self._seen = current_bytes(device)
        self._mark = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0

    def forward_done(self, kept: int, original: int) -> None:
        """A training forward ended, having kept ``kept`` bytes of saved activations that take
        ``original`` uncompressed."""
        if not self._open or self._paused:
            return
        held = current_bytes(self.device())
        self._seen = max(self._seen, held)
        if self.transient_share is None and original > 0:
            self.transient_share = max(held - self._start - kept, 0) / original

    def finish(self) -> None:
        """The optimizer step is taken: the step's :attr:`peak` is known."""
        if not self._open:
            return
        self._open = False
        device = self.device()
        mark = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        self.peak = mark if mark > self._mark else self._seen

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards inside are no training step's (the drift check's passes)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
