"""The benchmark's outputs: ``results.md`` (tables) and ``pareto.png`` (memory vs step time).

Works on the rows ``run.py`` measured (duck-typed: ``WorkloadResult`` with ``Row`` items), so the
two files always come from the same numbers. ``python benchmarks/report.py [results.json]``
redraws ``pareto.png`` beside a ``results.json`` from its rows (after a change to the plot's look,
without rerunning the bench); ``--compiled-from`` puts in the compiled rows of a later run.
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from methods import (
    BASELINE,
    C_BASELINE,
    C_BUDGET_03,
    C_EAGER,
    C_INT8,
    C_PLANNER_05,
    CHECKPOINT,
    DRIFT_NOISE,
    DRIFT_REL_L2,
    INT2,
    INT4_DRIFT,
    INT8,
    LOSS_BARS,
    MEMOPT,
    PLANNER_05,
)

from memopt_plugins.profiler import style

MIB = 1 << 20
NOISE = "baseline, other seeds"
#: Columns of each workload's memory / time / gradient table.
MEASURE_COLUMNS = [
    "method",
    "what it does",
    "retained MiB",
    "retained vs baseline",
    "peak MiB",
    "peak vs baseline",
    "packed MiB",
    "step ms",
    "step vs baseline",
    "grad rel. error",
]
#: Columns of the compiled methods' tables: ratios to the compiled baseline.
COMPILED_COLUMNS = [
    "method",
    "what it does",
    "retained MiB",
    "retained vs compiled baseline",
    "peak MiB",
    "peak vs compiled baseline",
    "packed MiB",
    "step ms",
    "step vs compiled baseline",
    "grad rel. error vs compiled baseline",
    "first step s (compiles)",
    "loss",
]
#: The compiled section's heading (also the bars' link to it).
COMPILED_HEADING = "Compiled (inductor): whole-model model.compile()"
OTHER_BENCHMARKS = (
    ("recompute.md", "selective recompute: the planner against checkpointing every block"),
    ("batchnorm.md", "running-statistics BatchNorm on the digits"),
)


# --------------------------------------------------------------------------- numbers
def _row(result: Any, name: str) -> Any | None:
    return next((r for r in result.rows if r.method == name), None)


def memory_ratio(result: Any, row: Any) -> float | None:
    """Retained memory as a ratio to the baseline's (``None`` when either failed)."""
    base = _row(result, BASELINE)
    if row is None or row.error or base.error or not base.retained:
        return None
    return row.retained / base.retained


def time_ratio(result: Any, row: Any) -> float | None:
    """Median step time as a ratio to the baseline's (``None`` when either failed)."""
    base = _row(result, BASELINE)
    if row is None or row.error or base.error or not base.step_seconds:
        return None
    return row.step_seconds / base.step_seconds


def compiled_ratio(result: Any, row: Any, attr: str) -> float | None:
    """``row.<attr>`` (``retained``, ``peak``, ``step_seconds``) of a compiled method as a ratio
    to the compiled baseline's (``None`` when either failed or is missing)."""
    base = next((r for r in result.compiled if r.method == C_BASELINE), None)
    if row is None or base is None or row.error or base.error or not getattr(base, attr):
        return None
    return getattr(row, attr) / getattr(base, attr)


def verdict(ok: bool) -> str:
    """A bar's verdict."""
    return "met" if ok else "**not met**"


def loss_change(result: Any, row: Any) -> float | None:
    """Relative change of the held-out loss against the baseline's (0.01 = 1% higher)."""
    base = _row(result, BASELINE)
    if row is None or row.val_loss is None or base.val_loss is None:
        return None
    return row.val_loss / base.val_loss - 1


def _paired(paired: Any) -> str:
    """``+0.3% ± 1.2% (4/10 higher)``: a paired comparison with the baseline, or ``-``."""
    if paired is None:
        return "-"
    return f"{paired.change:+.1%} ± {paired.ci:.1%} ({paired.worse}/{paired.seeds} higher)"


def loss_verdict(change: float | None, paired: Any = None) -> str:
    """The verdict on "at most 1% above the baseline's loss".

    With a paired comparison over seeds: met when its whole 95% interval lies at or below +1%,
    not met when it lies above, and unresolved when it spans +1% (the measurement is too noisy
    to tell). Without one (a single seed): the point estimate decides.
    """
    if paired is not None:
        if paired.change + paired.ci <= 0.01:
            return "met"
        if paired.change - paired.ci > 0.01:
            return "**not met**"
        return "unresolved: the 95% interval spans +1%"
    return "met" if change is not None and change <= 0.01 else "**not met**"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _ratio(x: float | None) -> str:
    return "failed" if x is None else f"{x:.2f}x"


def _err(row: Any) -> str:
    x = row.grad_error
    if row.error:
        return "failed"
    return "0" if x == 0 else (f"{x:.1e}" if x < 1e-3 else f"{x:.3f}")


def _table(header: Sequence[str], align: str, rows: list[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


# --------------------------------------------------------------------------- markdown
def headline(results: Sequence[Any]) -> list[str]:
    """One row per method: memory and time ratios per model, GPT gradient error, loss changes."""
    header = ["method"]
    for res in results:
        header += [f"{res.label} memory", f"{res.label} time"]
    grad_from = results[0]
    header.append(f"grad error ({grad_from.label})")
    trained = [res for res in results if res.train_steps]
    header += [f"{res.label} loss vs baseline" for res in trained]
    rows = []
    for row in results[0].rows:
        if row.method == NOISE:
            continue
        cells = [row.method]
        for res in results:
            r = _row(res, row.method)
            cells += [_ratio(memory_ratio(res, r)), _ratio(time_ratio(res, r))]
        cells.append(_err(row))
        cells += [_pct(loss_change(res, _row(res, row.method))) for res in trained]
        rows.append(cells)
    if trained:
        cells = [f"*{NOISE} (for scale)*"] + ["", ""] * len(results) + [""]
        cells += [_pct(loss_change(res, _row(res, NOISE))) for res in trained]
        rows.append(cells)
    align = ["---"] + ["--:"] * (len(header) - 1)
    return _table(header, align, rows)


def bars(results: Sequence[Any]) -> list[str]:
    """The bars of the benchmark issue, each with the measured figures and a verdict.

    A bar whose methods were not run (``--methods``) is left out.
    """

    def ran(*names: str) -> bool:
        return all(_row(res, n) is not None for res in results for n in names)

    lines = []
    if ran(INT8):
        times = [(res.label, time_ratio(res, _row(res, INT8))) for res in results]
        worst = max(float("inf") if t is None else t for _, t in times)
        lines.append(
            "- int8 step time <= 1.25x baseline (target 1.15x): "
            + ", ".join(f"{label} {_ratio(t)}" for label, t in times)
            + f" -- {verdict(worst <= 1.25)}"
            + ("" if worst > 1.25 else f", target {verdict(worst <= 1.15)}")
        )
    if ran(PLANNER_05, CHECKPOINT):
        pairs = [(res.label, _row(res, PLANNER_05), _row(res, CHECKPOINT)) for res in results]
        lines.append(
            "- planner at budget 0.5 faster than checkpointing every block: "
            + ", ".join(
                f"{label} {p.step_seconds * 1e3:.0f} ms vs {c.step_seconds * 1e3:.0f} ms"
                for label, p, c in pairs
            )
            + " -- "
            + verdict(all(not p.error and p.step_seconds < c.step_seconds for _, p, c in pairs))
        )
    trained = [res for res in results if res.train_steps]
    for name, bar in (
        (INT8, f"- {INT8} final loss within 1% of the baseline's (at most 1% above it)"),
        (
            INT4_DRIFT,
            f"- {INT4_DRIFT} final loss within 1% of the baseline's (at most 1% above it)",
        ),
        (
            DRIFT_NOISE,
            f"- {DRIFT_NOISE} (drift.metric noise at 0.05) final loss within 1% of the "
            "baseline's (at most 1% above it)",
        ),
        (INT2, f"- {INT2} (no drift check), reported as measured"),
        (NOISE, "- for scale, the baseline trained on other seeds"),
    ):
        if not trained or any(_row(res, name) is None for res in trained):
            continue
        changes = [(res.label, loss_change(res, _row(res, name))) for res in trained]
        if name not in LOSS_BARS:
            lines.append(f"{bar}: " + ", ".join(f"{label} {_pct(c)}" for label, c in changes))
        else:
            lines.append(f"{bar}:")
            for res in trained:
                row = _row(res, name)
                change = loss_change(res, row)
                paired = getattr(row, "paired", None)
                measured = _paired(paired) if paired is not None else _pct(change)
                lines.append(
                    f"  - {res.label}, {res.train_steps} steps: {measured} "
                    f"-- {loss_verdict(change, paired)}"
                )
                short = getattr(row, "short_paired", None)
                if getattr(res, "short_steps", None) and short is not None:
                    lines.append(
                        f"  - {res.label}, {res.short_steps}-step run: {_paired(short)} "
                        f"-- {loss_verdict(None, short)}"
                    )
        if name == NOISE:
            noisy = [(label, c) for label, c in changes if c is not None and abs(c) > 0.01]
            if noisy:
                lines.append(
                    "- where the baseline's own run-to-run spread exceeds 1% ("
                    + ", ".join(f"{label} {_pct(c)}" for label, c in noisy)
                    + "), a loss difference smaller than that spread is within noise"
                )
    lines += _metric_bits_bar(trained)
    return lines


def _metric_bits_bar(trained: list[Any]) -> list[str]:
    """The drift issue's bar: the noise metric settles at lower mean bits than rel_l2."""
    pairs = [(res, _row(res, DRIFT_NOISE), _row(res, DRIFT_REL_L2)) for res in trained]
    pairs = [(res, n, r) for res, n, r in pairs if n is not None and r is not None]
    if not pairs:
        return []
    known = all(n.mean_bits is not None and r.mean_bits is not None for _, n, r in pairs)
    return [
        "- drift.metric noise settles at lower mean bits than rel_l2 (compressed modules after "
        "training, mean over seeds): "
        + ", ".join(
            f"{res.label} {n.mean_bits or 0:.1f} vs {r.mean_bits or 0:.1f} bits"
            for res, n, r in pairs
        )
        + f" -- {verdict(known and all(n.mean_bits < r.mean_bits for _, n, r in pairs))}"
    ]


def workload_section(res: Any) -> list[str]:
    """The memory/time/gradient table of one workload, and its convergence table."""
    lines = [
        f"## {res.title}",
        "",
        f"Device: **{res.device}**. Measurement batch {res.measure_shape}; data: {res.data}.",
        "",
    ]
    header = MEASURE_COLUMNS
    base = _row(res, BASELINE)
    rows = []
    failures = []
    for r in res.rows:
        if r.method == NOISE:
            continue
        if r.error:
            failures.append(f"- {r.method}: `{r.error}`")
            rows.append([r.method, r.detail] + ["failed"] * 8)
            continue
        rows.append(
            [
                r.method,
                r.detail,
                f"{r.retained / MIB:.2f}",
                _ratio(memory_ratio(res, r)),
                f"{r.peak / MIB:.2f}",
                f"{r.peak / base.peak:.2f}x" if base.peak else "-",
                f"{r.packed / MIB:.2f}" if r.packed else "-",
                f"{r.step_seconds * 1e3:.1f}",
                _ratio(time_ratio(res, r)),
                _err(r),
            ]
        )
    lines += _table(header, ["---", "---"] + ["--:"] * 8, rows)
    if failures:
        lines += ["", "Failed (the error each raised):", "", *failures]
    if not res.train_steps:
        return lines
    lines += [
        "",
        f"### Convergence: {res.train_steps} AdamW steps, batches of {res.train_shape}",
        "",
        f"Device: **{res.device}**. AdamW (lr {res.lr:g}, weight decay 0.01, 10 warm-up "
        "steps, cosine decay to 10%), every method from the same initial weights on the same "
        "batches. Held-out loss after the last step (eval mode"
        + (
            "; BatchNorm statistics re-estimated for the final weights, see below"
            if getattr(res, "precise_bn", False)
            else ""
        )
        + ")"
        + (
            f", mean of {res.seeds} seeds (data order, dropout masks) ± half their range; "
            "*paired*: the loss against the baseline's on the same seed (same weights and "
            "batches, so seed-to-seed noise cancels), the mean change ± its 95% confidence "
            "interval and the seeds on which it is higher"
            if res.seeds > 1
            else ""
        )
        + (
            f"; {res.short_steps}-step run: every method trained again on a {res.short_steps}"
            "-step schedule (the first batches, warm-up and decay fitted to it) on "
            f"{res.short_seeds} seeds ({getattr(res, 'bar_seeds', 0) or res.short_seeds} for the "
            "baseline and the methods with a loss bar), paired the same way"
            if getattr(res, "short_steps", None)
            else ""
        )
        + "; train loss: mean of the last 10% of steps; s/step: the whole training step "
        "(optimizer and drift checks included), as a ratio to the baseline's, from runs "
        f"interleaved step by step. *{NOISE}*: the baseline on as many other seeds, for the "
        "run-to-run spread.",
        "",
    ]
    header = ["method", "held-out loss", "vs baseline"]
    if base.accuracy is not None:
        header.append("accuracy")
    if res.seeds > 1:
        header.append("paired")
    short = getattr(res, "short_steps", None)
    if short:
        header.append(f"{short}-step run, paired")
    header += ["train loss", "s/step vs baseline", "drift checks / bits at the end"]
    rows = []
    for r in res.rows:
        if r.val_loss is None:
            cells = [r.method, "failed", "-"] + ["-"] * (len(header) - 4) + [r.training]
            rows.append(cells)
            continue
        spread = f" ± {r.val_spread:.4f}" if r.val_spread is not None else ""
        cells = [r.method, f"{r.val_loss:.4f}{spread}", _pct(loss_change(res, r))]
        if base.accuracy is not None:
            cells.append(f"{r.accuracy:.1%}")
        if res.seeds > 1:
            cells.append(_paired(r.paired))
        if short:
            cells.append(_paired(r.short_paired))
        speed = f"{r.train_seconds / base.train_seconds:.2f}x" if base.train_seconds else "-"
        cells += [f"{r.train_loss:.4f}", speed, r.training]
        rows.append(cells)
    lines += _table(header, ["---"] + ["--:"] * (len(header) - 2) + ["---"], rows)
    return lines


def _compiled_row(result: Any, name: str) -> Any | None:
    return next((r for r in getattr(result, "compiled", []) if r.method == name), None)


def _where(result: Any, row: Any) -> str:
    """``0.30x retained (peak 0.89x) at 0.97x``: a compiled row against the compiled baseline."""
    return (
        f"{_ratio(compiled_ratio(result, row, 'retained'))} retained "
        f"(peak {_ratio(compiled_ratio(result, row, 'peak'))}) at "
        f"{_ratio(compiled_ratio(result, row, 'step_seconds'))}"
    )


def compiled_bars(results: Sequence[Any]) -> list[str]:
    """The torch.compile issue's bars, each with the measured figures and a verdict; none
    where no workload has compiled rows (``--no-compile``, ``--only cnn``).

    * compiled memopt int8's step time at most 1.15x the compiled baseline's;
    * the compiled planner at budget 0.5 at most 1.3x;
    * some compiled memopt method retains less than ``activation_memory_budget`` 0.3 at a lower
      step time (every memopt method below its retained memory is named, faster or slower).
    """
    compiled = [res for res in results if getattr(res, "compiled", None)]
    if not compiled:
        return []

    def step_bar(name: str, limit: float) -> list[str]:
        if any(_compiled_row(res, name) is None for res in compiled):
            return []
        times = [
            (res.label, compiled_ratio(res, _compiled_row(res, name), "step_seconds"))
            for res in compiled
        ]
        ok = all(t is not None and t <= limit for _, t in times)
        return [
            f"- {name} step time <= {limit:.2f}x the compiled baseline's: "
            + ", ".join(f"{label} {'failed' if t is None else f'{t:.3f}x'}" for label, t in times)
            + f" -- {verdict(ok)}"
        ]

    lines = step_bar(C_INT8, 1.15) + step_bar(C_PLANNER_05, 1.3)
    if all(_compiled_row(res, C_BUDGET_03) is not None for res in compiled):
        parts, ok = [], True
        for res in compiled:
            peer = _compiled_row(res, C_BUDGET_03)
            if peer.error:
                parts.append(f"{res.label}: {C_BUDGET_03} failed")
                ok = False
                continue
            lower = [
                r
                for r in res.compiled
                if r.family == MEMOPT and not r.error and r.retained < peer.retained
            ]
            ok = ok and any(r.step_seconds < peer.step_seconds for r in lower)
            found = ", ".join(
                f"{r.method.removeprefix('compiled memopt ')} {_where(res, r)} "
                + ("(faster)" if r.step_seconds < peer.step_seconds else "(slower)")
                for r in lower
            )
            parts.append(
                f"{res.label}: budget 0.3 {_where(res, peer)}; below it "
                + (found or "no memopt method")
            )
        lines.append(
            f"- compiled memopt below {C_BUDGET_03.removeprefix('compiled ')}'s retained memory "
            "at a lower step time (ratios to the compiled baseline; peak for information): "
            + "; ".join(parts)
            + f" -- {verdict(ok)}"
        )
    return lines


def compiled_section(results: Sequence[Any]) -> list[str]:
    """The compiled methods' tables (one per workload that has them) and their bars."""
    compiled = [res for res in results if getattr(res, "compiled", None)]
    if not compiled:
        return []
    lines = [
        f"## {COMPILED_HEADING}",
        "",
        '<a id="compiled-rows"></a>',
        "",
        "Every method on its own copy of the model, compiled whole with `model.compile()` "
        "(inductor; memopt applied, and its planner planned, before compiling; "
        "`activation_memory_budget` is torch.compile's own knob, set while that copy's graphs are "
        "compiled). Ratios and gradient errors are against the **compiled** baseline, not the "
        "eager one; the methods are measured in a phase of their own (memory in the child "
        "process, then gradient and step time round-robin, after two untimed steps that compile). "
        "The CNN has no compiled rows (to bound the bench's time), and compiled methods are not "
        "trained (loss `-`): see the notes.",
        "",
    ]
    for res in compiled:
        lines += [
            f"### {res.label}, compiled",
            "",
            f"Measured on **{res.device}**, batch {res.measure_shape}.",
            "",
        ]
        rows, failures = [], []
        for r in res.compiled:
            if r.error:
                failures.append(f"- {r.method}: `{r.error}`")
                rows.append([r.method, r.detail] + ["failed"] * 9 + ["-"])
                continue
            first = "-" if r.compile_seconds is None else f"{r.compile_seconds:.1f}"
            rows.append(
                [
                    r.method,
                    r.detail,
                    f"{r.retained / MIB:.2f}",
                    _ratio(compiled_ratio(res, r, "retained")),
                    f"{r.peak / MIB:.2f}",
                    _ratio(compiled_ratio(res, r, "peak")),
                    f"{r.packed / MIB:.2f}" if r.packed else "-",
                    f"{r.step_seconds * 1e3:.1f}",
                    _ratio(compiled_ratio(res, r, "step_seconds")),
                    "- (eager's masks)" if r.method == C_EAGER else _err(r),
                    first,
                    "-",
                ]
            )
        lines += _table(COMPILED_COLUMNS, ["---", "---"] + ["--:"] * 10, rows)
        if failures:
            lines += ["", "Failed (the error each raised):", "", *failures]
        lines.append("")
    lines += ["### The bars of the torch.compile issue", "", *compiled_bars(results)]
    return lines


NOTES = """\
## How it was measured

- **Retained**: bytes held for backward after the forward; **peak**: the most held during
  forward + backward; both above what was held before the step, with the gradients already
  allocated by a warm-up step (`memopt_plugins.profiler.meter.MemoryMeter`; the smallest of a few
  readings, taken round-robin). CUDA: `memory_allocated` / `max_memory_allocated`. CPU: the
  process's RSS with glibc told to serve blocks of 4 KiB and more with mmap and to return freed
  memory at once, peak from the kernel's `VmHWM` reset before each step. RSS misses small heap
  blocks (the per-group scales of compressed tensors come from pages already resident), so on
  the CPU a compressed method's retained is `max(RSS delta, packed bytes)`; **packed** is what
  memopt's saved-tensor hooks hold after the forward. Peak is at least the retained figure.
- **Step time**: forward + backward on the measurement batch, median over the timed rounds
  after a warm-up, methods alternated round-robin (order rotated every round) in one process.
  Timings on a shared machine are noisy; they are reported, never asserted.
- **Gradient error**: `|g - g_exact| / |g_exact|` over all parameters together, one step on
  the measurement batch, against the unpatched model under the same seed (same dropout masks).
  Recompute methods are exact up to float rounding; memopt's rounding is stochastic, so a
  second draw differs a little.
- **Convergence**: every method trains its own copy of the same initial weights on the same
  batches, interleaved step by step, each run with its own RNG stream (a run equals a standalone
  seeded one). The drift check, where the config enables it, runs between backward and the
  optimizer step, on the first `drift.sample_size` samples of the batch.
- **save_on_cpu** on a CPU run: `tensor.cpu()` returns a host tensor as it is, so it frees
  nothing and costs only the hook calls; it is here for the CUDA tables, where it moves saved
  tensors to pinned host memory (host memory is not counted there).
- **PyTorch SAC**: `create_selective_checkpoint_contexts` around every block, saving the outputs
  of `mm`, `addmm`, `bmm`, `baddbmm`, `convolution` and the fused attention kernels; the rest is
  recomputed.
- **BatchNorm at evaluation**: before the held-out loss, every CNN run's BatchNorm statistics
  are re-estimated for its final weights ("precise BN": a cumulative average over 512 training
  images in training-size batches, no grad, the same dropout seed for every run), except where a
  method froze them (the conv-net preset's running mode past its warm-up, where they are part of
  the trained function). The running averages left by training lag the final weights, and
  anything that moves them moves the loss: PyTorch's checkpoint replays BatchNorm in training
  mode, so `checkpoint every block` and SAC update them twice per step (pytorch#96136), which
  read as an 11% lower 40-step loss with gradients equal to the baseline's. Over 60 seeds of the
  40-step run the baseline's loss read 0.33 with the training averages and 0.18 re-estimated,
  and the paired changes of int8 and int4 moved about half as much from seed to seed (2.3-3.0%
  against 3.6-5.4%).
- **Combined presets**: `configs/gpt_int4_auto.yaml` (4 bits + planner at 0.1 + drift, cosine)
  for the transformers, `configs/convnet.yaml` (BatchNorm on running statistics after 100
  warm-up steps, bit-packed dropout masks, 4 bits + drift) for the CNN. The memory, time and
  gradient rows show the CNN preset in its steady state (past the warm-up), with BatchNorm
  running statistics first brought to the measurement batch's by no-grad passes, as they are
  mid-training; its gradient error therefore includes the gradient terms through the batch
  statistics that running-statistics BatchNorm drops by design. Training runs use the presets
  as they are, warm-up included.
- **Planner**: it times modules, so two plans of one model can differ; the plan behind the
  memory rows is made once (in the memory process, on the measurement batch) and adopted for
  the time and gradient rows. Training runs plan on their first batch before the first step.
- **Compiled rows** (the transformers only; the CNN is skipped to bound the bench's time):
  whole-model compile, `model.compile()` with inductor, every method on its own copy; memopt is
  applied (and the planner plans, eagerly, on the measurement batch) before compiling; the
  scope of the model's root, entered outside the graph, holds traceable saved-tensor hooks that
  AOTAutograd inlines, so the graph compresses what it saves and frees the originals inside.
  `int8 + activation_memory_budget 0.3` is both at once: the partitioner picks what the graph
  saves (recomputing the rest), and memopt compresses that. `activation_memory_budget` is set
  by each copy's own backend while its graphs are compiled (dynamo does not reuse a graph
  across backends), and dynamo's caches are reset (`torch._dynamo.reset()`) before and after
  each workload's compiled methods. Each copy takes two untimed steps first (the first
  compiles: its seconds are the "first step" column, lower where inductor's on-disk cache
  already holds the graph from an earlier run or from an identical graph); memory, gradient
  and step time as for the eager rows, ratios to the compiled baseline; `eager baseline (for
  scale)` is the eager model timed round-robin with them (the compile speed-up, on the same
  clock). The gradient reference is
  the compiled baseline's gradient under the same seed, because inductor draws its own dropout
  masks, not eager's (so the eager row has no gradient error). `activation_memory_budget` below
  1 may recompute dropout in backward with fresh random numbers, which corrupts its gradients
  (pytorch/pytorch#190758: with the same seed its forward loss equals the compiled baseline's,
  and with dropout off its gradients do too); its gradient error is that (and the combined
  row's, which shares its partition). Compiled methods are not trained (loss `-`), to bound
  the bench's time: the torch.compile issue asks for memory, step time and gradient error.
- **Threads**: the device line says how many CPU threads torch used (`--threads`); on a shared
  machine one thread avoids OpenMP threads waiting on busy cores, which distorts timings. The
  compiled memopt graphs run more parallel kernels than the baseline's (the codec's passes), so
  their step ratio grows with the machine's load: on this 2-core VM GPT's compiled int8 took
  1.13-1.26x the compiled baseline's in the bench's runs and 1.05-1.20x timed alone with it,
  higher where the baseline ran slower (busier machine); on one thread the compiled rows give
  1.10x on GPT and 1.14x on HF GPT-2 ([compiled_one_thread.md](compiled_one_thread.md)).
"""


def write_results(path: Path, results: Sequence[Any], meta: dict[str, Any]) -> Path:
    """Write ``results.md`` for ``results`` (one per workload) and return its path."""
    today = datetime.date.today().isoformat()
    lines = [
        "# Benchmarks: memopt next to PyTorch's own memory tools",
        "",
        f"Generated by `{'make bench-quick' if meta['quick'] else 'make bench'}` "
        f"(`benchmarks/run.py`) on {today}: torch {meta['torch']}, Python {meta['python']}, "
        f"device {meta['device']}; the run took {meta['seconds'] / 60:.1f} min. Every table "
        "names the device that produced it.",
        "",
    ]
    rerun = meta.get("compiled_rerun")
    if rerun:
        lines += [
            f"The compiled rows come from a later run of the compiled methods alone "
            f"({rerun['command']}, {rerun['seconds'] / 60:.1f} min, after the compiled codec "
            "changed), put in by `report.py --compiled-from`; the eager rows from the whole run.",
            "",
        ]
    if meta["quick"]:
        lines += ["**Quick smoke run: tiny models and few steps; the numbers mean little.**", ""]
    lines += [
        "## Headline",
        "",
        "Retained activation memory and step time as ratios to the baseline (lower is better), "
        "the gradient's relative error against exact, and the final held-out loss against the "
        "baseline's after the same training steps.",
        "",
        *headline(results),
        "",
        "![memory vs step time](pareto.png)",
        "",
        "### The bars of the benchmark issue",
        "",
        *bars(results),
        *(
            ["- the torch.compile issue's bars (compiled rows): see [compiled](#compiled-rows)"]
            if compiled_bars(results)
            else []
        ),
        "",
    ]
    for res in results:
        lines += workload_section(res) + [""]
    compiled = compiled_section(results)
    lines += compiled + ([""] if compiled else [])
    lines.append(NOTES)
    others = [(f, what) for f, what in OTHER_BENCHMARKS if (path.parent / f).exists()]
    if others:
        lines += ["## Other benchmarks", ""]
        lines += [f"- [{f}]({f}): {what}" for f, what in others]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


# --------------------------------------------------------------------------- plot
#: Radius of the plot's points, in points (a label keeps off them).
DOT_RADIUS = 3.5


def _place_labels(ax: Any, points: list[tuple[float, float, str]], color: list[str]) -> None:
    """Label every point, trying offsets at three distances and keeping the least overlapping.

    Overlap counts other labels, points the label touches and leaving the axes.
    """
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    placed: list[Any] = []
    radius = DOT_RADIUS * fig.dpi / 72
    dots = [
        Bbox.from_bounds(px - radius, py - radius, 2 * radius, 2 * radius)
        for px, py in (ax.transData.transform((x, y)) for x, y, _ in points)
    ]
    offsets = [(6, 4), (6, -10), (-6, 4), (-6, -10), (0, 9), (0, -14), (10, -3), (-10, -3)]
    offsets += [(dx * k, dy * k) for k in (2, 3) for dx, dy in offsets]  # farther out
    for (x, y, text), c in zip(points, color, strict=True):
        best = None
        for dx, dy in offsets:
            label = ax.annotate(
                text,
                (x, y),
                xytext=(dx, dy),
                textcoords="offset points",
                fontsize=7.5,
                color=c,
                ha="left" if dx > 0 else ("right" if dx < 0 else "center"),
                arrowprops={"arrowstyle": "-", "color": c, "lw": 0.5, "shrinkA": 0, "shrinkB": 3},
            )
            label.update_positions(renderer)
            box = Text.get_window_extent(label, renderer).expanded(1.05, 1.15)  # text, no line
            overlap = sum(_area(box, other) for other in placed)
            overlap += sum(box.width * box.height for dot in dots if _area(box, dot) > 0)
            inside = ax.get_window_extent(renderer)
            overlap += (
                0 if inside.contains(box.x0, box.y0) and inside.contains(box.x1, box.y1) else 1e6
            )
            if best is None or overlap < best[0]:
                if best is not None:
                    best[1].remove()
                best = (overlap, label, box)
            else:
                label.remove()
            if overlap == 0:
                break
        placed.append(best[2])


def _area(a: Any, b: Any) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def write_plot(path: Path, results: Sequence[Any]) -> Path:
    """``pareto.png``: retained memory vs step time (ratios to the baseline), a panel per model."""
    from matplotlib.lines import Line2D

    with style.chart(path, (6.2 * len(results), 6.4)) as fig:
        axes = fig.subplots(1, len(results), squeeze=False)
        labelled = []
        for ax, res in zip(axes[0], results, strict=True):
            rows = [r for r in res.rows if r.method != NOISE and memory_ratio(res, r) is not None]
            rows = [r for r in rows if time_ratio(res, r) is not None]
            xs = [time_ratio(res, r) for r in rows]
            ys = [memory_ratio(res, r) for r in rows]
            colors = [
                style.BASELINE
                if r.method == BASELINE
                else (style.MEMOPT if r.family == MEMOPT else style.PYTORCH)
                for r in rows
            ]
            ax.scatter(xs, ys, c=colors, s=(2 * DOT_RADIUS) ** 2, zorder=3)
            ax.scatter([1], [1], s=110, facecolors="none", edgecolors=style.BASELINE, zorder=4)
            ax.axhline(1, color="0.8", lw=0.8, zorder=1)
            ax.axvline(1, color="0.8", lw=0.8, zorder=1)
            ax.set_xlim(min(0.9, min(xs) - 0.05), max(xs) * 1.15 + 0.05)
            ax.set_ylim(-0.1, max(1.1, max(ys) * 1.08))  # room for labels under the lowest points
            ax.set_xlabel("step time vs baseline (forward + backward)")
            ax.set_ylabel("retained activation memory vs baseline")
            ax.set_title(f"{res.label}\n{res.device}")
            inks = [style.ink(c, 0.25) for c in colors]
            labelled.append(
                (ax, [(x, y, r.method) for x, y, r in zip(xs, ys, rows, strict=True)], inks)
            )
        handles = [
            Line2D([], [], marker="o", ls="", color=c, label=lab)
            for c, lab in (
                (style.BASELINE, "baseline"),
                (style.PYTORCH, "PyTorch"),
                (style.MEMOPT, "memopt"),
            )
        ]
        fig.legend(handles=handles, loc="outside upper right", ncols=3)
        fig.suptitle("Memory vs step time (lower left is better)", x=0.01, ha="left")
        fig.canvas.draw()  # lay the panels out, then keep that layout: labels are placed against
        fig.set_layout_engine("none")  # the points where they are drawn, and stay there
        for ax, points, inks in labelled:
            _place_labels(ax, points, inks)
    return path


def _load(path: Path) -> SimpleNamespace:
    return json.loads(path.read_text(), object_hook=lambda d: SimpleNamespace(**d))


def _plain(value: Any) -> Any:
    """``value`` with its namespaces as dicts again (for ``json.dumps``)."""
    if isinstance(value, SimpleNamespace):
        return {k: _plain(v) for k, v in vars(value).items()}
    return [_plain(v) for v in value] if isinstance(value, list) else value


def merge_compiled(results: Path, rerun: Path, command: str) -> Path:
    """Replace the compiled rows of ``results`` (a whole run's ``results.json``) by those of
    ``rerun`` (a run of the compiled methods alone, ``command``) and rewrite ``results.md``,
    ``pareto.png`` and ``results.json`` beside ``results``."""
    payload, later = _load(results), _load(rerun)
    compiled = {w.key: w.compiled for w in later.workloads if w.compiled}
    for w in payload.workloads:
        w.compiled = compiled.get(w.key, w.compiled)
    meta = _plain(payload.meta)
    meta["compiled_rerun"] = {"command": command, "seconds": later.meta.seconds}
    path = write_results(results.with_name("results.md"), payload.workloads, meta)
    write_plot(results.with_name("pareto.png"), payload.workloads)
    payload.meta = meta
    results.write_text(json.dumps(_plain(payload), indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> Path:
    """Redraw ``pareto.png`` from the ``results.json`` beside it, without rerunning the bench;
    with ``--compiled-from``, put in the compiled rows of a later run (:func:`merge_compiled`)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument(
        "results", nargs="?", type=Path, default=Path(__file__).with_name("results.json")
    )
    parser.add_argument(
        "--compiled-from",
        type=Path,
        help="the results.json of a run of the compiled methods alone (run.py --methods ...)",
    )
    parser.add_argument("--command", default="`benchmarks/run.py --methods <compiled methods>`")
    args = parser.parse_args(argv)
    if args.compiled_from:
        path = merge_compiled(args.results, args.compiled_from, args.command)
    else:
        path = write_plot(args.results.with_name("pareto.png"), _load(args.results).workloads)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
