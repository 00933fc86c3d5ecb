"""The compiled rows: whole-model ``torch.compile`` with and without memopt, as its own phase.

For the transformers (``methods.COMPILED_WORKLOADS``; the CNN is left out to bound the bench's
time) every method of ``methods.COMPILED_METHODS`` patches its own copy of the model and compiles
it whole (``model.compile()``, inductor). They are measured as the eager methods are -- memory in
the child process (:func:`compiled_memory`), gradient error and step time round-robin in the
parent (``run.measure_rows``) -- with these differences:

* :func:`compiling` around each workload's compiled methods: dynamo's caches are reset before
  and after (every compiled copy starts from a fresh cache, and none outlives its phase), and
  dynamo's recompile limit is raised and made to fail loudly: every compiled model's entry is
  ``nn.Module._call_impl``'s code object, whose cache holds a graph per copy, and past the
  default limit of 8 dynamo would silently run the rest eagerly. torch.compile's
  ``activation_memory_budget`` is set by each copy's own backend while its graphs are compiled
  (``methods.inductor``); dynamo never reuses a graph across backends, so the copies at
  budgets 1.0, 0.5 and 0.3 can run side by side without a reset between them.
* :func:`compile_all`: :data:`COMPILE_WARMUP` steps of each method before anything is read (the
  first compiles; the second takes any recompile the first step's side effects cause); the first
  step's seconds are reported, and a copy whose backend compiled no graph fails.
* the gradient error is against the compiled baseline under the same seed: inductor draws its
  own dropout masks, not eager's, so the eager gradient is no reference;
* no training runs (the issue asks for memory, step time and gradient error).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .measured import Measured
from .memory import measure_memory
from .methods import Method, Patched
from .workloads import Workload

#: Untimed steps of each compiled method before its first reading (the first one compiles).
COMPILE_WARMUP = 2
#: Dynamo's recompile limit while compiled methods run: a graph per copy of the model.
RECOMPILE_LIMIT = 64


@contextmanager
def compiling() -> Iterator[None]:
    """Fresh dynamo caches, before and after; recompile limit raised, and hitting it raises."""
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(
            recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True
        ):
            yield
    finally:
        torch._dynamo.reset()


def compile_all(measured: Measured, workload: Workload) -> dict[int, float]:
    """:data:`COMPILE_WARMUP` steps of every method still standing; ``{index: seconds of the
    first step}`` (compiling). A method whose backend compiled no graph is dropped."""
    first: dict[int, float] = {}

    def warm_up(i: int, p: Patched) -> None:
        for step in range(COMPILE_WARMUP):
            start = time.perf_counter()
            p.model.zero_grad(set_to_none=True)
            p.loss(workload.loss_fn, workload.measure).backward()
            if step == 0 and p.backend is not None:
                first[i] = time.perf_counter() - start
        if p.backend is not None and not p.backend.graphs:
            raise RuntimeError("torch.compile compiled no graph: the model ran eagerly")

    measured.each(warm_up)
    return first


def compiled_memory(
    workload: Workload, methods: list[Method], device: torch.device, repeats: int
) -> dict[str, Any]:
    """:func:`memory_child.measure_memory` of the compiled ``methods`` (in the child), each
    reading with the seconds of its first, compiling step (``first_step``)."""
    with compiling():
        return measure_memory(workload, methods, device, repeats, warm_up=compile_all)
