"""Drift control in training: where each drift metric leaves the bits, and the loss it costs.

Issue 42's bar, measured in training on three workloads: our character GPT, the ResNet-style CNN
of ``harness/workloads.py`` (smaller than ``make bench``'s: :data:`SIZES`; the CNN's learning rate
:data:`CNN_LR`) and a client we did not write, karpathy/nanoGPT's ``model.py`` trained as its
``train.py`` does (:func:`~.harness.workloads.nanogpt_workload`). Each trains for ``--steps``
optimizer steps on paired seeds: every arm starts from the same weights and sees the same batches
and dropout masks on a seed, so the held-out loss compares seed by seed (:class:`stats.Paired`,
a 95% Student's t interval). The arms (:data:`ARMS`): the baseline; 4 bits without a guard and
with the drift section of ``configs/int4_drift.yaml`` under each metric (``sgd``, the default,
then ``cosine``, ``rel_l2``, ``noise``); 4 bits with ``quantize.budget``; 2 bits without a guard
and with the default guard.

The check runs where a plain loop runs ``check_drift(..., if_due=True)``: before the step's
forward, on the first ``sample_size`` samples of its batch, so the step of a check trains at the
bits it chose. Per run it records the bits after each check, the byte-weighted mean bits at the
end (``memopt/bits_mean``), how often each module changed width, and with a budget the bytes the
bits keep after each check: predicted by the check (``DriftReport.budget``) and measured by the
next training forward (``SavedStats.saved_stored``). Writes ``bits.md`` and ``bits.json`` to
``--out``.

    python -m benchmarks.bits_both_ways [--quick] [--steps 200] [--seeds N]
        [--workloads gpt,cnn,nano] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Before torch loads OpenMP: idle threads sleep instead of spinning (a shared machine).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from memopt_plugins import MemoryOptimizer  # noqa: E402
from memopt_plugins.tree import batch_size_of, slice_batch  # noqa: E402

from . import RESULTS  # noqa: E402
from .harness.sizes import FULL, QUICK, CNNSizes, CNNTraining, GPTSizes, GPTTraining, Sizes  # noqa: E402
from .harness.stats import Paired  # noqa: E402
from .harness.training import lr_factor  # noqa: E402
from .harness.workloads import (  # noqa: E402
    Workload,
    cnn_workload,
    evaluate,
    gpt_workload,
    nanogpt_workload,
    precise_batchnorm,
)

#: Smaller than ``make bench``'s convergence runs, so that four arms x seeds x two workloads of
#: 200 steps stay within minutes on two CPU cores.
SIZES = Sizes(
    gpt=GPTSizes(
        dim=64,
        depth=2,
        measure_batch=FULL.gpt.measure_batch,
        measure_len=FULL.gpt.measure_len,
        text_chars=FULL.gpt.text_chars,
        training=GPTTraining(batch=16, length=64, steps=200, val_batches=8),
    ),
    cnn=CNNSizes(
        width=16,
        measure_batch=FULL.cnn.measure_batch,
        training=CNNTraining(
            batch=32,
            steps=200,
            seeds=1,
            short_steps=1,
            short_seeds=1,
            bar_seeds=1,
            calibration=256,
        ),  # fmt: skip
    ),
)
#: The CNN's learning rate here (the harness's is 3e-3): at 3e-3 SmallResNet reaches a held-out
#: loss of 0.044 on digits in 200 steps, where 1% of it is 0.0004 and paired runs differ by 2-7%
#: of it (a 1% bar then measures nothing); at 5e-4 the loss is 0.44 and paired runs differ by 0.4%.
CNN_LR = 5e-4
#: Paired seeds per workload (``--seeds`` overrides all): the CNN's paired runs differ by about
#: 0.4% of the held-out loss (standard deviation), the GPTs' by about 0.05%.
SEEDS = {"gpt": 3, "cnn": 8, "nano": 3}
#: The drift section of configs/int4_drift.yaml (the preset the README starts with).
DRIFT = {
    "metric": "sgd",
    "threshold": 0.05,
    "check_every": 25,
    "sample_size": 8,
    "ladder": [4, 8, 16, 32],
    "lower": True,
    "lower_below": 0.8,
    "lower_after": 1,
}
BUDGET = 0.2  # of the saved bytes uncompressed; 4 bits keep about 13%


def _metric(metric: str) -> dict[str, Any]:
    return {"quantize": {"bits": 4}, "drift": {**DRIFT, "metric": metric}}


ARMS: dict[str, dict[str, Any] | None] = {
    "baseline": None,
    "int4, no guard": {"quantize": {"bits": 4}, "drift": {"enabled": False}},
    "int4, sgd (default)": _metric("sgd"),
    "int4, cosine": _metric("cosine"),
    "int4, rel_l2": _metric("rel_l2"),
    "int4, noise": _metric("noise"),
    "int4, sgd, budget": {"quantize": {"bits": 4, "budget": BUDGET}, "drift": DRIFT},
    "int2, no guard": {"quantize": {"bits": 2}, "drift": {"enabled": False}},
    "int2, sgd (default)": {"quantize": {"bits": 2}, "drift": DRIFT},
}
#: The bar (issue 42): with the default, int4 ends at most at these mean bits within 1% of the
#: baseline's held-out loss, a 2-bit start within 2%, and no module changes width more often.
BITS_BAR = 5.0
LOSS_BAR = 0.01
RESCUE_BAR = 0.02
MAX_CHANGES = 4
BUDGET_TOLERANCE = 0.05


@dataclass
class Run:
    """One arm on one seed."""

    arm: str
    seed: int
    loss: float = float("nan")
    seconds: float = 0.0
    bits_mean: float | None = None  # byte-weighted, at the end
    bits_plain: float | None = None  # unweighted, at the end
    changes: dict[str, int] = field(default_factory=dict)  # width changes per module
    escalations: int = 0
    deescalations: int = 0
    checks: list[dict[str, Any]] = field(default_factory=list)  # step, bits, budget, kept

    @property
    def max_changes(self) -> int:
        return max(self.changes.values(), default=0)


def train(workload: Workload, arm: str, seed: int, steps: int) -> Run:
    """One seeded training run of ``arm``; the held-out loss after precise BatchNorm."""
    config = ARMS[arm]
    model = copy.deepcopy(workload.build()).train()
    batches = workload.train_batches(seed)[:steps]
    torch.manual_seed(seed)
    opt = None
    if config is not None:
        opt = MemoryOptimizer(config)
        opt.apply(model)
    if workload.optimizer is not None:
        adamw = workload.optimizer(model, workload.lr)
    else:
        adamw = torch.optim.AdamW(model.parameters(), lr=workload.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(adamw, lr_factor(len(batches)))
    run = Run(arm, seed)
    pending: dict[str, Any] | None = None  # a check whose bits the next forward measures
    start = time.perf_counter()
    for step, batch in enumerate(batches):
        if opt is not None and opt.internal.should_check(step):  # before the step's own forward
            before = opt.bits
            sample = slice_batch(batch, opt.config.drift.sample_size)
            report = opt.check_drift(
                lambda s=sample: workload.loss_fn(model, s),
                step=step,
                batch_size=batch_size_of(batch),
            )
            after = opt.bits
            for fqn, bits in after.items():
                if bits != before[fqn]:
                    run.changes[fqn] = run.changes.get(fqn, 0) + 1
            pending = {"step": step, "max_drift": report.max, "bits": after}
            if report.budget is not None:
                pending["budget"], pending["kept"] = report.budget
            run.checks.append(pending)
        loss = workload.loss_fn(model, batch)
        loss.backward()
        if pending is not None:
            pending["measured"] = float(opt.internal.compression.stats.saved_stored)
            pending = None
        if workload.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), workload.clip)
        adamw.step()
        schedule.step()
        adamw.zero_grad(set_to_none=True)
        if opt is not None:
            opt.count_step()
    run.seconds = time.perf_counter() - start
    if opt is not None:
        metrics = opt.metrics()
        run.bits_mean = metrics["memopt/bits_mean"]
        run.bits_plain = statistics.fmean(opt.bits.values())
        run.escalations = int(metrics["memopt/escalations"])
        run.deescalations = int(metrics.get("memopt/lowerings", 0))
        opt.remove()
    precise_batchnorm(model, workload)
    run.loss = evaluate(model, workload)[0]
    return run


def budget_outcomes(runs: list[Run]) -> dict[str, Any] | None:
    """After each check with a budget: how many training forwards kept within 5% of it
    (measured), how many checks missed it with the threshold holding modules (the check's kept
    bytes over it: its WARNING names them), how many kept less than 95% of it, and the largest
    gap between the bytes the check predicted and the next forward's. The check at step 0 runs
    before any training forward: it solves the same fractions on its own sample, whose bytes are
    the sample's, not the batch's, so its bytes are not compared."""
    checks = [
        c for r in runs for c in r.checks if "budget" in c and "measured" in c and c["step"] > 0
    ]
    if not checks:
        return None
    within = [abs(c["measured"] / c["budget"] - 1) <= BUDGET_TOLERANCE for c in checks]
    held = [c["kept"] > (1 + BUDGET_TOLERANCE) * c["budget"] for c in checks]
    return {
        "checks": len(checks),
        "within": sum(within),
        "held": sum(h and not w for h, w in zip(held, within, strict=True)),
        "under": sum(not h and not w for h, w in zip(held, within, strict=True)),
        "predicted_gap": max(abs(c["measured"] / c["kept"] - 1) for c in checks),
        "worst_over": max(c["measured"] / c["budget"] - 1 for c in checks),
    }


def summarize(title: str, runs: list[Run]) -> dict[str, Any]:
    """Per arm: mean held-out loss, paired change against the baseline, bits, changes."""
    base = {r.seed: r.loss for r in runs if r.arm == "baseline"}
    arms: dict[str, Any] = {}
    for arm in ARMS:
        mine = [r for r in runs if r.arm == arm]
        pairs = [(r.loss, base[r.seed]) for r in mine]
        paired = Paired.of(pairs) if arm != "baseline" and len(pairs) > 1 else None
        arms[arm] = {
            "loss": statistics.fmean(r.loss for r in mine),
            "paired": None if paired is None else asdict(paired),
            "bits_mean": None
            if mine[0].bits_mean is None
            else statistics.fmean(r.bits_mean for r in mine),
            "bits_plain": None
            if mine[0].bits_plain is None
            else statistics.fmean(r.bits_plain for r in mine),
            "max_changes": max(r.max_changes for r in mine),
            "escalations": statistics.fmean(r.escalations for r in mine),
            "deescalations": statistics.fmean(r.deescalations for r in mine),
            "seconds": statistics.fmean(r.seconds for r in mine),
            "budget": budget_outcomes(mine),
        }
    return {"workload": title, "arms": arms}


def bar(summary: dict[str, Any]) -> dict[str, bool]:
    """Issue 42's bar on one workload (loss changes: the mean over paired seeds)."""
    arms = summary["arms"]
    base = arms["baseline"]["loss"]

    def change(arm: str) -> float:  # paired mean over seeds (one seed: the plain ratio)
        paired = arms[arm]["paired"]
        return arms[arm]["loss"] / base - 1 if paired is None else paired["change"]

    default = arms["int4, sgd (default)"]
    budget = arms["int4, sgd, budget"]["budget"]
    return {
        f"default int4 ends at <= {BITS_BAR} mean bits": default["bits_mean"] <= BITS_BAR,
        "default int4 within 1% of the baseline's loss": change("int4, sgd (default)") <= LOSS_BAR,
        "default from 2 bits within 2% of the baseline's loss": change("int2, sgd (default)")
        <= RESCUE_BAR,
        "int2 without the guard is harmed (> 2%)": change("int2, no guard") > RESCUE_BAR,
        f"no module changes width more than {MAX_CHANGES} times": max(
            a["max_changes"] for a in arms.values()
        )
        <= MAX_CHANGES,
        "budget: no check ends over it by more than 5%": budget is not None
        and budget["worst_over"] <= BUDGET_TOLERANCE,
    }


def markdown(results: list[dict[str, Any]], steps: int, seeds: int, seconds: float) -> str:
    lines = [
        "# Drift control in training: where the bits end, and what the loss says",
        "",
        "Written by `python -m benchmarks.bits_both_ways` (`make bench`); its docstring says how.",
        f"{steps} AdamW steps, paired seeds per arm (each workload's count below), CPU, "
        f"{seconds / 60:.1f} min in all.",
        f"Drift (configs/int4_drift.yaml's): {json.dumps(DRIFT)}; the other metrics' arms change "
        f"`metric` only; budget arm: `quantize.budget: {BUDGET}`.",
        "",
        "`vs baseline`: mean over seeds of the held-out loss over the baseline's on the same "
        "seed, minus 1, with its 95% interval. `bits`: mean bits at the end weighted by the bytes "
        "each module saves (unweighted in brackets). `changes`: the most width changes of any "
        "module between checks. `budget`: of the checks, after how many the next training "
        "forward kept within 5% of the budget (`saved_stored`, measured), how many missed it "
        "with the threshold holding modules (the check's WARNING names them), how many kept "
        "under 95% of it.",
    ]
    for result in results:
        lines += ["", f"## {result['workload']}", ""]
        lines += [f"{result.get('seeds', seeds)} paired seeds; learning rate {result['lr']:g}.", ""]
        lines += [
            "| arm | held-out loss | vs baseline | bits | changes | up / down | budget | s/run |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for arm, a in result["arms"].items():
            p = a["paired"]
            versus = "-" if p is None else f"{100 * p['change']:+.2f}% ± {100 * p['ci']:.2f}%"
            bits = (
                "-" if a["bits_mean"] is None else f"{a['bits_mean']:.2f} ({a['bits_plain']:.2f})"
            )
            b = a["budget"]
            budget = (
                "-"
                if b is None
                else f"{b['within']} within, {b['held']} held, {b['under']} under "
                f"(of {b['checks']})"
            )
            moves = (
                "-" if arm == "baseline" else f"{a['escalations']:.1f} / {a['deescalations']:.1f}"
            )
            lines.append(
                f"| {arm} | {a['loss']:.4f} | {versus} | {bits} | {a['max_changes']} | {moves} "
                f"| {budget} | {a['seconds']:.0f} |"
            )
        lines += ["", "Bar:", ""]
        lines += [f"- {name}: {'yes' if ok else 'NO'}" for name, ok in result["bar"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, a few steps")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--seeds", type=int, default=None, help="paired seeds per workload (default: SEEDS)"
    )
    parser.add_argument(
        "--workloads",
        default="gpt,cnn,nano",
        help="comma-separated subset of gpt,cnn,nano; the others' results in --out's bits.json "
        "are kept",
    )
    parser.add_argument("--out", default=str(RESULTS), help="folder for bits.md and bits.json")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (small models)")
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite bits.md from --out's bits.json"
    )
    parser.add_argument("--log", action="store_true", help="print memopt's INFO lines")
    args = parser.parse_args(argv)
    if args.log:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if args.report_only:
        saved = json.loads((out / "bits.json").read_text())
        for result in saved["workloads"]:
            result.update(summarize(result["workload"], [Run(**r) for r in result["runs"]]))
            result["bar"] = bar(result)
        (out / "bits.md").write_text(
            markdown(saved["workloads"], saved["steps"], saved["seeds"], saved["seconds"])
        )
        return 0
    sizes = (QUICK if args.quick else SIZES).with_train_steps(args.steps)
    chosen = args.workloads.split(",")
    workloads = {
        "gpt": gpt_workload(sizes),
        "cnn": dataclasses.replace(cnn_workload(sizes), lr=CNN_LR),
        "nano": nanogpt_workload(sizes),
    }
    unknown = set(chosen) - set(workloads)
    if unknown:
        parser.error(
            f"--workloads: unknown {', '.join(sorted(unknown))} "
            f"(choose from {', '.join(workloads)})"
        )
    out = Path(args.out)
    kept = {}
    if set(chosen) != set(workloads) and (out / "bits.json").exists():
        kept = {r["key"]: r for r in json.loads((out / "bits.json").read_text())["workloads"]}
    results = []
    for key in workloads:
        if key not in chosen:
            if key in kept:
                results.append(kept[key])
            continue
        workload = workloads[key]
        seeds = args.seeds or SEEDS[key]
        began = time.perf_counter()
        runs = []
        for seed in range(seeds):
            for arm in ARMS:
                run = train(workload, arm, seed, args.steps)
                print(
                    f"{workload.key} seed {seed} {arm}: loss {run.loss:.4f}, bits "
                    f"{run.bits_mean}, max changes {run.max_changes}, {run.seconds:.0f} s",
                    flush=True,
                )
                runs.append(run)
        summary = summarize(workload.title, runs)
        summary["bar"] = bar(summary)
        summary.update(key=key, seeds=seeds, lr=workload.lr, seconds=time.perf_counter() - began)
        summary["runs"] = [asdict(r) for r in runs]
        results.append(summary)
    seconds = sum(r["seconds"] for r in results)
    out.mkdir(parents=True, exist_ok=True)
    saved = {"steps": args.steps, "seeds": args.seeds, "seconds": seconds, "workloads": results}
    (out / "bits.json").write_text(json.dumps(saved, indent=1) + "\n")
    (out / "bits.md").write_text(markdown(results, args.steps, args.seeds, seconds))
    print(f"wrote {out / 'bits.md'} ({seconds / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
