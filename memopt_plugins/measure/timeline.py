"""A training step's memory over time, from the allocator: its peak, where it is, what is alive.

:func:`record_step` runs one forward and backward under ``torch.profiler`` with
``profile_memory=True`` (every allocation and free of the step's CPU or CUDA allocator, with the
ops and ``record_function`` ranges around it) and builds the live bytes over the step, the bytes
retained at the end of the forward, the peak, its place (phase, op, autograd node, module) and what
is alive there by kind: ``activations``, ``packed``, ``decoded``, ``recomputed``, ``backward``.
memopt marks its own work with :func:`mark`, entered only while a profiler runs. What was
allocated before the step (parameters, held gradients, optimizer state) is not counted, and
reading the allocator rather than RSS leaves out library pages and the profiler's own records.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .scopes import ScopeTracker

PACK_RANGE, UNPACK_RANGE, REPLAY_RANGE = "memopt::pack", "memopt::unpack", "memopt::replay"
_FORWARD, _BACKWARD = "memopt::forward", "memopt::backward"
_MODULE = "memopt::module::"
_NODE = "autograd::engine::evaluate_function: "
KINDS = ("activations", "packed", "decoded", "recomputed", "backward")


def mark(name: str) -> Any:
    """A ``record_function`` range named ``name`` while a profiler runs, else a no-op context."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return nullcontext()


@dataclass(frozen=True)
class PeakSite:
    """Where a step's memory peaks."""

    phase: str  # "forward" or "backward"
    op: str  # the operator allocating at the peak, e.g. "aten::mm"
    node: str | None  # backward: the autograd node running, e.g. "MmBackward0"
    module: str | None  # the module running (forward) or whose forward made ``node`` (backward)

    def __str__(self) -> str:
        where = f"in the {self.phase}"
        if self.module is not None:
            where += f" of {self.module or '<root>'}"
        if self.node is not None:
            where += f", {self.node}"
        return f"{where} ({self.op})"


@dataclass(frozen=True)
class StepTimeline:
    """One step's live bytes over time (above what was allocated before it)."""

    times: tuple[float, ...]  # seconds since the step began, one per allocation or free
    live: tuple[int, ...]  # live bytes after that event
    kinds: dict[str, tuple[int, ...]] = field(repr=False)  # live bytes by kind, per event
    backward_start: float  # seconds: when the backward began
    retained: int  # live bytes when the forward ended (held for backward, and the loss)
    peak: int  # most live bytes at any time of the step
    peak_time: float
    site: PeakSite
    alive_at_peak: dict[str, int]  # KINDS -> bytes alive at the peak
    device: str


def _names(event: Any) -> Iterator[str]:
    """Names of the ranges and operators around ``event``, innermost first."""
    parent = event.parent
    while parent is not None:
        yield parent.name
        parent = parent.parent


def _kind(names: list[str], in_backward: bool) -> str:
    for name in names:
        if name == PACK_RANGE:
            return "packed"
        if name == UNPACK_RANGE:
            return "decoded"
        if name == REPLAY_RANGE:
            return "recomputed"
    return "backward" if in_backward else "activations"


def _op_of(names: list[str]) -> str:
    for name in names:
        if name.startswith("aten::") or name.startswith("memopt::") and "::module::" not in name:
            return name
    return names[0] if names else "?"


class _ModuleRanges:
    """Watches every module while the step is profiled: a ``record_function`` range per call."""

    def __init__(self, model: nn.Module):
        self._stack: list[Any] = []
        names = [fqn for fqn, _ in model.named_modules()]
        self._watch = ScopeTracker.of(model).watch(self, names)

    def enter(self, fqn: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        scope = torch.profiler.record_function(_MODULE + fqn)
        scope.__enter__()
        self._stack.append(scope)

    def exit(self, fqn: str, module: nn.Module, args: tuple, output: Any) -> None:
        if self._stack:
            self._stack.pop().__exit__(None, None, None)

    def remove(self) -> None:
        self._watch.remove()


@contextmanager
def _kineto_quiet() -> Iterator[None]:
    """The process's stderr closed while the profiler starts or stops: the kineto build in
    torch's wheels writes a "profiler_start" / "profiler_stop" line there each time, with no
    switch to turn it off (a profiled step is no news to a user of ``memopt profile``)."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 to silence
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _all_events(tree: list[Any]) -> Iterator[Any]:
    stack = list(tree)
    while stack:
        event = stack.pop()
        yield event
        stack.extend(event.children)


def record_step(
    model: nn.Module,
    forward: Callable[[], torch.Tensor],
    device: str | torch.device = "cpu",
) -> StepTimeline:
    """Run ``forward()`` (a scalar loss) and its backward under the profiler; see the module
    docstring. ``device`` is the allocator read (``"cpu"`` or a CUDA device)."""
    device = torch.device(device)
    events = _profiled_step(model, forward, device)
    start = min(e.start_time_ns for e in events)
    backward_start = next(e.start_time_ns for e in events if e.name == _BACKWARD)
    forward_end = next(e.end_time_ns for e in events if e.name == _FORWARD)
    curve = _live_bytes(events, device, start, backward_start, forward_end)
    peak_index, kinds = curve.peak_index, curve.kinds
    site = None
    if peak_index >= 0:
        site = _site(curve.peak_event, backward_start, _modules_of_nodes(events, forward_end))
    return StepTimeline(
        times=tuple(curve.times),
        live=tuple(curve.live),
        kinds={k: tuple(v) for k, v in kinds.items()},
        backward_start=(backward_start - start) / 1e9,
        retained=curve.retained,
        peak=curve.peak,
        peak_time=curve.times[peak_index] if peak_index >= 0 else 0.0,
        site=site or PeakSite("forward", "?", None, None),
        alive_at_peak={k: kinds[k][peak_index] if peak_index >= 0 else 0 for k in KINDS},
        device=str(device),
    )


def _profiled_step(
    model: nn.Module, forward: Callable[[], torch.Tensor], device: torch.device
) -> list[Any]:
    """Every profiler event of ``forward()`` and its backward, in ``_FORWARD`` and ``_BACKWARD``
    ranges, each module's calls in a range of its own (:class:`_ModuleRanges`)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    ranges = _ModuleRanges(model)
    prof = profile(activities=activities, profile_memory=True)
    try:
        with _kineto_quiet():
            prof.start()
        with torch.profiler.record_function(_FORWARD):
            loss = forward()
        with torch.profiler.record_function(_BACKWARD):
            loss.backward()
            del loss
    finally:
        with _kineto_quiet():
            prof.stop()
        ranges.remove()
    return list(_all_events(prof.profiler.kineto_results.experimental_event_tree()))


def _modules_of_nodes(events: list[Any], forward_end: int) -> dict[int, str]:
    """The module whose forward made each autograd node, by the node's sequence number: forward
    ops carry it, and their module is the innermost module range around them."""
    from torch._C._profiler import _EventType

    module_of_seq: dict[int, str] = {}
    for e in events:
        if e.tag == _EventType.TorchOp and e.start_time_ns < forward_end:
            seq = e.extra_fields.sequence_number
            if seq >= 0 and seq not in module_of_seq:
                module = next((n[len(_MODULE) :] for n in _names(e) if n.startswith(_MODULE)), None)
                if module is not None:
                    module_of_seq[seq] = module
    return module_of_seq


@dataclass
class _LiveBytes:
    """The step's allocations on the device read, in time order: seconds since the step's
    start, live bytes and live bytes by kind after each; the bytes live at the end of the
    forward; the peak, its index and the allocation that made it (``-1``, ``None``: none)."""

    times: list[float] = field(default_factory=list)
    live: list[int] = field(default_factory=list)
    kinds: dict[str, list[int]] = field(default_factory=lambda: {k: [] for k in KINDS})
    retained: int = 0
    peak: int = 0
    peak_index: int = -1
    peak_event: Any = None


def _live_bytes(
    events: list[Any], device: torch.device, start: int, backward_start: int, forward_end: int
) -> _LiveBytes:
    """The live bytes over the step from its allocations and frees on ``device``; a free of a
    block allocated before the step is not the step's memory."""
    from torch._C._profiler import _EventType

    allocations = sorted(
        (
            e
            for e in events
            if e.tag == _EventType.Allocation and _on(e.extra_fields.device, device)
        ),
        key=lambda e: e.start_time_ns,
    )
    out = _LiveBytes()
    open_blocks: dict[int, tuple[int, str]] = {}  # ptr -> (bytes, kind)
    by_kind = dict.fromkeys(KINDS, 0)
    total = 0
    for e in allocations:
        fields = e.extra_fields
        size = fields.alloc_size
        if size > 0:
            names = list(_names(e))
            kind = _kind(names, e.start_time_ns >= backward_start)
            open_blocks[fields.ptr] = (size, kind)
        else:
            known = open_blocks.pop(fields.ptr, None)
            if known is None:
                continue  # allocated before the step: not the step's memory
            size, kind = -known[0], known[1]
        total += size
        by_kind[kind] += size
        out.times.append((e.start_time_ns - start) / 1e9)
        out.live.append(total)
        for k in KINDS:
            out.kinds[k].append(by_kind[k])
        if e.start_time_ns <= forward_end:
            out.retained = total
        if total > out.peak:
            out.peak, out.peak_index = total, len(out.live) - 1
            out.peak_event = e
    return out


def _on(event_device: Any, device: torch.device) -> bool:
    kind = "cuda" if device.type == "cuda" else "cpu"
    return str(event_device.type).lower().endswith(kind)


def _site(event: Any, backward_start: int, module_of_seq: dict[int, str]) -> PeakSite:
    from torch._C._profiler import _EventType

    names = list(_names(event))
    op = _op_of(names)
    if event.start_time_ns < backward_start:
        module = next((n[len(_MODULE) :] for n in names if n.startswith(_MODULE)), None)
        return PeakSite("forward", op, None, module)
    node = module = None
    parent = event.parent
    while parent is not None:
        if parent.name.startswith(_NODE):
            node = parent.name[len(_NODE) :]
            if parent.tag == _EventType.TorchOp:
                module = module_of_seq.get(parent.extra_fields.sequence_number)
            break
        parent = parent.parent
    return PeakSite("backward", op, node, module)
