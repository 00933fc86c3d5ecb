"""The profile's PNGs: the largest holders of saved activations, and the step's timeline.

They draw plain data (:class:`Bar` rows, timelines) that
:class:`~memopt_plugins.profiler.report.ProfileReport` hands them; nothing here reads a report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..measure.timeline import StepTimeline
from . import style
from .units import axis_unit, human_bytes


@dataclass(frozen=True)
class Bar:
    """One holder: its label, the bytes it saves itself without and with the plan (``None``: no
    plan measured) and what the plan does with it."""

    label: str
    self_saved: int
    self_saved_after: int | None = None
    action_text: str = ""


def plot_holders(rows: Sequence[Bar], totals: tuple[int, int | None], path: Path) -> Path:
    """Write the bar chart of ``rows`` (largest first) to ``path``; ``totals`` are the saved
    bytes in all without and with the plan."""
    has_after = totals[1] is not None
    largest = max([row.self_saved for row in rows] or [1])
    unit, scale = axis_unit(largest)
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
        title = f"Largest holders of saved activations: {human_bytes(totals[0])} in all"
        if has_after:
            title += f", {human_bytes(totals[1] or 0)} with the plan"
        fig.suptitle(title + "\n(bytes each module saves itself, children excluded)")
        if has_after:
            ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1), ncols=2)
    return path


#: The timeline's kinds, bottom to top, with their colours: what the forward left (as it is or
#: packed) lies under what the backward adds (decoded, replayed, gradients).
_KIND_COLOURS = {
    "activations": style.BASELINE,
    "packed": style.MEMOPT,
    "decoded": style.BITS[4],
    "recomputed": style.PYTORCH,
    "backward": "#A8ADB5",
}


def plot_timeline(steps: Sequence[tuple[str, StepTimeline]], path: Path) -> Path:
    """Write each named step's live bytes over time, by kind, to ``path`` (one panel each)."""
    largest = max(timeline.peak for _, timeline in steps) or 1
    unit, scale = axis_unit(largest)
    with style.chart(path, (7.5, 2.3 * len(steps) + 0.8)) as fig:
        axes = fig.subplots(len(steps), 1, sharey=True, squeeze=False)[:, 0]
        for ax, (name, timeline) in zip(axes, steps, strict=True):
            times = [t * 1e3 for t in timeline.times]
            layers = [[v / scale for v in timeline.kinds[k]] for k in _KIND_COLOURS]
            ax.stackplot(
                times,
                layers,
                labels=list(_KIND_COLOURS),
                colors=list(_KIND_COLOURS.values()),
                step="post",
                linewidth=0,
            )
            ax.axvline(timeline.backward_start * 1e3, color="0.5", linestyle="--", linewidth=0.8)
            peak_ms = timeline.peak_time * 1e3
            ax.plot([peak_ms], [timeline.peak / scale], marker="v", color=style.LIMIT)
            ax.set_title(f"{name}: peak {human_bytes(timeline.peak)} {timeline.site}", fontsize=8.5)
            ax.set_ylabel(f"live ({unit})")
        axes[-1].set_xlabel("time in the step (ms; dashed: the backward begins)")
        axes[0].set_ylim(0, largest / scale * 1.15)
        axes[0].legend(loc="lower center", bbox_to_anchor=(0.5, 1.18), ncols=len(_KIND_COLOURS))
        fig.suptitle("One training step's memory, as the allocator saw it")
    return path
