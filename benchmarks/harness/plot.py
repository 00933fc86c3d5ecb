"""``pareto.png``: retained memory against step time, ratios to the baseline, a panel per model."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memopt_plugins.profiler import style

from .methods import BASELINE, MEMOPT
from .records import NOISE
from .tables import memory_ratio, time_ratio

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
                else (style.MEMOPT if r.bench.family == MEMOPT else style.PYTORCH)
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
