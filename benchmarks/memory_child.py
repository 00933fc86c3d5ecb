"""The memory phase, run in a child process of its own (``run.py --memory-json PATH``).

:class:`memopt_plugins.profiler.meter.MemoryMeter` tunes glibc's malloc process-wide, which would
slow the timed steps, so the parent (:func:`memory_in_child`) spawns a fresh interpreter with
malloc set from its start (:data:`MALLOC_ENV`, DESIGN.md "Measuring memory"); the child measures
every method (:func:`measure_memory`) and writes JSON, which the parent folds into its rows
(:func:`record_memory`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from harness import Measured, log
from methods import Method, Patched
from records import Row
from workloads import Workload

from memopt_plugins.profiler.meter import MemoryMeter

#: What the memory child process sets before Python starts (DESIGN.md "Measuring memory").
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4096", "MALLOC_TRIM_THRESHOLD_": "0"}
#: The script the child runs: the benchmark's entry point, with ``--memory-json``.
ENTRY_POINT = Path(__file__).resolve().with_name("run.py")


def one_step(measured: Measured, workload: Workload) -> dict[int, float]:
    """One step of every method, which allocates the gradients; no first-step times."""

    def step(i: int, p: Patched) -> None:
        p.loss(workload.loss_fn, workload.measure).backward()

    measured.each(step)
    return {}


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
    measured = Measured(workload, methods, device)
    meter = MemoryMeter(device)
    first = warm_up(measured, workload)
    best: dict[int, Any] = {}

    def read(i: int, p: Patched) -> None:
        reading = meter.measure(lambda: p.loss(workload.loss_fn, workload.measure), p.stats)
        if i not in best or reading.retained < best[i].retained:
            best[i] = reading

    for _ in range(repeats):
        measured.each(read)
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
        command = [sys.executable, str(ENTRY_POINT), "--memory-json", str(target)]
        command += ["--quick"] if args.quick else []
        for flag in ("device", "threads", "only", "methods"):
            if getattr(args, flag):
                command += [f"--{flag}", str(getattr(args, flag))]
        command += ["--no-compile"] if args.no_compile else []
        log("memory: measuring in a child process", started)
        subprocess.run(command, check=True, env={**os.environ, **MALLOC_ENV})
        return json.loads(target.read_text())


def record_memory(row: Row, reading: dict[str, Any], device: torch.device) -> None:
    """Fill ``row``'s memory fields from the child's ``reading`` of its method (if it has one).

    On the CPU a compressed method's retained is ``max(RSS delta, packed bytes)``: RSS misses
    the small heap blocks (per-group scales) that glibc serves from pages already resident. On
    CUDA ``memory_allocated`` counts the packed bytes already. The peak is at least the retained.
    """
    if "retained" not in reading:
        return
    row.meter_retained = reading["retained"]
    row.packed = reading["packed"]
    cpu = device.type == "cpu"
    row.retained = max(row.meter_retained, row.packed) if cpu else row.meter_retained
    row.peak = max(reading["peak"], row.retained)
    row.compile_seconds = reading.get("first_step")
