"""Selective recompute: memopt's planner against PyTorch checkpointing of every block.

For each model (the examples' GPT and ResNet), one row per configuration: the modules it
recomputes, retained memory (held for backward after the forward) and peak over a step, both
as MiB and as a ratio to the baseline, and the median step time (forward + backward) as a ratio
to the baseline. Built on the harness: each configuration is a method on its own copy
(``harness.measured.Measured``), memory is the least retained of a few readings after a warm-up
step (``harness.memory.read_memory``), and steps are timed round-robin, the order rotating every
round (``harness.timing.time_steps``), so load drift on a shared machine hits all alike.
"planner @ matched" runs the planner at the budget equal to the memory that checkpointing every
block reaches, for a comparison at equal memory.

    python -m benchmarks.recompute_bench [--steps 15] [--device cpu] [--out FILE]

The markdown goes to stdout, and to FILE when given.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from examples.models import cnn, gpt
from memopt_plugins import MemoryOptimizer, plan_recompute
from memopt_plugins.profiler.meter import MemoryReading

from .harness.measured import FULL_SETTINGS, Measured
from .harness.memory import one_step, read_memory
from .harness.methods import (
    BASELINE,
    MEMOPT,
    PYTORCH,
    Method,
    Patched,
    checkpoint_every,
    summarize,
    unpatched,
)
from .harness.timing import time_steps
from .harness.workloads import CONFIGS, Workload

MIB = 1 << 20
CHECKPOINT = "PyTorch checkpoint, every block"


def example_workload(title: str, factory: Callable[[], tuple[Any, ...]], block: str) -> Workload:
    """An example's ``(model, batch, loss_fn)`` factory as a workload: measured, not trained."""
    _, batch, loss_fn = factory()
    return Workload(
        key=factory.__name__,
        label=factory.__name__,
        title=title,
        build=lambda: factory()[0],  # seeded: every call builds the same weights
        loss_fn=loss_fn,
        block_class=block,
        preset=CONFIGS / ("convnet.yaml" if factory is cnn else "gpt_int4_auto.yaml"),
        measure=batch,
        train_batches=None,
        val=[],
        lr=0.0,
        data="a random batch",
    )


@dataclass
class Planned(Patched):
    """A model the planner patched, with what the planner estimated for its plan."""

    estimate: str = "-"


def planner(budget: float) -> Callable[..., Patched]:
    """memopt's recompute planner at ``budget``, planned on the measurement batch."""

    def patch(model: nn.Module, workload: Any, batch: Any, steady: bool, adopt: Any) -> Planned:
        opt = MemoryOptimizer({"recompute": {"auto": {"budget": budget}}})
        opt.apply(model)
        plan = plan_recompute(opt, lambda: workload.loss_fn(model, batch))
        peak = plan.peak_bytes / plan.baseline_bytes if plan.baseline_bytes else 1.0
        estimate = f"{plan.kept_fraction:.0%} / {peak:.0%}"
        return Planned(model, optimizer=opt, detail=summarize(plan.chosen), estimate=estimate)

    return patch


BASE = Method(BASELINE, PYTORCH, unpatched)
EVERY = Method(CHECKPOINT, PYTORCH, checkpoint_every)


def measure(
    workload: Workload, methods: list[Method], device: torch.device, steps: int | None
) -> tuple[Measured, dict[int, MemoryReading], dict[int, float]]:
    """Each method's copy, its memory (least retained of two readings after a warm-up step)
    and, with ``steps``, its median step time over that many round-robin rounds."""
    measured = Measured(workload, methods, device)
    one_step(measured, workload)
    memory = read_memory(measured, workload, device, repeats=2)
    times = {}
    if steps:
        settings = replace(FULL_SETTINGS, warmup_steps=1, timed_rounds=steps)
        times = time_steps(measured, workload, settings, device)
    return measured, memory, times


def table(title: str, methods: list[Method], measured: Measured, memory, times) -> str:
    lines = [
        f"### {title}",
        "",
        "| configuration | recomputed modules | retained MiB | retained vs baseline "
        "| peak MiB | peak vs baseline | step time vs baseline | planner estimate, kept / peak |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    base, base_time = memory[0], times[0]
    for i, method in enumerate(methods):
        p = measured.patched[i]
        if p is None:
            lines.append(f"| {method.name} | failed: {measured.errors[i]} |" + " |" * 6)
            continue
        r = memory[i]
        lines.append(
            f"| {method.name} | {p.detail} | {r.retained / MIB:.1f} "
            f"| {r.retained / base.retained:.0%} | {r.peak / MIB:.1f} "
            f"| {r.peak / base.peak:.0%} | {times[i] / base_time:.2f}x "
            f"| {getattr(p, 'estimate', '-')} |"
        )
    return "\n".join(lines)


def bench_model(workload: Workload, device: torch.device, steps: int) -> str:
    """The table of one model: baseline, planner at 0.5 and 0.3, checkpointing every block, and
    the planner at the budget that checkpointing's retained memory matches."""
    workload.to(device)
    first, memory, _ = measure(workload, [BASE, EVERY], device, None)
    first.close()
    matched = memory[1].retained / memory[0].retained
    budget = min(max(matched, 0.01), 1.0)
    methods = [
        BASE,
        Method("planner, budget 0.5", MEMOPT, planner(0.5)),
        Method("planner, budget 0.3", MEMOPT, planner(0.3)),
        EVERY,
        Method(f"planner @ matched, budget {budget:.2f}", MEMOPT, planner(budget)),
    ]
    measured, memory, times = measure(workload, methods, device, steps)
    text = table(workload.title, methods, measured, memory, times)
    measured.close()
    return text


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=15, help="timed steps per configuration")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--out", type=Path, help="also write the markdown here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sections = [
        "## Selective recompute: planner vs checkpointing every block",
        "",
        f"torch {torch.__version__}, device {device}"
        + (
            f" ({torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f} on "
            f"{os.cpu_count()} cores at the start: step-time ratios carry that noise)"
            if device.type == "cpu"
            else ""
        )
        + f", median of {args.steps} steps (forward + backward) per configuration. Retained: "
        "bytes held for backward after the forward; peak: most held during the step (both above "
        "what was held before it). Planner estimate: the fractions of the baseline's saved bytes "
        "the planner predicted from its measured forward, kept after the forward and at the "
        "estimated backward peak (activation gradients not included).",
        "",
        bench_model(
            example_workload("GPT (examples/models.py: gpt, 4 blocks)", gpt, "Block"),
            device,
            args.steps,
        ),  # fmt: skip
        "",
        bench_model(
            example_workload("ResNet (examples/models.py: cnn, 4 basic blocks)", cnn, "BasicBlock"),
            device,
            args.steps,
        ),
    ]
    text = "\n".join(sections) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
