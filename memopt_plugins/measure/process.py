"""The memory a process or device holds now, and the most it held since a reset.

CUDA: the caching allocator's ``memory_allocated`` / ``max_memory_allocated`` (tensors only).
CPU: the process's resident set (``VmRSS``) and the kernel's high-water mark (``VmHWM``), reset by
writing 5 to ``/proc/self/clear_refs``; where ``/proc`` is missing, ``ru_maxrss`` (never reset).
"""

from __future__ import annotations

import resource

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
