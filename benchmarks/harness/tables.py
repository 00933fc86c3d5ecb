"""The tables of ``results.md``: the numbers behind them and the eager methods' sections.

Works on the rows ``run.py`` measured or ``report.py`` reads back from ``results.json``
(``records.WorkloadResult`` with ``records.Row`` items), so tables and plot always come from the
same numbers. The compiled methods' sections are in :mod:`.tables_compiled`; the file
itself is put together by :func:`benchmarks.report.write_results`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .methods import (
    BASELINE,
    CHECKPOINT,
    DRIFT_NOISE,
    DRIFT_REL_L2,
    INT2,
    INT4_DRIFT,
    INT8,
    LOSS_BARS,
    PLANNER_05,
)
from .records import NOISE

MIB = 1 << 20
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
    if row is None or row.bench.error or base.bench.error or not base.retained:
        return None
    return row.retained / base.retained


def time_ratio(result: Any, row: Any) -> float | None:
    """Median step time as a ratio to the baseline's (``None`` when either failed)."""
    base = _row(result, BASELINE)
    if row is None or row.bench.error or base.bench.error or not base.step_seconds:
        return None
    return row.step_seconds / base.step_seconds


def verdict(ok: bool) -> str:
    """A bar's verdict."""
    return "met" if ok else "**not met**"


def loss_change(result: Any, row: Any) -> float | None:
    """Relative change of the held-out loss against the baseline's (0.01 = 1% higher)."""
    base = _row(result, BASELINE)
    if row is None or row.trained.val_loss is None or base.trained.val_loss is None:
        return None
    return row.trained.val_loss / base.trained.val_loss - 1


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
    x = row.bench.grad_error
    if row.bench.error:
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
            + verdict(
                all(not p.bench.error and p.step_seconds < c.step_seconds for _, p, c in pairs)
            )
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
                paired = row.trained.paired
                measured = _paired(paired) if paired is not None else _pct(change)
                lines.append(
                    f"  - {res.label}, {res.train_steps} steps: {measured} "
                    f"-- {loss_verdict(change, paired)}"
                )
                short = row.trained.short_paired
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
    bits = [(res, n.trained.mean_bits, r.trained.mean_bits) for res, n, r in pairs]
    known = all(n is not None and r is not None for _, n, r in bits)
    return [
        "- drift.metric noise settles at lower mean bits than rel_l2 (compressed modules after "
        "training, mean over seeds): "
        + ", ".join(f"{res.label} {n or 0:.1f} vs {r or 0:.1f} bits" for res, n, r in bits)
        + f" -- {verdict(known and all(n < r for _, n, r in bits))}"
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
        if r.bench.error:
            failures.append(f"- {r.method}: `{r.bench.error}`")
            rows.append([r.method, r.bench.detail] + ["failed"] * 8)
            continue
        rows.append(
            [
                r.method,
                r.bench.detail,
                f"{r.retained / MIB:.2f}",
                _ratio(memory_ratio(res, r)),
                f"{r.peak / MIB:.2f}",
                f"{r.peak / base.peak:.2f}x" if base.peak else "-",
                f"{r.bench.packed / MIB:.2f}" if r.bench.packed else "-",
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
    if base.trained.accuracy is not None:
        header.append("accuracy")
    if res.seeds > 1:
        header.append("paired")
    short = getattr(res, "short_steps", None)
    if short:
        header.append(f"{short}-step run, paired")
    header += ["train loss", "s/step vs baseline", "drift checks / bits at the end"]
    rows = []
    b = base.trained
    for r in res.rows:
        t = r.trained
        if t.val_loss is None:
            cells = [r.method, "failed", "-"] + ["-"] * (len(header) - 4) + [t.training]
            rows.append(cells)
            continue
        spread = f" ± {t.val_spread:.4f}" if t.val_spread is not None else ""
        cells = [r.method, f"{t.val_loss:.4f}{spread}", _pct(loss_change(res, r))]
        if b.accuracy is not None:
            cells.append(f"{t.accuracy:.1%}")
        if res.seeds > 1:
            cells.append(_paired(t.paired))
        if short:
            cells.append(_paired(t.short_paired))
        speed = f"{t.train_seconds / b.train_seconds:.2f}x" if b.train_seconds else "-"
        cells += [f"{t.train_loss:.4f}", speed, t.training]
        rows.append(cells)
    lines += _table(header, ["---"] + ["--:"] * (len(header) - 2) + ["---"], rows)
    return lines
