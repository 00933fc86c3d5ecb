"""Selective recompute: memopt's planner against PyTorch checkpointing of every block.

For each model (the examples' GPT and ResNet), one row per configuration: the modules it
recomputes, retained memory (held for backward after the forward) and peak over a step, both
as MiB and as a ratio to the baseline, and the median step time (forward + backward) as a ratio
to the baseline. Steps are interleaved across the configurations, so load drift on a shared
machine hits all of them alike. "planner @ matched" runs the planner at the budget equal to the
memory that checkpointing every block reaches, for a comparison at equal memory.

    python benchmarks/recompute_bench.py [--steps 15] [--device cpu] [--out FILE]

The markdown goes to stdout, and to FILE when given.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from methods import checkpoint_blocks, summarize  # noqa: E402
from models import cnn, gpt  # noqa: E402

from memopt_plugins import MemoryOptimizer  # noqa: E402
from memopt_plugins.profiler.meter import MemoryMeter, MemoryReading  # noqa: E402
from memopt_plugins.tree import map_tensors  # noqa: E402

MIB = 1 << 20


@dataclass
class Run:
    """One configuration of one model, ready to step."""

    name: str
    model: nn.Module
    batch: object
    loss_fn: Callable
    recomputed: str = "-"
    estimate: str = "-"
    reading: MemoryReading | None = None
    times: list[float] = field(default_factory=list)

    def step(self) -> None:
        self.loss_fn(self.model, self.batch).backward()


def build(factory: Callable, device: torch.device, name: str) -> Run:
    model, batch, loss_fn = factory()
    return Run(name, model.to(device).train(), map_tensors(lambda t: t.to(device), batch), loss_fn)


def checkpoint_every(run: Run, block_class: str) -> Run:
    """PyTorch's non-reentrant checkpoint around every block: the usual full-block recipe."""
    run.recomputed = summarize(checkpoint_blocks(run.model, block_class))
    return run


def planner(run: Run, budget: float) -> Run:
    opt = MemoryOptimizer({"recompute": {"auto": {"budget": budget}}})
    opt.apply(run.model)
    plan = opt.plan_recompute(lambda: run.loss_fn(run.model, run.batch))
    run.recomputed = summarize(plan.chosen)
    peak = plan.peak_bytes / plan.baseline_bytes if plan.baseline_bytes else 1.0
    run.estimate = f"{plan.kept_fraction:.0%} / {peak:.0%}"
    return run


def measure_memory(run: Run, meter: MemoryMeter, repeats: int = 2) -> None:
    run.step()  # gradients allocated first: the readings cover activations
    readings = [meter.measure(lambda: run.loss_fn(run.model, run.batch)) for _ in range(repeats)]
    run.reading = min(readings, key=lambda r: r.retained)


def time_steps(runs: list[Run], steps: int, device: torch.device) -> None:
    for run in runs:  # warm-up
        run.step()
    for _ in range(steps):
        for run in runs:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            run.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            run.times.append(time.perf_counter() - start)


def table(title: str, runs: list[Run]) -> str:
    base = runs[0]
    base_time = statistics.median(base.times)
    lines = [
        f"### {title}",
        "",
        "| configuration | recomputed modules | retained MiB | retained vs baseline "
        "| peak MiB | peak vs baseline | step time vs baseline | planner estimate, kept / peak |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for run in runs:
        r = run.reading
        lines.append(
            f"| {run.name} | {run.recomputed} | {r.retained / MIB:.1f} "
            f"| {r.retained / base.reading.retained:.0%} | {r.peak / MIB:.1f} "
            f"| {r.peak / base.reading.peak:.0%} "
            f"| {statistics.median(run.times) / base_time:.2f}x | {run.estimate} |"
        )
    return "\n".join(lines)


def bench_model(
    title: str, factory: Callable, block_class: str, device: torch.device, steps: int
) -> str:
    meter = MemoryMeter(device)
    every = checkpoint_every(build(factory, device, "PyTorch checkpoint, every block"), block_class)
    runs = [
        build(factory, device, "baseline"),
        every,
        planner(build(factory, device, "planner, budget 0.5"), 0.5),
        planner(build(factory, device, "planner, budget 0.3"), 0.3),
    ]
    for run in runs:
        measure_memory(run, meter)
    matched = every.reading.retained / runs[0].reading.retained
    budget = min(max(matched, 0.01), 1.0)
    extra = planner(build(factory, device, f"planner @ matched, budget {budget:.2f}"), budget)
    measure_memory(extra, meter)
    runs.append(extra)
    time_steps(runs, steps, device)
    return table(title, [runs[0], runs[2], runs[3], runs[1], runs[4]])


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
        bench_model("GPT (examples/models.py: gpt, 4 blocks)", gpt, "Block", device, args.steps),
        "",
        bench_model(
            "ResNet (examples/models.py: cnn, 4 basic blocks)",
            cnn,
            "BasicBlock",
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
