"""BatchNorm ``running`` mode vs ``batch`` mode: test accuracy of a small CNN on real data.

scikit-learn's bundled handwritten digits (1797 images, 8×8, 10 classes; no download), a
conv → BN → ReLU network, AdamW with a cosine schedule. Both modes train from the same initial
weights on the same batches; ``running`` switches after ``--warmup`` optimizer steps (the engine
counts them through ``MemoryOptimizer.count_step``). Several seeds, since a test split of 360
images moves 0.28 points per image. Writes a markdown table (``--out``).

    python -m benchmarks.batchnorm_digits --out benchmarks/batchnorm.md
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from memopt_plugins import MemoryOptimizer
from memopt_plugins.profiler.meter import MemoryMeter

from . import RESULTS
from .harness.memory import least_retained


def digits(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_test, y_test): images scaled to [0, 1], shape (N, 1, 8, 8)."""
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y
    )
    return x_train, y_train, x_test, y_test


def cnn() -> nn.Module:
    def block(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]

    return nn.Sequential(
        *block(1, 16),
        *block(16, 32),
        nn.MaxPool2d(2),
        *block(32, 64),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


def train(seed: int, config: dict | None, epochs: int, batch_size: int) -> tuple[float, float, int]:
    """Test accuracy (%), seconds per epoch and optimizer steps of one run."""
    x_train, y_train, x_test, y_test = digits()
    torch.manual_seed(seed)
    model = cnn()
    opt = MemoryOptimizer(config) if config is not None else None
    if opt is not None:
        opt.apply(model)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(adamw, epochs)
    order = torch.Generator().manual_seed(seed)
    steps = 0
    start = time.perf_counter()
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(len(x_train), generator=order).split(batch_size):
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            adamw.zero_grad(set_to_none=True)
            loss.backward()
            adamw.step()
            steps += 1
            if opt is not None:
                opt.count_step()
        sched.step()
    seconds = (time.perf_counter() - start) / epochs
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item() * 100
    if opt is not None:
        opt.remove()
    return accuracy, seconds, steps


def retained_bytes(config: dict | None, batch_size: int = 512) -> tuple[int, int]:
    """(retained, peak) bytes of one training step of the CNN on a batch of digits."""
    x, y, _, _ = digits()
    x, y = x[:batch_size], y[:batch_size]
    torch.manual_seed(0)
    model = cnn()
    opt = MemoryOptimizer(config) if config is not None else None
    if opt is not None:
        opt.apply(model)
    F.cross_entropy(model(x), y).backward()  # gradients allocated before measuring
    best = least_retained(MemoryMeter("cpu"), lambda: F.cross_entropy(model(x), y), 3)
    if opt is not None:
        opt.remove()
    return best.retained, best.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=200, help="optimizer steps in batch mode")
    parser.add_argument("--out", type=Path, default=RESULTS / "batchnorm.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)  # tiny tensors: threads only add noise

    running = {"batchnorm": {"mode": "running", "warmup_steps": args.warmup}}
    rows = []
    for seed in range(args.seeds):
        acc_b, sec_b, steps = train(seed, None, args.epochs, args.batch_size)
        acc_r, sec_r, _ = train(seed, running, args.epochs, args.batch_size)
        rows.append((seed, acc_b, acc_r, sec_b, sec_r))
        print(f"seed {seed}: batch {acc_b:.2f}%  running {acc_r:.2f}%  ({steps} steps)")
    mean_b = statistics.mean(r[1] for r in rows)
    mean_r = statistics.mean(r[2] for r in rows)
    print(f"mean: batch {mean_b:.2f}%  running {mean_r:.2f}%  difference {mean_r - mean_b:+.2f}")
    logging.getLogger("memopt").setLevel(logging.ERROR)  # warmup 0 on fresh statistics: known
    mem_b = retained_bytes(None)
    mem_r = retained_bytes({"batchnorm": {"mode": "running"}})
    print(f"retained: batch {mem_b[0]} B, running {mem_r[0]} B ({mem_b[0] / mem_r[0]:.2f}x)")

    lines = [
        "# BatchNorm `running` mode vs `batch` mode on real data",
        "",
        "`python -m benchmarks.batchnorm_digits` — scikit-learn's bundled handwritten digits "
        "(1797 images of 8×8, 80/20 stratified split, 360 test images), a three-block "
        "conv → BN → ReLU CNN, AdamW (lr 1e-3, weight decay 1e-4, cosine schedule), "
        f"batch size {args.batch_size}, {args.epochs} epochs = {steps} optimizer steps. "
        f"`running` uses batch statistics for the first {args.warmup} steps "
        "(`batchnorm.warmup_steps`), then normalizes with the running statistics, frozen from "
        "then on. Same initial weights and batch order per seed; accuracy in eval mode.",
        "",
        "| seed | batch: test accuracy | running: test accuracy | difference |",
        "| ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {seed} | {acc_b:.2f}% | {acc_r:.2f}% | {acc_r - acc_b:+.2f} |"
        for seed, acc_b, acc_r, _, _ in rows
    ]
    lines += [
        f"| **mean** | **{mean_b:.2f}%** | **{mean_r:.2f}%** | **{mean_r - mean_b:+.2f}** |",
        "",
        f"Bar: the mean accuracies within 0.5 points — "
        f"{'met' if abs(mean_r - mean_b) <= 0.5 else 'NOT met'} ({abs(mean_r - mean_b):.2f}).",
        "",
        "Memory of one training step of this CNN on 512 digits (CPU RSS, read as "
        "docs/peak-and-planning.md says; "
        "every BN here is followed by a ReLU, so running mode keeps no BN tensor):",
        "",
        "| mode | retained | peak |",
        "| --- | ---: | ---: |",
        f"| batch | {mem_b[0] / 2**20:.2f} MiB | {mem_b[1] / 2**20:.2f} MiB |",
        f"| running | {mem_r[0] / 2**20:.2f} MiB | {mem_r[1] / 2**20:.2f} MiB |",
        f"| batch ÷ running | {mem_b[0] / mem_r[0]:.2f}× | {mem_b[1] / mem_r[1]:.2f}× |",
        "",
        "Median seconds per epoch (CPU, one thread, batch 64 of 8×8 images: per-layer Python "
        "overhead dominates at this size): batch "
        f"{statistics.median(r[3] for r in rows):.3f}, running "
        f"{statistics.median(r[4] for r in rows):.3f}.",
        "",
    ]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
