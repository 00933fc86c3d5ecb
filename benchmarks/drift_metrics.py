"""Which drift metric: the bits each one settles at, and the held-out loss after training there.

Every workload (our GPT, Hugging Face GPT-2, the digits CNN) trains from the same initial weights
on the same batches per seed: uncompressed (the baseline) and from 4 bits with the drift check on
(``check_every`` steps, ``sample_size`` 8, threshold 0.05) under each metric. Reported per
metric: the mean bits of the compressed modules at the end, the held-out loss against the
baseline's on the same seed (mean change and its 95% interval, :class:`stats.Paired`), and the
checks' cost in training steps (their time over the median step's). Small sizes: a few minutes on
two CPU cores. Writes ``benchmarks/drift_metrics.md``.

    python -m benchmarks.drift_metrics [--steps 60] [--seeds 3]
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from memopt_plugins import MemoryOptimizer
from memopt_plugins.tree import slice_batch

from . import RESULTS
from .harness import sizes as sizes_module
from .harness.stats import Paired
from .harness.timing import seconds
from .harness.training import lr_factor
from .harness.workloads import (
    Workload,
    cnn_workload,
    evaluate,
    gpt_workload,
    hf_gpt2_workload,
    precise_batchnorm,
)

METRICS = ("rel_l2", "cosine", "noise")
OUT = RESULTS / "drift_metrics.md"


def small_sizes(steps: int) -> sizes_module.Sizes:
    gpt = sizes_module.GPTSizes(
        dim=64,
        depth=2,
        measure_batch=8,
        measure_len=64,
        text_chars=400_000,
        training=sizes_module.GPTTraining(batch=16, length=64, steps=steps, val_batches=8),
    )
    cnn_training = sizes_module.CNNTraining(
        batch=32,
        steps=steps,
        seeds=1,
        short_steps=steps,
        short_seeds=1,
        bar_seeds=1,
        calibration=256,
    )
    return sizes_module.Sizes(gpt=gpt, cnn=sizes_module.CNNSizes(16, 64, cnn_training))


@dataclass
class Run:
    loss: float
    bits: float  # mean over the compressed modules at the end (32 for the baseline)
    check_steps: float  # one check's time in median training steps


def train(workload: Workload, metric: str | None, seed: int, check_every: int) -> Run:
    model = copy.deepcopy(PRISTINE[workload.key])
    batches = workload.train_batches(seed)
    torch.manual_seed(seed)
    config = {"quantize": {"bits": 4}, "drift": {"metric": metric, "check_every": check_every}}
    opt = MemoryOptimizer(config if metric else None)
    opt.apply(model)
    adamw = torch.optim.AdamW(model.parameters(), lr=workload.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(adamw, lr_factor(len(batches)))
    step_times, check_times = [], []
    cpu = torch.device("cpu")

    def step(batch: Any) -> None:
        adamw.zero_grad(set_to_none=True)
        workload.loss_fn(model, batch).backward()

    def check(batch: Any) -> None:
        opt.check_drift(lambda: workload.loss_fn(model, slice_batch(batch, 8)))

    for batch in batches:
        step_times.append(seconds(functools.partial(step, batch), cpu))
        if metric and opt.internal.should_check():
            check_times.append(seconds(functools.partial(check, batch), cpu))
        adamw.step()
        schedule.step()
        opt.count_step()
    bits = statistics.fmean(opt.bits.values()) if opt.bits else 32.0
    opt.remove()
    if workload.calibration:
        precise_batchnorm(model, workload)
    loss = evaluate(model, workload)[0]
    return Run(loss, bits, statistics.fmean(check_times or [0.0]) / statistics.median(step_times))


PRISTINE: dict = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--check-every", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(2)
    s = small_sizes(args.steps)
    workloads = [gpt_workload(s), hf_gpt2_workload(s, trained=True), cnn_workload(s)]
    lines = [
        "# Which drift metric",
        "",
        f"`python -m benchmarks.drift_metrics --steps {args.steps} --seeds {args.seeds} "
        f"--check-every {args.check_every}`: AdamW for {args.steps} steps from 4 bits (drift "
        f"threshold 0.05, sample 8, a check every {args.check_every} steps) against the "
        f"uncompressed baseline on the same seeds ({args.seeds}: data order, dropout, codec "
        "noise). Held-out loss: mean change against the baseline's, with its 95% interval.",
        "",
        "| workload | metric | mean bits at the end | held-out loss | change vs baseline "
        "(95% CI) | worse seeds | checks' cost (steps) |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload in workloads:
        PRISTINE[workload.key] = workload.build().train()
        seeds = range(args.seeds)
        base = [train(workload, None, seed, args.check_every) for seed in seeds]
        mean_base = statistics.fmean(r.loss for r in base)
        lines.append(f"| {workload.label} | baseline (32) | 32 | {mean_base:.4f} | | | |")
        for metric in METRICS:
            runs = [train(workload, metric, seed, args.check_every) for seed in seeds]
            paired = Paired.of([(r.loss, b.loss) for r, b in zip(runs, base, strict=True)])
            lines.append(
                f"| {workload.label} | {metric} | {statistics.fmean(r.bits for r in runs):.2f} "
                f"| {statistics.fmean(r.loss for r in runs):.4f} "
                f"| {100 * paired.change:+.2f}% ± {100 * paired.ci:.2f}% "
                f"| {paired.worse}/{paired.seeds} "
                f"| {statistics.fmean(r.check_steps for r in runs):.1f} per check |"
            )
            print(lines[-1], flush=True)
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
