"""memopt in a few minutes on a CPU: what `make demo` runs.

1. builds a character-level GPT (4 blocks, width 128) on the Python standard library's source;
2. prints the plan memopt makes from a preset (4-bit activations, drift-checked);
3. measures one training step's memory without and with memopt (retained for backward, peak);
4. trains with the Lightning callback for about two minutes — drift checks and escalations are
   printed as they happen through the ``memopt`` logger;
5. trains the same number of steps without memopt and prints both losses side by side;
6. draws what happened in one picture, ``demo.png`` next to the logs: the loss curves of both
   runs, the activation memory each kept for backward, the mean bits, and the bits of the
   modules the drift checks moved (up, and with ``drift.lower`` back down).

    python examples/demo.py [--config configs/int4_drift.yaml] [--seconds 120] [--threads 2]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Before torch loads OpenMP: idle threads sleep instead of spinning, which keeps a step fast on
# a machine whose cores are busy with something else as well.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memopt_plugins.callbacks import MemOptCallback  # noqa: E402
from models import lm_loss  # noqa: E402
from train_gpt_lightning import CharGPT, PrintLoss, loaders  # noqa: E402

from memopt_plugins import MemoryOptimizer  # noqa: E402
from memopt_plugins.config import DriftConfig  # noqa: E402
from memopt_plugins.profiler import style  # noqa: E402
from memopt_plugins.profiler.meter import MemoryMeter, MemoryReading  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024


def section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 74 - len(title)), flush=True)


def measure_step(model: CharGPT, batch, opt: MemoryOptimizer | None) -> MemoryReading:
    """Memory of one training step (the smaller of two readings, after a warm-up step)."""
    meter = MemoryMeter("cpu")
    stats = opt.internal.compression.stats if opt is not None else None
    lm_loss(model, batch).backward()  # allocates the gradients: the readings cover activations
    readings = [meter.measure(lambda: lm_loss(model, batch), stats) for _ in range(2)]
    model.zero_grad(set_to_none=True)
    return min(readings, key=lambda r: r.retained)


class Curves(PrintLoss):
    """:class:`PrintLoss` that also records what the picture shows, step by step.

    The validation loss at the start, every ``val_every`` optimizer steps and at the end (the time
    it takes is kept apart in ``eval_seconds``); with ``memopt``, the bytes its hooks held for
    backward after each training forward, what those tensors weigh uncompressed, and the bits
    of every compressed module that forward ran with.
    """

    def __init__(self, val, val_every: int, label: str, memopt: MemOptCallback | None = None):
        super().__init__(every=10, label=label)
        self.val = val
        self.val_every = val_every
        self.memopt = memopt
        self.val_steps: list[int] = []
        self.val_losses: list[float] = []
        self.eval_seconds = 0.0
        self.kept: list[int] = []
        self.uncompressed: list[int] = []
        self.bits: list[dict[str, int]] = []
        self.bits_mean: list[float] = []  # weighted by the bytes each module saves

    def validate(self, model: CharGPT, step: int) -> None:
        t0 = time.perf_counter()
        self.val_steps.append(step)
        self.val_losses.append(validation_loss(model, self.val))
        self.eval_seconds += time.perf_counter() - t0

    def on_train_start(self, trainer: pl.Trainer, pl_module: CharGPT) -> None:
        self.validate(pl_module, 0)
        super().on_train_start(trainer, pl_module)  # the printed seconds start after it

    def on_before_backward(self, trainer: pl.Trainer, pl_module: CharGPT, loss) -> None:
        if self.memopt is None:
            return
        stats = self.memopt.memopt.internal.compression.stats
        self.kept.append(stats.forward_stored)
        self.uncompressed.append(stats.forward_original)
        self.bits.append(self.memopt.bits)
        self.bits_mean.append(self.memopt.memopt.metrics(drift=False).get("memopt/bits_mean"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.global_step % self.val_every == 0:
            self.validate(pl_module, trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: CharGPT) -> None:
        if self.val_steps[-1] != trainer.global_step:
            self.validate(pl_module, trainer.global_step)


@dataclass
class Demo:
    """What the demo measured: both runs' curves, the memory of one step, the drift checks."""

    memopt: Curves
    baseline: Curves
    seconds_per_step: dict[str, float]
    retained: dict[str, int]  # bytes kept for backward after one forward (the meter's reading)
    checks: list[dict[str, Any]]  # drift history: step, round_max, escalated/lowered {fqn: (a, b)}
    drift: DriftConfig
    config: str


def trainer(steps: int, seconds: float | None, callbacks: list, root: Path) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        max_time={"seconds": seconds} if seconds else None,
        callbacks=callbacks,
        logger=pl.loggers.CSVLogger(root, name="demo"),
        log_every_n_steps=10,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


def validation_loss(model: CharGPT, val) -> float:
    model.eval()
    with torch.no_grad():
        losses = [float(lm_loss(model, batch)) for batch in val]
    model.train()
    return sum(losses) / len(losses)


# --------------------------------------------------------------------------- the picture
SMOOTH = 21  # steps in the training loss's centred moving mean


def moving_mean(values: list[float], window: int) -> list[float]:
    """The mean of the ``window`` values centred on each position; near the ends the window
    shrinks to stay centred (so the curve starts and ends where the values do)."""
    out = []
    for i in range(len(values)):
        half = min(window // 2, i, len(values) - 1 - i)
        out.append(sum(values[i - half : i + half + 1]) / (2 * half + 1))
    return out


def moved_modules(bits: list[dict[str, int]]) -> list[str]:
    """The modules whose bits changed during training, in the model's order."""
    if not bits:
        return []
    return [fqn for fqn, first in bits[0].items() if any(step[fqn] != first for step in bits)]


def plot_demo(demo: Demo, path: Path) -> Path:
    """``demo.png``: loss, activation memory kept for backward, drift checks, mean bits and the
    bits of the modules that moved, by step."""
    moved = moved_modules(demo.memopt.bits)
    heights = [3.0, 1.7, 1.3, 1.1, 0.6 + 0.24 * max(2, len(moved))]
    steps = len(demo.memopt.losses)
    with style.chart(path, (10.0, sum(heights) + 1.0)) as fig:
        loss_ax, memory_ax, drift_ax, mean_ax, bits_ax = fig.subplots(
            5, 1, sharex=True, gridspec_kw={"height_ratios": heights}
        )
        plot_loss(loss_ax, demo)
        plot_memory(memory_ax, demo)
        plot_drift(drift_ax, demo)
        plot_mean_bits(mean_ax, demo)
        plot_bits(bits_ax, demo, moved)
        bits_ax.set_xlabel("optimizer step")
        bits_ax.set_xlim(-0.012 * steps, 1.012 * steps)
        fig.suptitle(
            f"make demo: a character GPT trained {steps} steps with memopt "
            f"({Path(demo.config).name}) and without"
        )
    return path


def plot_loss(ax: Any, demo: Demo) -> None:
    runs = (
        ("without memopt", demo.baseline, style.BASELINE),
        ("with memopt", demo.memopt, style.MEMOPT),
    )
    for (name, run, color), width in zip(runs, (2.6, 1.4), strict=True):
        steps = range(len(run.losses))
        ax.plot(steps, run.losses, color=color, alpha=0.2, lw=0.7)
        ax.plot(
            steps,
            moving_mean(run.losses, SMOOTH),
            color=color,
            lw=width,
            label=f"{name}: training (mean of {SMOOTH} steps)",
        )
        ax.plot(
            run.val_steps,
            run.val_losses,
            color=style.ink(color, 0.2),
            ls=(0, (4, 2)),
            lw=1.1,
            marker="o",
            ms=4.5 if run is demo.baseline else 3,
            label=f"{name}: validation",
        )
    m, b = demo.memopt.val_losses[-1], demo.baseline.val_losses[-1]
    sec = demo.seconds_per_step
    ax.set_title(
        f"Loss: validation {m:.3f} with memopt, {b:.3f} without ({m / b - 1:+.1%}); "
        f"{sec['memopt']:.2f} s against {sec['baseline']:.2f} s a step"
    )
    ax.set_ylabel("cross-entropy (nats / char)")
    ax.legend(ncols=2, loc="upper right")


def plot_memory(ax: Any, demo: Demo) -> None:
    run = demo.memopt
    steps = range(len(run.kept))
    kept = [b / MIB for b in run.kept]
    whole = [b / MIB for b in run.uncompressed]
    ax.fill_between(steps, kept, whole, color=style.MEMOPT, alpha=0.08, lw=0)
    for values, color, name in (
        (whole, style.BASELINE, "without memopt: the saved tensors as they are"),
        (kept, style.MEMOPT, "with memopt: what its hooks hold (packed)"),
    ):
        ax.plot(steps, values, color=color, lw=1.8)
        first, last = values[0], values[-1]
        change = f"{last:.1f} MiB" if abs(last - first) < 0.05 else f"{first:.1f} → {last:.1f} MiB"
        for x, ha, text in ((0, "left", name), (len(values) - 1, "right", change)):
            ax.annotate(
                text,
                (x, values[x]),
                xytext=(0, 4),
                textcoords="offset points",
                ha=ha,
                va="bottom",
                color=style.ink(color, 0.2),
                fontsize=8.5,
            )
    ax.set_ylim(0, max(whole) * 1.3)
    ax.set_ylabel("MiB")
    r = demo.retained
    ax.set_title(
        f"Activation memory kept for backward: {r['baseline'] / MIB:.1f} MiB without memopt, "
        f"{r['memopt'] / MIB:.1f} MiB with it ({r['baseline'] / max(1, r['memopt']):.1f}x less, "
        "measured at the first step)"
    )


def plot_drift(ax: Any, demo: Demo) -> None:
    drift = demo.drift

    def kind(check: dict[str, Any]) -> str:
        return "up" if check["escalated"] else "down" if check.get("lowered") else "calm"

    found = [
        (c["step"], c["round_max"][0] if c["round_max"] else c["max"], kind(c)) for c in demo.checks
    ]
    ax.axhline(
        drift.threshold, color=style.LIMIT, ls="--", lw=1, label=f"threshold {drift.threshold:g}"
    )
    for what, marker, color, label in (
        ("calm", "o", "0.5", "check: all under it"),
        ("up", "^", style.LIMIT, "check: modules over it escalated"),
        ("down", "v", style.MEMOPT, "check: calm modules lowered"),
    ):
        if what == "down" and not drift.lower:
            continue
        ax.scatter(
            [s for s, _, k in found if k == what],
            [d for _, d, k in found if k == what],
            marker=marker,
            color=color,
            s=24,
            zorder=3,
            label=label,
        )
    ax.set_ylim(0, max([d for _, d, _ in found] + [drift.threshold]) * 1.4)
    ax.set_ylabel(f"max drift\n({drift.metric})")
    up = sum(k == "up" for *_, k in found)
    down = sum(k == "down" for *_, k in found)
    ax.set_title(
        f"Drift checks every {drift.check_every} steps: the largest drift of any module at each; "
        f"{up} of the {len(found)} checks escalated modules"
        + (f", {down} lowered some" if drift.lower else "")
    )
    ax.legend(ncols=3, loc="upper right")


def plot_mean_bits(ax: Any, demo: Demo) -> None:
    run = demo.memopt
    values = run.bits_mean
    ax.plot(range(len(values)), values, color=style.MEMOPT, lw=1.8, drawstyle="steps-post")
    top = max(values)
    peak = values.index(top)
    ax.annotate(
        f"{values[0]:.2f} at the start, {top:.2f} at the most (step {peak}), {values[-1]:.2f} at "
        "the end",
        (len(values) - 1, values[-1]),
        xytext=(0, 4),
        textcoords="offset points",
        ha="right",
        va="bottom",
        color=style.ink(style.MEMOPT, 0.2),
        fontsize=8.5,
    )
    low = min(values)
    ax.set_ylim(max(0.0, low - 1), top + 0.45 * (top - low + 2))
    ax.set_ylabel("bits")
    ax.set_title(
        "Mean bits of the compressed modules, weighted by the bytes each saves (memopt/bits_mean)"
    )


def plot_bits(ax: Any, demo: Demo, moved: list[str]) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    bits = demo.memopt.bits
    total = len(bits[0]) if bits else 0
    ax.grid(False)
    for check in demo.checks:
        ax.axvline(check["step"], color="0.25", alpha=0.6, lw=0.7, ls=":", zorder=3)
    if not moved:
        ax.set_yticks([])
        ax.text(
            0.5,
            0.5,
            f"no drift check moved a module: all {total} kept their bits",
            transform=ax.transAxes,
            ha="center",
            va="center",
        )
        ax.set_title("Bits of the compressed modules (dotted lines: the drift checks)")
        return
    shown: set[int] = set()
    for row, fqn in enumerate(moved):
        series = [step[fqn] for step in bits]
        start = 0
        for i in range(1, len(series) + 1):
            if i < len(series) and series[i] == series[start]:
                continue
            width = series[start]
            ax.broken_barh([(start, i - start)], (row - 0.38, 0.76), color=style.BITS[width])
            if i - start > 0.04 * len(series):
                ax.text(
                    start + (i - start) / 2,
                    row,
                    str(width),
                    ha="center",
                    va="center",
                    fontsize=7.5,
                    color="black" if width < 16 else "white",
                    bbox={"facecolor": style.BITS[width], "edgecolor": "none", "pad": 1},
                    zorder=4,  # over the drift checks' lines
                )
            shown.add(width)
            start = i
    check = Line2D([], [], color="0.25", alpha=0.6, lw=0.7, ls=":", label="a drift check")
    ax.figure.legend(
        handles=[Patch(color=style.BITS[b], label=f"{b} bits") for b in sorted(shown)] + [check],
        ncols=len(shown) + 1,
        loc="outside lower center",
    )
    ax.set_yticks(range(len(moved)), [fqn.removeprefix("model.") for fqn in moved], fontsize=8)
    ax.set_ylim(len(moved) - 0.5, -0.5)
    ax.set_title(
        f"Bits of the {len(moved)} modules the drift checks moved "
        f"(the other {total - len(moved)} kept theirs)"
    )


def main(argv: list[str] | None = None) -> Demo:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "int4_drift.yaml"))
    parser.add_argument("--seconds", type=float, default=120, help="training time with memopt")
    parser.add_argument("--max-steps", type=int, default=2000, help="stop earlier at this step")
    parser.add_argument("--val-every", type=int, default=50, help="validation loss every N steps")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--log-dir", default=str(ROOT / "lightning_logs"))
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for noise in (".*does not have many workers.*", ".*treespec.*", ".*no `val_dataloader`.*"):
        warnings.filterwarnings("ignore", message=noise)
    logging.basicConfig(level=logging.WARNING, format="  %(message)s")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    memopt_log = logging.getLogger("memopt")
    memopt_log.setLevel(logging.INFO)
    started = time.perf_counter()
    root = Path(args.log_dir)

    section("data and model")
    train, val = loaders(block_size=128, batch_size=args.batch_size, steps=args.max_steps)
    chars = train.dataset.tokens.numel() + val.dataset.tokens.numel()
    print(f"text: {chars / 1e6:.1f} M characters of the standard library's own .py files")
    pl.seed_everything(0, verbose=False)
    model = CharGPT(max_steps=args.max_steps)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: character GPT, 4 blocks x width 128, {params / 1e6:.2f} M parameters")
    print(f"batch: {args.batch_size} x 128 characters; {args.threads} CPU threads")
    print(f"config: {args.config}")

    section("the plan (what memopt does to each module)")
    batch = next(iter(train))
    opt = MemoryOptimizer(args.config)
    memopt_log.setLevel(logging.WARNING)  # the callback says it again at fit start
    opt.apply(model)
    print(opt.plan)

    section("memory of one training step")
    with_memopt = measure_step(model, batch, opt)
    opt.remove()
    baseline = measure_step(model, batch, None)
    memopt_log.setLevel(logging.INFO)
    print(f"{'':24}{'retained for backward':>24}{'peak of the step':>20}")
    print(f"{'baseline':24}{baseline.retained / MIB:21.1f} MiB{baseline.peak / MIB:17.1f} MiB")
    print(
        f"{'memopt':24}{with_memopt.retained / MIB:21.1f} MiB{with_memopt.peak / MIB:17.1f} MiB"
        f"   (packed activations: {with_memopt.packed / MIB:.1f} MiB)"
    )
    if with_memopt.retained > 0:
        print(f"retained memory: {baseline.retained / with_memopt.retained:.1f}x less with memopt")

    section(f"training with memopt (about {args.seconds:.0f} s)")
    pl.seed_everything(0, verbose=False)
    model = CharGPT(max_steps=args.max_steps)
    memopt = MemOptCallback(args.config)
    curves = Curves(val, args.val_every, "memopt   ", memopt)
    t0 = time.perf_counter()
    fit = trainer(args.max_steps, args.seconds, [memopt, curves], root)
    fit.fit(model, train)
    memopt_seconds = time.perf_counter() - t0 - curves.eval_seconds
    steps = fit.global_step
    drift_state = memopt.state_dict()["drift"]
    escalations = int(drift_state["escalations"])
    deescalations = int(drift_state["lowering"]["deescalations"])
    final_bits = sorted(set(memopt.bits.values()))

    section(f"baseline: the same {steps} steps without memopt")
    pl.seed_everything(0, verbose=False)
    base_model = CharGPT(max_steps=args.max_steps)
    base_curves = Curves(val, args.val_every, "baseline  ")
    t0 = time.perf_counter()
    trainer(steps, args.seconds, [base_curves], root).fit(base_model, train)
    base_seconds = time.perf_counter() - t0 - base_curves.eval_seconds

    section("result")

    def tail(losses: list[float]) -> float:
        last = losses[-20:]
        return sum(last) / max(1, len(last))

    demo = Demo(
        memopt=curves,
        baseline=base_curves,
        seconds_per_step={
            "memopt": memopt_seconds / max(1, steps),
            "baseline": base_seconds / max(1, steps),
        },
        retained={"memopt": with_memopt.retained, "baseline": baseline.retained},
        checks=memopt.state_dict()["drift"]["history"],
        drift=memopt.config.drift,
        config=args.config,
    )
    print(f"{'':12}{'train loss (last 20)':>22}{'validation loss':>18}{'s/step':>9}")
    for name, run in (("memopt", curves), ("baseline", base_curves)):
        print(
            f"{name:12}{tail(run.losses):22.3f}{run.val_losses[-1]:18.3f}"
            f"{demo.seconds_per_step[name]:9.2f}"
        )
    print(
        f"activation memory kept for backward: {with_memopt.retained / MIB:.1f} MiB with memopt, "
        f"{baseline.retained / MIB:.1f} MiB without; bits at the end: "
        f"{'/'.join(map(str, final_bits))}; escalations: {escalations}, lowerings: "
        f"{deescalations}"
    )
    means = curves.bits_mean
    print(
        f"mean bits (weighted by saved bytes): {means[0]:.2f} at the first step, "
        f"{max(means):.2f} at the most, {means[-1]:.2f} at the last"
    )
    print(
        f"held by memopt's hooks: {curves.kept[0] / MIB:.1f} MiB at the first step, "
        f"{curves.kept[-1] / MIB:.1f} MiB at the last, of {curves.uncompressed[-1] / MIB:.1f} MiB "
        "saved tensors"
    )
    picture = root / "demo" / "demo.png"
    try:
        print(f"picture: {plot_demo(demo, picture)}")
    except ImportError as err:
        print(f"picture not written: {err}")
    print(f"demo finished in {time.perf_counter() - started:.0f} s; logs in {root}/demo")
    return demo


if __name__ == "__main__":
    main()
