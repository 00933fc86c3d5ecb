"""memopt side by side with PyTorch's own memory tools: memory, step time, gradient error, loss.

For each workload (``harness/workloads.py``: our GPT, Hugging Face GPT-2, a ResNet-style CNN)
every method of ``harness/methods.py`` patches its own copy of the same initial model, then

1. memory of one training step with :class:`memopt_plugins.profiler.meter.MemoryMeter`, in a fresh
   child process (docs/peak-and-planning.md, "Reading memory yourself": the meter tunes glibc's
   malloc process-wide, which would slow the timed steps) -- retained for backward after the forward
   and peak over the step, above what was held before (gradients are allocated by a warm-up step
   first), the smallest of a few readings taken round-robin; on the CPU a compressed method's
   retained is ``max(RSS delta, packed bytes)`` because RSS misses the small heap blocks (per-group
   scales) that glibc serves from pages already resident;
2. gradient relative error ``|g - g_exact| / |g_exact|`` over all parameters, on the measurement
   batch, against the unpatched model under the same RNG seed;
3. step time (forward + backward) = the median over several steps after a warm-up, methods
   alternated round-robin (the order rotating every round) so that load drift hits all alike;
4. convergence (the GPT on text, the CNN on digits): AdamW for a fixed number of steps from the
   same initial weights on the same batches, runs interleaved step by step (each with its own RNG
   stream, so every run equals a standalone seeded one), then the mean loss on held-out data
   (with BatchNorm statistics re-estimated for the final weights: ``precise_batchnorm``).
   Each method trains on the workload's seeds (the CNN's ten: means are reported); the
   baseline also trains on as many other seeds, which shows the run-to-run spread. With several
   seeds, each final loss is also compared with the baseline's on the same seed (same weights
   and batches), and the mean change is given with its 95% confidence interval; the CNN repeats
   this on a short schedule with many more seeds (more still for the baseline and the methods
   whose loss the benchmark issue bounds).

Then, for the transformers, the compiled methods (``methods.COMPILED_METHODS``: the whole model
under ``model.compile()``, with memopt applied before compiling, and torch.compile's own
``activation_memory_budget`` as peers) get steps 1-3 in a phase of their own (``compiled.py``),
every ratio and gradient error against the compiled baseline; they are not trained.

A method that raises is reported as failed, with its error, and the others carry on. Writes
``results.md`` (tables; each says which device produced it), ``results.json`` and ``pareto.png``
to ``--out``. On a CUDA machine everything runs on the GPU (memory from ``memory_allocated`` /
``max_memory_allocated``). Timings are reported, never asserted.

This file is the entry point: the command line, one workload's phases in order, the results
files. The phases live in ``harness/``: ``memory.py`` (1), ``gradients.py`` (2), ``timing.py``
(3), ``training.py`` (4) and ``compiled.py`` (what differs for the compiled methods), sharing
``measured.py`` (settings, the patched copies), ``records.py`` (the rows), ``stats.py`` (paired
intervals) and ``sizes.py`` (how big each workload is); ``report.py`` writes the tables and the
plot.

    python -m benchmarks.run [--quick] [--out DIR] [--device cpu|cuda] [--threads N]
                             [--only gpt,hf-gpt2,cnn] [--methods NAMES] [--no-compile]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # before transformers is imported

from . import RESULTS  # noqa: E402
from .harness.compiled import compile_all, compiled_memory, compiling  # noqa: E402
from .harness.gradients import gradient_errors  # noqa: E402
from .harness.measured import (  # noqa: E402
    FULL_SETTINGS,
    QUICK_SETTINGS,
    Measured,
    Settings,
    describe_device,
    log,
    shape_of,
)
from .harness.memory import measure_memory, memory_in_child, record_memory  # noqa: E402
from .harness.methods import (  # noqa: E402
    BASELINE,
    C_BASELINE,
    COMPILED_METHODS,
    COMPILED_WORKLOADS,
    METHODS,
    Method,
)
from .harness.plot import write_plot  # noqa: E402
from .harness.records import Row, WorkloadResult, harness_row, write_results_json  # noqa: E402
from .harness.sizes import Sizes  # noqa: E402
from .harness.timing import time_steps  # noqa: E402
from .harness.training import train  # noqa: E402
from .harness.workloads import Workload, workloads  # noqa: E402
from .report import write_results  # noqa: E402


def measure_rows(
    workload: Workload,
    methods: list[Method],
    child: dict[str, Any],
    settings: Settings,
    device: torch.device,
    started: float,
    compiled: bool = False,
) -> list[Row]:
    """Gradient error and step time of every method, memory (and the recompute plans, adopted
    here) from the child process's ``child`` output. ``compiled``: the compiled methods, which
    compile first (``compiled.compile_all``); their gradient error is against the first of
    them, the compiled baseline, as for the eager methods against the eager one."""
    tag = f"{workload.key}{' compiled' if compiled else ''}"
    log(f"{tag}: patching {len(methods)} copies", started)
    measured = Measured(workload, methods, device, child["plans"])
    rows = [
        harness_row(m.name, m.family, p.detail if p is not None else "-")
        for m, p in zip(methods, measured.patched, strict=True)
    ]
    if compiled:
        log(f"{tag}: compiling", started)
        compile_all(measured, workload)

    log(f"{tag}: gradient error", started)
    for i, error in gradient_errors(measured, workload).items():
        rows[i].bench.grad_error = error
    log(f"{tag}: step time ({settings.timed_rounds} rounds)", started)
    for i, seconds in time_steps(measured, workload, settings, device).items():
        rows[i].step_seconds = seconds
    graphs = [getattr(p and p.backend, "graphs", None) for p in measured.patched]
    measured.close()

    for i, row in enumerate(rows):
        reading = child["memory"].get(row.method, {"error": "not measured"})
        row.bench.error = measured.errors.get(i) or reading.get("error")
        record_memory(row, reading, device)
        if graphs[i]:
            row.bench.detail += f"; {graphs[i]} graph{'' if graphs[i] == 1 else 's'}"
    return rows


def bench_workload(
    workload: Workload,
    methods: list[Method],
    compiled_methods: list[Method],
    child: dict[str, Any],
    settings: Settings,
    device: torch.device,
    started: float,
) -> WorkloadResult:
    """Gradient error, step time and convergence of every method, memory from the child (see
    :func:`measure_rows`); then the compiled methods' rows, where the child measured them."""
    result = WorkloadResult(
        key=workload.key,
        label=workload.label,
        title=workload.title,
        data=workload.data,
        device=describe_device(device),
        measure_shape=shape_of(workload.measure),
    )
    rows = measure_rows(workload, methods, child, settings, device, started)
    if workload.train_batches is not None:
        log(f"{workload.key}: training", started)
        train(workload, methods, rows, result, device)
    result.rows = rows
    if compiled_methods and "compiled" in child:
        with compiling():
            result.compiled = measure_rows(
                workload, compiled_methods, child["compiled"], settings, device, started, True
            )
    log(f"{workload.key}: done", started)
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (``argv``, or ``sys.argv``); ``--quick`` defaults to one thread."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one thread: a smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the results")
    parser.add_argument("--device", help="cpu or cuda[:i] (default: cuda when available)")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's; --quick: 1)")
    parser.add_argument("--only", help="comma-separated workload keys: gpt,hf-gpt2,cnn")
    parser.add_argument("--train-steps", type=int, help="training steps (default: the size's)")
    parser.add_argument(
        "--methods",
        help="comma-separated method names to run (the baseline always runs; the compiled "
        "baseline where a compiled method is named, and no compiled rows where none is)",
    )
    parser.add_argument(
        "--no-compile", action="store_true", help="skip the compiled (torch.compile) rows"
    )
    parser.add_argument("--memory-json", type=Path, help=argparse.SUPPRESS)  # the child's output
    args = parser.parse_args(argv)
    if args.quick and not args.threads:
        args.threads = 1
    return args


def select_workloads(args: argparse.Namespace, sizes: Sizes) -> list[Workload]:
    """The workloads at ``sizes``, those of ``--only`` where it is given."""
    selected = workloads(sizes)
    if not args.only:
        return selected
    keys = args.only.split(",")
    unknown = sorted(set(keys) - {w.key for w in selected})
    if unknown:
        raise SystemExit(f"--only: unknown workloads {unknown}; known: {[w.key for w in selected]}")
    return [w for w in selected if w.key in keys]


def select_methods(args: argparse.Namespace) -> tuple[list[Method], list[Method]]:
    """The eager and the compiled methods of ``--methods`` (all by default), each list's
    baseline among them; no compiled methods with ``--no-compile`` or when ``--methods`` names
    none of them."""
    compiled = [] if args.no_compile else COMPILED_METHODS
    if not args.methods:
        return METHODS, compiled
    names = {n.strip() for n in args.methods.split(",")}
    known = [m.name for m in METHODS + COMPILED_METHODS]
    unknown = sorted(names - set(known))
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; known: {known}")
    eager = [m for m in METHODS if m.name in names or m.name == BASELINE]
    if not any(m.name in names for m in compiled):
        return eager, []
    return eager, [m for m in compiled if m.name in names or m.name == C_BASELINE]


def main(argv: list[str] | None = None) -> Path | None:
    """Run the benchmark; returns the path of ``results.md`` (``None`` in the memory child)."""
    args = parse_args(argv)
    started = time.perf_counter()
    warnings.filterwarnings("ignore")
    logging.getLogger("memopt").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    settings = QUICK_SETTINGS if args.quick else FULL_SETTINGS
    if args.train_steps:
        settings = replace(settings, sizes=settings.sizes.with_train_steps(args.train_steps))
    selected = [w.to(device) for w in select_workloads(args, settings.sizes)]
    methods, compiled_methods = select_methods(args)

    if args.memory_json is not None:  # the child: memory only
        gc.freeze()  # the meter collects garbage around every reading: skip the imported objects
        memory = {
            w.key: measure_memory(w, methods, device, settings.memory_repeats) for w in selected
        }
        for w in selected:
            if compiled_methods and w.key in COMPILED_WORKLOADS:
                log(f"memory: {w.key} compiled", started)
                memory[w.key]["compiled"] = compiled_memory(
                    w, compiled_methods, device, settings.memory_repeats
                )
        args.memory_json.write_text(json.dumps(memory))
        return None

    memory = memory_in_child(args, started)
    results = [
        bench_workload(w, methods, compiled_methods, memory[w.key], settings, device, started)
        for w in selected
    ]
    elapsed = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "quick": args.quick,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": describe_device(device),
        "seconds": round(elapsed, 1),
        "settings": {
            "memory_repeats": settings.memory_repeats,
            "warmup_steps": settings.warmup_steps,
            "timed_rounds": settings.timed_rounds,
        },
    }
    path = write_results(args.out / "results.md", results, meta)
    write_plot(args.out / "pareto.png", results)
    write_results_json(args.out / "results.json", meta, results)
    log(f"wrote {path}, pareto.png, results.json in {elapsed:.0f} s", started)
    return path


if __name__ == "__main__":
    main()
