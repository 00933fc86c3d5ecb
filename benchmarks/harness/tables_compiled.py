"""The compiled methods' part of ``results.md``: their bars and their tables.

Every figure is against the compiled baseline (``methods.C_BASELINE``); see ``compiled.py``
for how the rows are measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .methods import C_BASELINE, C_BUDGET_03, C_EAGER, C_INT8, C_PLANNER_05, MEMOPT
from .tables import MIB, _err, _ratio, _table, verdict

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


def compiled_ratio(result: Any, row: Any, attr: str) -> float | None:
    """``row.<attr>`` (``retained``, ``peak``, ``step_seconds``) of a compiled method as a ratio
    to the compiled baseline's (``None`` when either failed or is missing)."""
    base = next((r for r in result.compiled if r.method == C_BASELINE), None)
    failed = row is None or base is None or row.bench.error or base.bench.error
    if failed or not getattr(base, attr):
        return None
    return getattr(row, attr) / getattr(base, attr)


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
            if peer.bench.error:
                parts.append(f"{res.label}: {C_BUDGET_03} failed")
                ok = False
                continue
            lower = [
                r
                for r in res.compiled
                if r.bench.family == MEMOPT and not r.bench.error and r.retained < peer.retained
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
            if r.bench.error:
                failures.append(f"- {r.method}: `{r.bench.error}`")
                rows.append([r.method, r.bench.detail] + ["failed"] * 9 + ["-"])
                continue
            first = "-" if r.bench.compile_seconds is None else f"{r.bench.compile_seconds:.1f}"
            rows.append(
                [
                    r.method,
                    r.bench.detail,
                    f"{r.retained / MIB:.2f}",
                    _ratio(compiled_ratio(res, r, "retained")),
                    f"{r.peak / MIB:.2f}",
                    _ratio(compiled_ratio(res, r, "peak")),
                    f"{r.bench.packed / MIB:.2f}" if r.bench.packed else "-",
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
