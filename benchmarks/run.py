"""memopt side by side with PyTorch's own memory tools: memory, step time, gradient error, loss.

For each workload (``benchmarks/workloads.py``: our GPT, Hugging Face GPT-2, a ResNet-style CNN)
every method of ``benchmarks/methods.py`` patches its own copy of the same initial model, then

1. memory of one training step with :class:`memopt_plugins.profiler.meter.MemoryMeter`, in a fresh
   child process (DESIGN.md: the meter tunes glibc's malloc process-wide, which would slow the
   timed steps) -- retained for backward after the forward and peak over the step, above what
   was held before (gradients are allocated by a warm-up step first), the smallest of a few
   readings taken round-robin; on the CPU a compressed method's retained is
   ``max(RSS delta, packed bytes)`` because RSS misses the small heap blocks (per-group scales)
   that glibc serves from pages already resident;
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

A method that raises is reported as failed, with its error, and the others carry on. Writes
``results.md`` (tables; each says which device produced it), ``results.json`` and ``pareto.png``
to ``--out``. On a CUDA machine everything runs on the GPU (memory from ``memory_allocated`` /
``max_memory_allocated``). Timings are reported, never asserted.

    python benchmarks/run.py [--quick] [--out DIR] [--device cpu|cuda] [--threads N]
                             [--only gpt,hf-gpt2,cnn]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # before transformers is imported
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for folder in (ROOT, HERE):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from methods import BASELINE, LOSS_BARS, METHODS, Method, Patched  # noqa: E402
from report import NOISE, write_plot, write_results  # noqa: E402
from workloads import (  # noqa: E402
    FULL,
    QUICK,
    Sizes,
    Workload,
    evaluate,
    precise_batchnorm,
    workloads,
)

from memopt_plugins.profiler.meter import MemoryMeter  # noqa: E402

#: What the memory child process sets before Python starts (DESIGN.md "Measuring memory").
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4096", "MALLOC_TRIM_THRESHOLD_": "0"}


@dataclass(frozen=True)
class Settings:
    """How much of each measurement to take."""

    sizes: Sizes
    memory_repeats: int
    warmup_steps: int
    timed_rounds: int


FULL_SETTINGS = Settings(FULL, memory_repeats=2, warmup_steps=2, timed_rounds=20)
QUICK_SETTINGS = Settings(QUICK, memory_repeats=1, warmup_steps=1, timed_rounds=3)


@dataclass
class Paired:
    """A method's held-out loss against the baseline's on the same seeds.

    ``change``: mean over seeds of ``loss / baseline's loss - 1``; ``ci``: half-width of its 95%
    confidence interval (Student's t over the seeds); ``worse``: seeds on which the method's
    loss is higher; ``seeds``: how many seeds were compared.
    """

    change: float
    ci: float
    worse: int
    seeds: int

    @classmethod
    def of(cls, pairs: list[tuple[float, float]]) -> Paired:
        """From ``(loss, baseline's loss)`` per seed (at least two seeds)."""
        from scipy.stats import t  # scikit-learn's dependency, there with the digits data

        changes = [loss / base - 1 for loss, base in pairs]
        n = len(changes)
        ci = t.ppf(0.975, n - 1) * statistics.stdev(changes) / math.sqrt(n)
        return cls(statistics.fmean(changes), float(ci), sum(c > 0 for c in changes), n)


@dataclass
class Row:
    """Everything measured for one method on one workload (bytes, seconds, plain numbers)."""

    method: str
    family: str
    detail: str = "-"
    retained: int = 0
    meter_retained: int = 0
    peak: int = 0
    packed: int = 0
    step_seconds: float = 0.0
    grad_error: float = 0.0
    val_loss: float | None = None  # mean over the training seeds
    val_spread: float | None = None  # half the range over the seeds (None for one seed)
    accuracy: float | None = None
    train_loss: float | None = None
    train_seconds: float | None = None
    paired: Paired | None = None  # final loss against the baseline's, seed by seed
    short_loss: float | None = None  # held-out loss after the short schedule, mean over seeds
    short_paired: Paired | None = None  # the same comparison on the short schedule
    training: str = "-"
    error: str | None = None


@dataclass
class WorkloadResult:
    """One workload's rows and how they were made."""

    key: str
    label: str
    title: str
    data: str
    device: str
    measure_shape: str
    rows: list[Row] = field(default_factory=list)
    train_steps: int = 0
    train_shape: str = ""
    lr: float = 0.0
    seeds: int = 0
    short_steps: int | None = None
    short_seeds: int = 0
    bar_seeds: int = 0
    precise_bn: bool = False  # BatchNorm statistics re-estimated before the held-out loss


# --------------------------------------------------------------------------- helpers
def describe_device(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H200)`` or ``cpu (2 threads, x86_64)``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    threads = torch.get_num_threads()
    return f"cpu ({threads} thread{'' if threads == 1 else 's'}, {platform.machine()})"


def shape_of(batch: Any) -> str:
    first = batch if isinstance(batch, torch.Tensor) else batch[0]
    return "x".join(str(s) for s in first.shape)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def failure(exc: BaseException) -> str:
    """``Type: first line of the message`` (shortened), for a table cell."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:160]


def rel_error(grads: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> float:
    """``|g - g_exact|_2 / |g_exact|_2`` over all parameters together."""
    num = sum(float(((grads[k] - v).double() ** 2).sum()) for k, v in exact.items())
    den = sum(float((v.double() ** 2).sum()) for v in exact.values())
    return (num / den) ** 0.5


def calibrate_batchnorm(model: nn.Module, workload: Workload, passes: int = 30) -> None:
    """Bring BatchNorm running statistics to the measurement batch's (train-mode, no-grad passes).

    Only the measured copies get this: a running-statistics mode (the conv-net preset) then
    normalizes as it would mid-training, where running and batch statistics are close, instead
    of with the fresh ``mean 0, var 1``. Batch-statistics BatchNorm ignores running statistics
    in training, so no other method's measurement changes.
    """
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return
    with torch.no_grad():
        for _ in range(passes):
            workload.loss_fn(model, workload.measure)


def log(message: str, started: float) -> None:
    print(f"[{time.perf_counter() - started:6.0f} s] {message}", file=sys.stderr, flush=True)


class Measured:
    """The methods of one workload, each on its own copy of the same (calibrated) model.

    ``each(fn)`` calls ``fn(index, patched)`` for every method still standing; one that raises
    is recorded in ``errors`` and left out from then on. ``plans``: ``{method: recomputed fqns}``
    for the planner methods to adopt instead of planning again (the planner times modules, so
    two plans of the same model can differ: memory and time must come from the same one).
    """

    def __init__(
        self,
        workload: Workload,
        methods: list[Method],
        device: torch.device,
        plans: dict[str, list[str]] | None = None,
    ):
        base = workload.build().to(device).train()
        calibrate_batchnorm(base, workload)
        self.patched: list[Patched | None] = []
        self.errors: dict[int, str] = {}
        for i, method in enumerate(methods):
            try:
                model = copy.deepcopy(base)
                adopt = (plans or {}).get(method.name)
                patched = method.apply(model, workload, workload.measure, True, adopt)
                self.patched.append(patched)
            except Exception as exc:  # a failing method is a result, not the end of the run
                self.patched.append(None)
                self.errors[i] = failure(exc)

    def each(self, fn: Callable[[int, Patched], None]) -> None:
        for i, p in enumerate(self.patched):
            if p is None:
                continue
            try:
                fn(i, p)
            except Exception as exc:
                self.errors[i] = failure(exc)
                self.patched[i] = None

    def close(self) -> None:
        for p in self.patched:
            if p is not None and p.optimizer is not None:
                p.optimizer.remove()
        self.patched = []


# --------------------------------------------------------------------------- memory (child)
def measure_memory(
    workload: Workload, methods: list[Method], device: torch.device, repeats: int
) -> dict[str, Any]:
    """``{"memory": {method: {retained, peak, packed} | {error}}, "plans": {method: fqns}}``.

    Each reading is the smallest-retained of ``repeats``, taken round-robin over the methods
    after one step of each that allocates the gradients (so the readings cover activations).
    ``plans`` are the recompute planners' choices, for the parent to adopt.
    """
    measured = Measured(workload, methods, device)
    meter = MemoryMeter(device)

    def warm_up(i: int, p: Patched) -> None:
        p.loss(workload.loss_fn, workload.measure).backward()

    measured.each(warm_up)
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
        if p.plan is not None:
            plans[method.name] = p.plan
    measured.close()
    return {"memory": memory, "plans": plans}


def memory_in_child(args: argparse.Namespace, started: float) -> dict[str, Any]:
    """Run the memory phase in a fresh process (malloc tuned from its start) and read its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "memory.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--memory-json", str(target)]
        command += ["--quick"] if args.quick else []
        for flag in ("device", "threads", "only", "methods"):
            if getattr(args, flag):
                command += [f"--{flag}", str(getattr(args, flag))]
        log("memory: measuring in a child process", started)
        subprocess.run(command, check=True, env={**os.environ, **MALLOC_ENV})
        return json.loads(target.read_text())


# --------------------------------------------------------------------------- timing, gradients
def gradients(patched: Patched, workload: Workload, seed: int = 0) -> dict[str, torch.Tensor]:
    """Parameter gradients of one step on the measurement batch, under RNG seed ``seed``."""
    model = patched.model
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # every device's default generator
    patched.loss(workload.loss_fn, workload.measure).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def time_steps(
    measured: Measured, workload: Workload, settings: Settings, device: torch.device
) -> dict[int, float]:
    """Median forward + backward seconds of each method, round-robin with a rotating order."""

    def step(i: int, p: Patched) -> None:
        p.model.zero_grad(set_to_none=True)
        p.loss(workload.loss_fn, workload.measure).backward()

    for _ in range(settings.warmup_steps):
        measured.each(step)
    times: dict[int, list[float]] = {i: [] for i in range(len(measured.patched))}
    n = len(measured.patched)
    for r in range(settings.timed_rounds):
        for i in [(r + k) % n for k in range(n)]:
            p = measured.patched[i]
            if p is None:
                continue
            try:
                sync(device)
                start = time.perf_counter()
                step(i, p)
                sync(device)
                times[i].append(time.perf_counter() - start)
            except Exception as exc:
                measured.errors[i] = failure(exc)
                measured.patched[i] = None
    return {i: statistics.median(t) for i, t in times.items() if t and i not in measured.errors}


# --------------------------------------------------------------------------- convergence
def lr_factor(steps: int, warmup: int = 10, floor: float = 0.1) -> Callable[[int], float]:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``floor`` at ``steps``.

    The decay lets the final loss settle, so that runs compare on where they end up rather than
    on the noise of their last steps.
    """

    def factor(step: int) -> float:
        ramp = min(1.0, (step + 1) / warmup)
        cosine = 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))
        return ramp * (floor + (1 - floor) * cosine)

    return factor


@dataclass
class TrainingRun:
    """One method's training run, advanced a step at a time by :func:`train_interleaved`."""

    row: Row
    patched: Patched
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    batches: list[Any]
    rng: tuple[torch.Tensor, torch.Tensor | None]
    seed: int
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None


def train_interleaved(runs: list[TrainingRun], workload: Workload, device: torch.device) -> None:
    """Train every run on its batches, one step each in turn (rotating order).

    Each run keeps its own RNG state (swapped in around its step), so it draws exactly the
    dropout masks a standalone run seeded the same way would. A run that raises stops there.
    """
    steps = len(runs[0].batches)
    for step in range(steps):
        for k in range(len(runs)):
            run = runs[(step + k) % len(runs)]
            if run.error is not None:
                continue
            batch = run.batches[step]
            set_rng_state(run.rng, device)
            try:
                sync(device)
                start = time.perf_counter()
                loss = run.patched.loss(workload.loss_fn, batch)
                loss.backward()
                run.patched.after_backward(workload.loss_fn, batch, step)
                run.optimizer.step()
                run.schedule.step()
                run.optimizer.zero_grad(set_to_none=True)
                run.patched.after_step()
                run.losses.append(float(loss))
                run.seconds += time.perf_counter() - start
            except Exception as exc:
                run.error = f"step {step}: {failure(exc)}"
            run.rng = rng_state(device)


def train(
    workload: Workload,
    methods: list[Method],
    rows: list[Row],
    result: WorkloadResult,
    device: torch.device,
) -> None:
    """Convergence runs of every method on ``workload.seeds``, plus the baseline on as many other
    seeds (the run-to-run spread); fills ``rows`` with the means over seeds."""
    seeds = list(workload.seeds)
    others = [s + len(seeds) for s in seeds]
    pristine = workload.build().to(device).train()
    baseline = next(m for m in methods if m.name == BASELINE)
    noise_row = Row(NOISE, baseline.family, f"seeds {others}: other data order, dropout masks")
    plan = [(m, r, seeds) for m, r in zip(methods, rows, strict=True) if r.error is None]
    plan.append((baseline, noise_row, others))
    runs = start_runs(plan, workload, pristine, device)
    train_interleaved(runs, workload, device)
    losses = final_losses(runs, workload)
    for row, pairs in paired_losses(runs, losses):
        row.paired = Paired.of(pairs) if len(pairs) > 1 else None
    for row in [r for _, r, _ in plan]:
        summarize_runs(row, [run for run in runs if run.row is row], losses)
    if workload.short_steps is not None:
        judged = (BASELINE, *LOSS_BARS)  # more seeds: their 1% bar needs a ~1% interval
        short_plan = [
            (m, row, list(workload.bar_seeds if m.name in judged else workload.short_seeds))
            for m, row, _ in plan[:-1]
        ]
        short = start_runs(short_plan, workload, pristine, device, workload.short_steps)
        train_interleaved(short, workload, device)
        losses = final_losses(short, workload)
        for row, pairs in paired_losses(short, losses):
            row.short_loss = statistics.fmean(loss for loss, _ in pairs)
            row.short_paired = Paired.of(pairs) if len(pairs) > 1 else None
        unpatch(short)
        result.short_seeds = len(workload.short_seeds)
        result.bar_seeds = len(workload.bar_seeds)
    rows.append(noise_row)
    result.train_steps = len(runs[0].batches)
    result.train_shape = shape_of(runs[0].batches[0])
    result.lr = workload.lr
    result.seeds = len(seeds)
    result.short_steps = workload.short_steps
    result.precise_bn = bool(workload.calibration)


def start_runs(
    plan: list[tuple[Method, Row, list[int]]],
    workload: Workload,
    pristine: nn.Module,
    device: torch.device,
    steps: int | None = None,
) -> list[TrainingRun]:
    """A training run per (method, seed) of ``plan``, each on a copy of ``pristine``, over the
    seed's batches (the first ``steps`` of them, with the schedule fitted to that length)."""
    runs = []
    for method, row, row_seeds in plan:
        for seed in row_seeds:
            data = workload.train_batches(seed)[:steps]
            model = copy.deepcopy(pristine)
            torch.manual_seed(seed)
            try:
                patched = method.apply(model, workload, data[0], False, None)
            except Exception as exc:
                row.training = f"failed: {failure(exc)}"
                break
            adamw = torch.optim.AdamW(model.parameters(), lr=workload.lr, weight_decay=0.01)
            schedule = torch.optim.lr_scheduler.LambdaLR(adamw, lr_factor(len(data)))
            runs.append(TrainingRun(row, patched, adamw, schedule, data, rng_state(device), seed))
    return runs


def final_losses(runs: list[TrainingRun], workload: Workload) -> dict[int, tuple]:
    """``evaluate``'s (held-out loss, accuracy) of every run that finished, by ``id(run)``.

    BatchNorm statistics are re-estimated for the final weights first (:func:`precise_batchnorm`),
    except where the method froze them (memopt's running mode past its warm-up): those statistics
    are part of the function it trained, as ``FrozenBatchNorm2d``'s are.
    """
    losses = {}
    for run in runs:
        if run.error:
            continue
        if not run.patched.batchnorm_frozen:
            precise_batchnorm(run.patched.model, workload)
        losses[id(run)] = evaluate(run.patched.model, workload)
    return losses


def paired_losses(
    runs: list[TrainingRun], losses: dict[int, tuple]
) -> list[tuple[Row, list[tuple[float, float]]]]:
    """Per row, ``(loss, baseline's loss)`` on each seed both finished: the same initial
    weights and batches, so seed-to-seed noise cancels in the comparison."""
    baseline = {run.seed: losses.get(id(run)) for run in runs if run.row.method == BASELINE}
    rows: dict[int, tuple[Row, list]] = {}
    for run in runs:
        base = baseline.get(run.seed)
        if id(run) in losses and base is not None:
            rows.setdefault(id(run.row), (run.row, []))[1].append((losses[id(run)][0], base[0]))
    return list(rows.values())


def unpatch(runs: list[TrainingRun]) -> None:
    """Remove the memopt patches of finished runs."""
    for run in runs:
        if run.patched.optimizer is not None:
            run.patched.optimizer.remove()


def summarize_runs(row: Row, runs: list[TrainingRun], losses: dict[int, tuple]) -> None:
    """Means over the seeds of one method (loss, accuracy, speed) from its runs and their
    :func:`final_losses`; any failure fails the row."""
    errors = [run.error for run in runs if run.error is not None]
    if errors:
        row.training = f"failed at {errors[0]}"
        row.paired = None
    elif runs and not row.training.startswith("failed"):
        tail = max(1, len(runs[0].losses) // 10)
        finals = [losses[id(run)] for run in runs]
        held_out = [loss for loss, _ in finals]
        row.val_loss = statistics.fmean(held_out)
        row.val_spread = (max(held_out) - min(held_out)) / 2 if len(held_out) > 1 else None
        row.accuracy = None if finals[0][1] is None else statistics.fmean(a for _, a in finals)
        row.train_loss = statistics.fmean(sum(run.losses[-tail:]) / tail for run in runs)
        row.train_seconds = sum(run.seconds for run in runs) / sum(len(r.losses) for r in runs)
        row.training = runs[0].patched.training_summary()  # the first seed's
    unpatch(runs)


# --------------------------------------------------------------------------- one workload
def bench_workload(
    workload: Workload,
    methods: list[Method],
    child: dict[str, Any],
    settings: Settings,
    device: torch.device,
    started: float,
) -> WorkloadResult:
    """Gradient error, step time and convergence of every method; memory (and the recompute
    plans, adopted here) from the child process's ``child`` output."""
    memory = child["memory"]
    result = WorkloadResult(
        key=workload.key,
        label=workload.label,
        title=workload.title,
        data=workload.data,
        device=describe_device(device),
        measure_shape=shape_of(workload.measure),
    )
    log(f"{workload.key}: patching {len(methods)} copies", started)
    measured = Measured(workload, methods, device, child["plans"])
    rows = [Row(m.name, m.family) for m in methods]
    for row, p in zip(rows, measured.patched, strict=True):
        row.detail = p.detail if p is not None else "-"

    log(f"{workload.key}: gradient error", started)
    exact = gradients(measured.patched[0], workload)

    def grad_error(i: int, p: Patched) -> None:
        rows[i].grad_error = rel_error(gradients(p, workload), exact)

    measured.each(grad_error)
    log(f"{workload.key}: step time ({settings.timed_rounds} rounds)", started)
    for i, seconds in time_steps(measured, workload, settings, device).items():
        rows[i].step_seconds = seconds
    measured.close()

    for i, row in enumerate(rows):
        reading = memory.get(row.method, {"error": "not measured"})
        row.error = measured.errors.get(i) or reading.get("error")
        if "retained" in reading:
            row.meter_retained = reading["retained"]
            row.packed = reading["packed"]
            # CPU: RSS misses small heap blocks; CUDA: memory_allocated counts packed bytes too
            cpu = device.type == "cpu"
            row.retained = max(row.meter_retained, row.packed) if cpu else row.meter_retained
            row.peak = max(reading["peak"], row.retained)

    if workload.train_batches is not None:
        log(f"{workload.key}: training", started)
        train(workload, methods, rows, result, device)
    result.rows = rows
    log(f"{workload.key}: done", started)
    return result


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one thread: a smoke run")
    parser.add_argument("--out", type=Path, default=HERE, help="folder for the results")
    parser.add_argument("--device", help="cpu or cuda[:i] (default: cuda when available)")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's; --quick: 1)")
    parser.add_argument("--only", help="comma-separated workload keys: gpt,hf-gpt2,cnn")
    parser.add_argument("--train-steps", type=int, help="training steps (default: the size's)")
    parser.add_argument(
        "--methods", help="comma-separated method names to run (the baseline always runs)"
    )
    parser.add_argument("--memory-json", type=Path, help=argparse.SUPPRESS)  # the child's output
    args = parser.parse_args(argv)
    if args.quick and not args.threads:
        args.threads = 1
    return args


def select_workloads(args: argparse.Namespace, sizes: Sizes) -> list[Workload]:
    selected = workloads(sizes)
    if not args.only:
        return selected
    keys = args.only.split(",")
    unknown = sorted(set(keys) - {w.key for w in selected})
    if unknown:
        raise SystemExit(f"--only: unknown workloads {unknown}; known: {[w.key for w in selected]}")
    return [w for w in selected if w.key in keys]


def select_methods(args: argparse.Namespace) -> list[Method]:
    if not args.methods:
        return METHODS
    names = {n.strip() for n in args.methods.split(",")}
    unknown = sorted(names - {m.name for m in METHODS})
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; known: {[m.name for m in METHODS]}")
    return [m for m in METHODS if m.name in names or m.name == BASELINE]


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
        sizes = replace(settings.sizes, gpt_steps=args.train_steps, cnn_steps=args.train_steps)
        settings = replace(settings, sizes=sizes)
    selected = [w.to(device) for w in select_workloads(args, settings.sizes)]
    methods = select_methods(args)

    if args.memory_json is not None:  # the child: memory only
        gc.freeze()  # the meter collects garbage around every reading: skip the imported objects
        memory = {
            w.key: measure_memory(w, methods, device, settings.memory_repeats) for w in selected
        }
        args.memory_json.write_text(json.dumps(memory))
        return None

    memory = memory_in_child(args, started)
    results = [
        bench_workload(w, methods, memory[w.key], settings, device, started) for w in selected
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
    payload = {"meta": meta, "workloads": [asdict(r) for r in results]}
    (args.out / "results.json").write_text(json.dumps(payload, indent=1) + "\n")
    log(f"wrote {path}, pareto.png, results.json in {elapsed:.0f} s", started)
    return path


if __name__ == "__main__":
    main()
