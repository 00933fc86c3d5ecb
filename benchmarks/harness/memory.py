"""The memory phase, run in a child process of its own (``benchmarks.run --memory-json PATH``).

:class:`memopt_plugins.profiler.meter.MemoryMeter` tunes glibc's malloc process-wide, which would
slow the timed steps, so the parent (:func:`memory_in_child`) spawns a fresh interpreter with malloc
set from its start (:data:`MALLOC_ENV`, docs/peak-and-planning.md, "Reading memory yourself"); the
child measures every method (:func:`measure_memory`) and writes JSON, which the parent folds into
its rows (:func:`record_memory`). :func:`in_fresh_process` starts such a child for any benchmark
(:func:`child_json` reads what it writes), and :func:`least_retained` is the reading every study
takes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memopt_plugins.profiler.meter import MemoryMeter, MemoryReading

from .. import ROOT
from .measured import Measured, log
from .methods import Method, Patched
from .records import Row
from .workloads import Workload

#: What the memory child process sets before Python starts (docs/peak-and-planning.md,
#: "Reading memory yourself").
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4096", "MALLOC_TRIM_THRESHOLD_": "0"}
#: The module the child runs: the benchmark's entry point, with ``--memory-json``.
ENTRY_POINT = "benchmarks.run"


def in_fresh_process(
    module: str, args: list[str], capture: bool = False, malloc: bool = True
) -> subprocess.CompletedProcess[str]:
    """``python -m module *args`` from the repository root, malloc set as :data:`MALLOC_ENV`
    from its start (``malloc=False``: as it is, for timed steps); raises if it fails.
    ``capture``: keep its stdout and stderr."""
    command = [sys.executable, "-m", module, *args]
    env = {**os.environ, **(MALLOC_ENV if malloc else {})}
    return subprocess.run(command, check=True, cwd=ROOT, env=env, capture_output=capture, text=True)


def child_json(module: str, task: dict[str, Any], threads: int, malloc: bool = True) -> Any:
    """What ``python -m module --child TASK --out FILE --threads N`` writes to ``FILE`` as JSON,
    run by :func:`in_fresh_process` (``task`` as JSON)."""
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "child.json"
        command = ["--child", json.dumps(task), "--out", str(target), "--threads", str(threads)]
        in_fresh_process(module, command, malloc=malloc)
        return json.loads(target.read_text())


def least_retained(
    meter: MemoryMeter, forward: Callable[[], Any], repeats: int, stats: Any = None
) -> MemoryReading:
    """The reading with the least retained of ``repeats`` steps (``meter.measure(forward)``)."""
    readings = [meter.measure(forward, stats) for _ in range(repeats)]
    return min(readings, key=lambda r: r.retained)


def one_step(measured: Measured, workload: Workload) -> dict[int, float]:
    """One step of every method, which allocates the gradients; no first-step times."""

    def step(i: int, p: Patched) -> None:
        p.loss(workload.loss_fn, workload.measure).backward()

    measured.each(step)
    return {}


def read_memory(
    measured: Measured, workload: Workload, device: torch.device, repeats: int
) -> dict[int, MemoryReading]:
    """``{index: reading}``: the least retained of ``repeats`` readings of every method still
    standing, taken round-robin (a method that raises is dropped from ``measured``)."""
    meter = MemoryMeter(device)
    best: dict[int, MemoryReading] = {}

    def read(i: int, p: Patched) -> None:
        reading = meter.measure(lambda: p.loss(workload.loss_fn, workload.measure), p.stats)
        if i not in best or reading.retained < best[i].retained:
            best[i] = reading

    for _ in range(repeats):
        measured.each(read)
    return best


def measure_memory(
    workload: Workload,
    methods: list[Method],
    device: torch.device,
    repeats: int,
    warm_up: Callable[[Measured, Workload], dict[int, float]] = one_step,
) -> dict[str, Any]:
    """``{"memory": {method: {retained, peak, packed} | {error}}, "plans": {method: fqns}}``.

    Each reading is the smallest-retained of ``repeats``, taken round-robin over the methods
    after ``warm_up`` (default :func:`one_step`: it allocates the gradients, so the readings
    cover activations; the compiled methods' compiles there, see ``compiled.py``), whose
    ``{index: seconds}`` go into the readings as ``first_step``. ``plans`` are the recompute
    planners' choices, for the parent to adopt.
    """
    # what is alive before the models are made (the imported libraries) becomes permanent to
    # the garbage collector: the meter collects before each figure, and a full collection over
    # the imports cost a fifth of a second, most of the phase's time
    gc.collect()
    gc.freeze()
    measured = Measured(workload, methods, device)
    first = warm_up(measured, workload)
    best = read_memory(measured, workload, device, repeats)
    memory: dict[str, dict[str, Any]] = {}
    plans: dict[str, list[str]] = {}
    for i, method in enumerate(methods):
        p = measured.patched[i]
        if p is None:
            memory[method.name] = {"error": measured.errors[i]}
            continue
        r = best[i]
        memory[method.name] = {"retained": r.retained, "peak": r.peak, "packed": r.packed}
        if i in first:
            memory[method.name]["first_step"] = first[i]
        if p.plan is not None:
            plans[method.name] = p.plan
    measured.close()
    return {"memory": memory, "plans": plans}


def memory_in_child(args: argparse.Namespace, started: float) -> dict[str, Any]:
    """Run the memory phase in a fresh process (malloc tuned from its start) and read its JSON.

    The child gets the parent's ``--quick``, ``--device``, ``--threads``, ``--only``,
    ``--methods`` and ``--no-compile``; its JSON maps each workload's key to
    :func:`measure_memory`'s output, with the compiled methods' under ``"compiled"``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "memory.json"
        command = ["--memory-json", str(target)]
        command += ["--quick"] if args.quick else []
        for flag in ("device", "threads", "only", "methods"):
            if getattr(args, flag):
                command += [f"--{flag}", str(getattr(args, flag))]
        command += ["--no-compile"] if args.no_compile else []
        log("memory: measuring in a child process", started)
        in_fresh_process(ENTRY_POINT, command)
        return json.loads(target.read_text())


def record_memory(row: Row, reading: dict[str, Any], device: torch.device) -> None:
    """Fill ``row``'s memory fields from the child's ``reading`` of its method (if it has one).

    On the CPU a compressed method's retained is ``max(RSS delta, packed bytes)``: RSS misses
    the small heap blocks (per-group scales) that glibc serves from pages already resident. On
    CUDA ``memory_allocated`` counts the packed bytes already. The peak is at least the retained.
    """
    if "retained" not in reading:
        return
    bench = row.bench
    bench.meter_retained = reading["retained"]
    bench.packed = reading["packed"]
    cpu = device.type == "cpu"
    row.retained = max(bench.meter_retained, bench.packed) if cpu else bench.meter_retained
    row.peak = max(reading["peak"], row.retained)
    bench.compile_seconds = reading.get("first_step")
