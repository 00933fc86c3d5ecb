"""The README's picture and table: how many times larger a batch fits, per method and model.

Reads ``fits.json`` (written by ``python -m benchmarks.fits``) and draws one bar group per model
for the fp32 methods the README's table shows, in memopt's chart look. ``make bench`` runs it
after the studies, so the picture follows the measured numbers. ``--readme-table`` prints the
README's Results table instead: those methods, then lean ops + int4 under bf16 autocast and under
torch.compile where fits.json has them (tests/test_docs.py holds the README to it).

    python -m benchmarks.plot_fits [--fits benchmarks/fits.json] [--out docs/fits.png]
    python -m benchmarks.plot_fits --readme-table
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
#: The README table's rows after :data:`METHODS`, shown where fits.json has them: (method as
#: fits.json names it, label, the field read: ``fits_compiled`` is against the compiled baseline).
SETTINGS = (
    ("bf16 autocast memopt lean ops + int4", "memopt lean ops + int4, bf16 autocast", "fits"),
    (
        "torch.compile + memopt lean ops + int4",
        "memopt lean ops + int4, torch.compile (vs compiled baseline)",
        "fits_compiled",
    ),
)


def fits_by_method(rows: list[dict]) -> dict[tuple[str, str], float]:
    """``(model, method) -> fits`` for the eager rows (the compiled rows are read another way)."""
    return {(r["model"], r["method"]): r["fits"] for r in rows if r.get("fits_compiled") is None}


def readme_table(rows: list[dict]) -> str:
    """The README's Results table: a row per :data:`METHODS` entry, then the :data:`SETTINGS`
    that fits.json has for some model; ``–`` where a model has none."""
    value = {(r["model"], r["method"]): r for r in rows}
    lines = ["| method | " + " | ".join(MODELS) + " |", "|---|" + "--:|" * len(MODELS)]
    shown = [(method, label, "fits") for method, label, _ in METHODS] + [
        s for s in SETTINGS if any((model, s[0]) in value for model in MODELS)
    ]
    for method, label, key in shown:
        cells = [
            f"{value[(model, method)][key]:.2f}×" if (model, method) in value else "–"
            for model in MODELS
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


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
    parser.add_argument("--readme-table", action="store_true", help="print the README's table")
    args = parser.parse_args(argv)
    rows = json.loads(args.fits.read_text())
    if args.readme_table:
        print(readme_table(rows), end="")
    else:
        print(write_plot(rows, args.out))


if __name__ == "__main__":
    main()
