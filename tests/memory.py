"""Helpers shared by the memory tests: one measured step and gradient comparisons."""

from __future__ import annotations

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
    stats = opt.compression.stats if opt is not None else None
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
