"""One look for every chart memopt draws: the profile's bars (``memopt profile``), the demo's
picture (``make demo``) and the benchmark's ``pareto.png``.

A chart is drawn inside :func:`chart`, which applies the look (fonts, grid, spines, legend) while
the figure is built and written, so that every artist takes it; the colours below name what they
stand for, and each chart uses the same one for the same thing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Training or measuring without memopt.
BASELINE = "#4A4E57"
#: With memopt.
MEMOPT = "#DD8452"
#: PyTorch's own memory tools (checkpointing, SAC, save_on_cpu).
PYTORCH = "#4C72B0"
#: A limit the chart is read against (the drift threshold).
LIMIT = "#C44E52"
#: Bit widths of compressed activations, light (few bits) to dark (many).
BITS = {2: "#FDE0C5", 4: "#F9B98A", 8: "#E5804A", 16: "#B5532A", 32: "#6E2E14"}

_RC = {
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.titlelocation": "left",
    "axes.titlepad": 6,
    "axes.labelsize": 9,
    "axes.labelcolor": "0.2",
    "axes.edgecolor": "0.45",
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "axes.axisbelow": True,
    "grid.color": "0.91",
    "grid.linewidth": 0.8,
    "xtick.labelsize": 8.5,
    "ytick.labelsize": 8.5,
    "xtick.color": "0.3",
    "ytick.color": "0.3",
    "legend.fontsize": 8.5,
    "legend.frameon": False,
    "figure.titlesize": 11.5,
    "figure.titleweight": "bold",
    "figure.facecolor": "white",
    "figure.dpi": 110,
    "savefig.dpi": 130,
    "savefig.facecolor": "white",
}


def ink(color: str, darken: float = 0.45) -> str:
    """``color`` darkened towards black: text written beside a mark of that colour."""
    from matplotlib.colors import to_hex, to_rgb

    return to_hex(tuple(c * (1 - darken) for c in to_rgb(color)))


@contextmanager
def chart(path: Path, size: tuple[float, float]) -> Iterator[Figure]:
    """A figure of ``size`` inches in memopt's look, written to ``path`` when the block ends.

    The figure has no pyplot state (an Agg canvas of its own) and a constrained layout; it is
    not written when the block raises.
    """
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "memopt's charts need matplotlib: pip install 'memopt-plugins[plot]'"
        ) from None
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=size, layout="constrained")
        FigureCanvasAgg(fig)
        yield fig
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
