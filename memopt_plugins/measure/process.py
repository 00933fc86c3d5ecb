"""The memory a process or device holds now, and the most it held since a reset.

CUDA: the caching allocator's ``memory_allocated`` / ``max_memory_allocated`` (tensors only).
CPU: the process's resident set (``VmRSS``) and the kernel's high-water mark (``VmHWM``), reset by
writing 5 to ``/proc/self/clear_refs``; where ``/proc`` is missing, ``ru_maxrss`` (never reset).
:func:`in_use_bytes`: what the allocator holds (the C heap's bytes in use on the CPU, not pages).
:class:`StepPeak`: a training step's peak above its start as memopt samples it, with no reset.
"""

from __future__ import annotations

import ctypes
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


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _heap_reader() -> Callable[[], int] | None:
    """glibc's ``mallinfo2``: bytes the C heap has handed out and not taken back (its arenas'
    chunks in use plus its mmapped blocks), whatever its trim and mmap settings; ``None``
    without glibc 2.33 or later."""
    try:
        info = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    info.restype = _MallInfo2
    info.argtypes = []

    def read() -> int:
        got = info()
        return got.uordblks + got.hblkhd

    return read


_HEAP = _heap_reader()


def in_use_bytes(device: torch.device) -> int | None:
    """Bytes the allocator holds for the program now: allocated tensors on a CUDA device, the C
    heap's bytes in use on the CPU (where PyTorch's CPU tensors live); ``None`` where it cannot
    be read (a C library without ``mallinfo2``)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _HEAP() if _HEAP is not None else None


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

    Every figure is above the step's start: the bytes the allocator holds when a step's first
    forward begins (parameters, the optimizer state, the batch) are not the step's. Samples,
    taken by the compression hooks: the allocator's bytes in use at that start (:meth:`start`)
    and at the end of each of the step's forwards (:meth:`forward_done`: every activation kept
    for backward and the output), and its high-water mark around the step on CUDA
    (:meth:`finish`). The allocator read is :func:`in_use_bytes`: tensors on CUDA, the C heap's
    bytes in use on the CPU (never the resident set, which counts the allocator's free pages
    and moves with its settings).

    :attr:`peak`: the last step's peak above its start. On CUDA the allocator's high-water mark
    when the step raised it (exact), else the most held at a forward's end; on the CPU the most
    held at a forward's end (a lower bound: the backward's own transient is not sampled), and
    never less than what the compression hooks hold then beyond what they held at the start
    (``kept``: memory made in the step, which a free elsewhere -- a garbage collection of an
    earlier step's objects -- can hide from the heap's count). ``None`` where the allocator
    cannot be read.
    """

    def __init__(self, device: Callable[[], torch.device]) -> None:
        self.device = device  # read at each step: a model may move after it is patched
        self.peak: int | None = None
        self._open = False
        self._paused = 0
        self._start: int | None = None
        self._seen = self._mark = self._kept = 0

    @property
    def so_far(self) -> int | None:
        """The open step's peak above its start so far (its forwards' ends), else :attr:`peak`."""
        if not self._open or self._start is None:
            return self.peak
        return self._seen

    def start(self, kept: int = 0) -> None:
        """A training forward begins; the first of a step opens the step (``kept``: the bytes
        the compression hooks hold now)."""
        if self._open or self._paused:
            return
        device = self.device()
        self._open = True
        self._start = in_use_bytes(device)
        self._kept = kept
        self._seen = 0
        self._mark = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0

    def forward_done(self, kept: int = 0) -> None:
        """A training forward ended: what the step holds now is sampled (``kept``: the bytes
        the compression hooks hold now)."""
        if not self._open or self._paused or self._start is None:
            return
        held = in_use_bytes(self.device())
        if held is not None:
            self._seen = max(self._seen, held - self._start, kept - self._kept)

    def finish(self) -> None:
        """The optimizer step is taken: the step's :attr:`peak` is known."""
        if not self._open:
            return
        self._open = False
        if self._start is None:
            return
        device = self.device()
        mark = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        self.peak = mark - self._start if mark > self._mark else self._seen

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards inside are no training step's (the drift check's passes)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1


def batch_fits(without: float, with_: float) -> float | None:
    """How many times larger a batch fits with memopt: the step's peak above its start without
    memopt over the same with it, both for the same batch (or both per sample). What does not
    grow with the batch is held before the step starts and is in neither. ``None`` when the
    peak with memopt is unknown or nothing."""
    if with_ <= 0:
        return None
    return without / with_
