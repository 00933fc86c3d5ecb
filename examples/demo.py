"""memopt in a few minutes on a CPU: what `make demo` runs.

1. builds a character-level GPT (4 blocks, width 128) on the Python standard library's source;
2. prints the plan memopt makes from a preset (4-bit activations, drift-checked);
3. measures one training step's memory without and with memopt (retained for backward, peak);
4. trains with the Lightning callback for about two minutes — drift checks and escalations are
   printed as they happen through the ``memopt`` logger;
5. trains the same number of steps without memopt and prints both losses side by side.

    python examples/demo.py [--config configs/int4_drift.yaml] [--seconds 120] [--threads 2]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from pathlib import Path

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
from memopt_plugins.profiler.meter import MemoryMeter, MemoryReading  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024


def section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 74 - len(title)), flush=True)


def measure_step(model: CharGPT, batch, opt: MemoryOptimizer | None) -> MemoryReading:
    """Memory of one training step (the smaller of two readings, after a warm-up step)."""
    meter = MemoryMeter("cpu")
    stats = opt.hooks.stats if opt is not None else None
    lm_loss(model, batch).backward()  # allocates the gradients: the readings cover activations
    readings = [meter.measure(lambda: lm_loss(model, batch), stats) for _ in range(2)]
    model.zero_grad(set_to_none=True)
    return min(readings, key=lambda r: r.retained)


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "int4_drift.yaml"))
    parser.add_argument("--seconds", type=float, default=120, help="training time with memopt")
    parser.add_argument("--max-steps", type=int, default=2000, help="stop earlier at this step")
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
    printer = PrintLoss(every=10, label="memopt   ")
    memopt = MemOptCallback(args.config)
    t0 = time.perf_counter()
    fit = trainer(args.max_steps, args.seconds, [memopt, printer], root)
    fit.fit(model, train)
    memopt_seconds = time.perf_counter() - t0
    steps = fit.global_step
    memopt_val = validation_loss(model, val)
    escalations = int(memopt.state_dict()["drift"]["escalations"])
    final_bits = sorted(set(memopt.bits.values()))

    section(f"baseline: the same {steps} steps without memopt")
    pl.seed_everything(0, verbose=False)
    base_model = CharGPT(max_steps=args.max_steps)
    base_printer = PrintLoss(every=10, label="baseline  ")
    t0 = time.perf_counter()
    trainer(steps, args.seconds, [base_printer], root).fit(base_model, train)
    base_seconds = time.perf_counter() - t0
    base_val = validation_loss(base_model, val)

    section("result")

    def tail(losses: list[float]) -> float:
        last = losses[-20:]
        return sum(last) / max(1, len(last))

    print(f"{'':12}{'train loss (last 20)':>22}{'validation loss':>18}{'s/step':>9}")
    for name, losses, v, secs in (
        ("memopt", printer.losses, memopt_val, memopt_seconds),
        ("baseline", base_printer.losses, base_val, base_seconds),
    ):
        print(f"{name:12}{tail(losses):22.3f}{v:18.3f}{secs / max(1, steps):9.2f}")
    print(
        f"activation memory kept for backward: {with_memopt.retained / MIB:.1f} MiB with memopt, "
        f"{baseline.retained / MIB:.1f} MiB without; bits at the end: "
        f"{'/'.join(map(str, final_bits))}; escalations: {escalations}"
    )
    print(f"demo finished in {time.perf_counter() - started:.0f} s; logs in {root}/demo")


if __name__ == "__main__":
    main()
