"""Helpers shared by the memory tests: one measured step, gradient comparisons, and the peak of
the CPU allocator's bytes over a stretch of code (:class:`AllocationPeak`)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from fresh import context

from memopt_plugins import MemoryOptimizer
from memopt_plugins.profiler.meter import MemoryMeter, MemoryReading


def measure(build, config=None, repeats: int = 2, compile=None) -> MemoryReading:
    """Retained/peak memory of one step of a freshly built model (minimum over ``repeats``).

    Measured in a fresh process (:mod:`fresh`, with this process's thread count), as the CPU
    needs: in a process that has run other tests, what its heap went through
    moved a compressed step's peak by ~5 MB from one run of the suite to the next. ``build``
    must be importable (a module-level function), as must ``compile`` (``compile(model)`` compiles
    the model or its blocks after memopt is applied). A warm-up step allocates the gradients (and
    compiles) first, so the reading covers activations only.
    """
    with context().Pool(1) as pool:
        args = (build, config, repeats, torch.get_num_threads(), compile)
        return pool.apply(_measure_here, args)


def _measure_here(build, config, repeats: int, threads: int, compile=None) -> MemoryReading:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, batch, loss_fn = build()
    opt = MemoryOptimizer(config) if config is not None else None
    if opt is not None:
        opt.apply(model)
    if compile is not None:
        compile(model)
    stats = opt.internal.compression.stats if opt is not None else None
    meter = MemoryMeter("cpu")
    loss_fn(model, batch).backward()
    readings = [meter.measure(lambda: loss_fn(model, batch), stats) for _ in range(repeats)]
    if opt is not None:
        opt.remove()
    return min(readings, key=lambda r: r.retained)


def gradients(
    model, batch, loss_fn, config=None, seed: int = 0, compile=None
) -> dict[str, torch.Tensor]:
    """Parameter gradients of one step (model patched with ``config`` when given, then restored;
    ``compile(model)`` compiles it or its blocks after the patch)."""
    opt = MemoryOptimizer(config) if config is not None else None
    if opt is not None:
        opt.apply(model)
    if compile is not None:
        compile(model)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss_fn(model, batch).backward()
    if opt is not None:
        opt.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def rel_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """‖a − b‖₂ / ‖b‖₂ over all gradients together."""
    num = sum(((a[k] - b[k]).double() ** 2).sum() for k in b)
    den = sum((b[k].double() ** 2).sum() for k in b)
    return float((num / den).sqrt())


@contextmanager
def vectorized_kernels():
    """Inductor's kernels as it compiles them on the machine by default (vectorized where the CPU
    can), not the suite's scalar ones (tests/conftest.py)."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.simdlen": None}):
        yield


def compile_blocks(model, backend: str = "inductor") -> None:
    """``block.compile()`` on every transformer block of a Hugging Face GPT-2 (per-block compile,
    as torchtitan and torchtune do)."""
    for block in model.transformer.h:
        block.compile(backend=backend)


def compile_whole(model, backend: str = "inductor") -> None:
    """``model.compile()``: the whole model as one compiled region."""
    model.compile(backend=backend)


# Dynamo and AOTAutograd as inductor runs them (inductor's decompositions and partitioner, the
# hooks inlined into the graphs), the graphs then run eagerly instead of through inductor's code
# generation: for tests of what memopt does around compiled graphs (drift checks, recompiles,
# frame counts) rather than of the memory or numbers of inductor's kernels. Generating the kernels
# of the in-graph stochastic codec takes inductor minutes on a 2-core machine.
NO_CODEGEN = "aot_eager_decomp_partition"


class AllocationPeak:
    """The peak of the bytes allocated on the CPU between :meth:`start` and :meth:`stop`, above
    where they stood at :meth:`start` (blocks allocated before and freed in between are not
    counted), read from the profiler's allocation events: for a stretch that no single call
    covers (a training step of a framework's loop, from one callback event to another)."""

    def __init__(self) -> None:
        self._profile = None
        self.peak = 0  # the last stretch's
        self.end = 0  # what of it was still allocated at its end

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()

    def stop(self) -> int:
        profiled, self._profile = self._profile, None
        profiled.__exit__(None, None, None)
        self.peak, self.end = _peak_of(profiled)
        return self.peak


def peak_above_start(fn: Callable[[], object]) -> tuple[int, int]:
    """(peak, end) of the bytes allocated on the CPU while ``fn`` runs, above where they stood
    when it started (:class:`AllocationPeak`)."""
    meter = AllocationPeak()
    meter.start()
    try:
        fn()
    finally:
        meter.stop()
    return meter.peak, meter.end


def _peak_of(prof) -> tuple[int, int]:
    """(peak, end) of the live bytes over a profile's allocation events, in time order."""
    from torch._C._profiler import _EventType

    tree = prof.profiler.kineto_results.experimental_event_tree()
    events, stack = [], list(tree)
    while stack:
        e = stack.pop()
        events.append(e)
        stack.extend(e.children)
    allocations = sorted(
        (e for e in events if e.tag == _EventType.Allocation), key=lambda e: e.start_time_ns
    )
    live, peak, opened = 0, 0, {}
    for e in allocations:
        size, ptr = e.extra_fields.alloc_size, e.extra_fields.ptr
        if size > 0:
            opened[ptr] = size
        elif ptr in opened:
            size = -opened.pop(ptr)
        else:
            continue
        live += size
        peak = max(peak, live)
    return peak, live


def record_check_peaks(memopt: MemoryOptimizer) -> list[int]:
    """From now on, every ``memopt.check_drift`` call (as an integration makes it) runs under
    :func:`peak_above_start`; the list returned gets each check's peak."""
    peaks: list[int] = []
    check = memopt.check_drift

    def measured(*args, **kwargs):
        report = None

        def run() -> None:
            nonlocal report
            report = check(*args, **kwargs)

        peaks.append(peak_above_start(run)[0])
        return report

    memopt.check_drift = measured
    return peaks
