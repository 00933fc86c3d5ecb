"""The profile's PNG: a bar chart of the largest holders of saved activations."""

from __future__ import annotations

from pathlib import Path

from . import style
from .report import UNITS, ProfileReport, human_bytes


def _axis_unit(largest: float) -> tuple[str, float]:
    scale = 1.0
    for unit in UNITS:
        if largest < 1024 * scale or unit == UNITS[-1]:
            return unit, scale
        scale *= 1024
    raise AssertionError("unreachable")


def plot_report(report: ProfileReport, path: Path, top: int) -> Path:
    """Write the chart of the ``top`` largest holders (self bytes) to ``path``."""
    rows = [row for row in report.top(top, by="self_saved") if row.self_saved > 0]
    rows.sort(key=lambda row: row.self_saved, reverse=True)
    has_after = report.after is not None
    largest = max([row.self_saved for row in rows] or [1])
    unit, scale = _axis_unit(largest)
    labels = [row.label for row in rows]
    label_chars = max([len(label) for label in labels] or [10])
    size = (6.0 + 0.075 * label_chars, 1.9 + 0.42 * max(len(rows), 1))
    with style.chart(path, size) as fig:
        ax = fig.add_subplot()
        ys = range(len(rows))
        height = 0.4 if has_after else 0.7
        before = [row.self_saved / scale for row in rows]
        ax.barh(
            [y - height / 2 if has_after else y for y in ys],
            before,
            height,
            label="without memopt",
            color=style.BASELINE,
        )
        if has_after:
            after = [(row.self_saved_after or 0) / scale for row in rows]
            ax.barh(
                [y + height / 2 for y in ys],
                after,
                height,
                label="with the plan",
                color=style.MEMOPT,
            )
            for y, value, row in zip(ys, after, rows, strict=True):
                ax.text(
                    value,
                    y + height / 2,
                    f" {human_bytes(row.self_saved_after or 0)} ({row.action_text})",
                    va="center",
                    fontsize=7.5,
                    color=style.ink(style.MEMOPT),
                )
        for y, value, row in zip(ys, before, rows, strict=True):
            ax.text(
                value,
                y - (height / 2 if has_after else 0),
                f" {human_bytes(row.self_saved)}",
                va="center",
                fontsize=7.5,
                color=style.ink(style.BASELINE, 0.2),
            )
        ax.set_yticks(list(ys), labels, fontsize=8.5)
        ax.set_ylim(len(rows) - 0.5, -0.5)  # largest on top, no empty rows at the ends
        ax.set_xlabel(f"saved activations held for backward ({unit})")
        ax.set_xlim(0, max(before or [1]) * 1.3)
        ax.grid(axis="y", visible=False)
        title = f"Largest holders of saved activations: {human_bytes(report.saved_total)} in all"
        if has_after:
            title += f", {human_bytes(report.saved_after_total or 0)} with the plan"
        fig.suptitle(title + "\n(bytes each module saves itself, children excluded)")
        if has_after:
            ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1), ncols=2)
    return path
