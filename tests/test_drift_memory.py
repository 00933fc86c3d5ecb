"""A drift check's memory: streamed gradients, never a second set of them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from memopt_plugins import MemoryOptimizer
from memopt_plugins.drift.passes import SKETCH, fold
from memopt_plugins.tree import slice_batch


def peak_above_start(fn: Callable[[], object]) -> tuple[int, int]:
    """(peak, end) of the bytes allocated on the CPU while ``fn`` runs, above where they stood
    when it started (blocks allocated before and freed during it are not counted)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
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


def test_check_costs_at_most_a_tenth_of_the_parameters_above_the_training_step():
    """An MLP whose parameters (32 MiB) dwarf its activations: a training step's backward holds
    the gradients; the check after it (as the integrations run it) adds at most 10% of the
    parameters' bytes on top, where keeping its exact and compressed gradients took 2x."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(32) for m in (nn.Linear(512, 512), nn.ReLU())])
    x = torch.randn(16, 512)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = MemoryOptimizer({"quantize": {"bits": 4}, "drift": {"metric": "sgd"}})
    opt.apply(model)
    sample = slice_batch(x, 8)

    def step() -> None:
        model(x).square().mean().backward()

    step()  # warm-up: the codec's tables, the allocator's first blocks
    model.zero_grad(set_to_none=True)
    step_peak, after_step = peak_above_start(step)
    assert after_step >= params  # the gradients are held when the check runs
    check_peak, _ = peak_above_start(lambda: opt.check_drift(lambda: model(sample).square().mean()))
    assert after_step + check_peak <= step_peak + 0.10 * params, (step_peak, check_peak, params)


def test_fold_estimates_norms_of_differences_within_its_stated_error():
    """Folded gradients: the squared norm exact, a difference's within ~3 standard errors
    (sqrt(2 / SKETCH) relative), with the same signs in every fold of one target."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(300_000, generator=g)
    b = a + 0.1 * torch.randn(300_000, generator=g)
    fa, sq = fold(a, 7)
    fb, _ = fold(b, 7)
    assert fa.numel() == SKETCH
    assert sq == pytest.approx(float(a.double().square().sum()), rel=1e-12)
    true = float((a - b).double().square().sum())
    assert abs(float((fa - fb).square().sum()) / true - 1) < 3 * (2 / SKETCH) ** 0.5
    small = torch.randn(100, generator=g)
    assert torch.equal(fold(small, 0)[0], small.double())  # kept whole
