"""The README's picture: how many times larger a batch fits, per method and model.

Reads ``fits.json`` (written by ``python -m benchmarks.fits``) and draws one bar group per model
for the methods the README's table shows, in memopt's chart look. ``make bench`` runs it after
the studies, so the picture follows the measured numbers.

    python -m benchmarks.plot_fits [--fits benchmarks/fits.json] [--out docs/fits.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from memopt_plugins.profiler import style

ROOT = Path(__file__).resolve().parents[1]

#: The lean-ops rows: a hue of their own beside compression's oranges.
LEAN = {4: "#9E86C8", 2: "#5B3F8C"}
#: The methods drawn, in order: (method as fits.json names it, label, colour).
METHODS = (
    ("checkpoint every block", "PyTorch checkpoint, every block", style.PYTORCH),
    ("memopt int8", "memopt int8", style.BITS[4]),
    ("memopt int4", "memopt int4", style.BITS[8]),
    ("memopt planner 0.1 + int8", "memopt planner 0.1 + int8", style.BITS[16]),
    ("memopt lean ops + int4", "memopt lean ops + int4", LEAN[4]),
    ("memopt lean ops + int2", "memopt lean ops + int2", LEAN[2]),
)
#: The models, in the order fits.json lists them.
MODELS = ("HF GPT-2", "HF Llama", "ResNet-50-style")


def fits_by_method(rows: list[dict]) -> dict[tuple[str, str], float]:
    """``(model, method) -> fits`` for the eager rows (the compiled rows are read another way)."""
    return {(r["model"], r["method"]): r["fits"] for r in rows if r.get("fits_compiled") is None}


def write_plot(rows: list[dict], path: Path) -> Path:
    fits = fits_by_method(rows)
    with style.chart(path, (7.6, 3.6)) as fig:
        ax = fig.add_subplot()
        width = 0.8 / len(METHODS)
        for i, (method, label, color) in enumerate(METHODS):
            xs = [m + (i - (len(METHODS) - 1) / 2) * width for m in range(len(MODELS))]
            heights = [fits[(model, method)] for model in MODELS]
            bars = ax.bar(xs, heights, width * 0.92, color=color, label=label)
            ax.bar_label(bars, [f"{h:.1f}x" for h in heights], fontsize=7, padding=1.5)
        ax.axhline(1.0, color=style.BASELINE, linewidth=1.0)
        ax.set_xticks(range(len(MODELS)), MODELS)
        ax.set_ylabel("batch that fits / baseline's")
        ax.set_title("How many times larger a batch fits in the baseline's step peak (CPU)")
        ax.legend(ncols=2, loc="upper right")
        ax.set_ylim(0, max(fits[(m, k)] for m in MODELS for k, _, _ in METHODS) * 1.3)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fits", type=Path, default=ROOT / "benchmarks" / "fits.json")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "fits.png")
    args = parser.parse_args(argv)
    print(write_plot(json.loads(args.fits.read_text()), args.out))


if __name__ == "__main__":
    main()
