"""Compile time of memopt's graphs against the compiled baseline's (writes compile_time.md).

The model of ``compiled_gap.py`` (Hugging Face GPT-2 4 x 256, batch 8 x 256, vocabulary 2048),
SDPA attention as transformers builds it, compiled per block and whole, without memopt, with int8
nearest and with int4 (stochastic rounding, the default). Each (mode, method) runs in a fresh
process with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR`` a new temporary directory): its
compile time is the first training step's wall time (it compiles) minus the third's. A mode's
methods run back to back, ``--repeats`` rounds of them, so the ratios to that mode's baseline
compare runs under the same load of the machine; each row gives the median and the range.

    python -m benchmarks.compile_time --out benchmarks
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from . import ROOT
from .compiled_gap import build, compile_model, model_arguments
from .harness.methods import declared
from .harness.timing import seconds

#: The methods by name, drift off.
METHODS = {
    m.name: m
    for m in (
        declared("baseline"),
        declared("int8 nearest", {"quantize": {"bits": 8, "rounding": "nearest"}}),
        declared("int4 stochastic", {"quantize": {"bits": 4}}),
    )
}
MODES = ("per-block", "whole")


def run_case(args: argparse.Namespace) -> dict:
    """Wall seconds of three training steps of one (mode, method), the first compiling."""
    torch.set_num_threads(args.threads)
    model, batch = build(args)
    METHODS[args.method].apply(model, None, None, steady=False)
    compile_model(model, args.mode)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=batch, labels=batch).loss.backward()

    steps = [seconds(step) for _ in range(3)]
    return {"steps": steps, "compile": steps[0] - steps[-1]}


def case_in_child(args: argparse.Namespace, mode: str, method: str) -> dict:
    """:func:`run_case` in a fresh interpreter with an empty inductor cache."""
    command = [sys.executable, "-m", "benchmarks.compile_time", "--case", mode, "--method", method]
    for flag in ("layers", "dim", "batch", "seq", "vocab", "threads", "dropout", "attention"):
        command += [f"--{flag}", str(getattr(args, flag))]
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        done = subprocess.run(
            command, check=True, cwd=ROOT, env=env, capture_output=True, text=True
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(args: argparse.Namespace, rows: list[dict], load: tuple[float, float]) -> str:
    lines = [
        "# Compile time of memopt's graphs against the compiled baseline",
        "",
        f"`python -m benchmarks.compile_time` (torch {torch.__version__}): Hugging Face GPT-2 "
        f"{args.layers} x {args.dim}, batch {args.batch} x {args.seq}, vocabulary {args.vocab}, "
        f"{args.attention} attention, dropout {args.dropout}, {args.threads} thread(s). Each row "
        "is a fresh process with an empty inductor cache; *compile* is the first training step's "
        "wall time minus the third's. A mode's rows ran back to back; the machine's load average "
        f"was {load[0]:.1f} before and {load[1]:.1f} after ({os.cpu_count()} CPUs), so the ratios "
        "say more than the seconds.",
        "",
        "| mode | method | runs | third step s | compile s (range) | compile vs baseline |",
        "|---|---|--:|--:|--:|--:|",
    ]
    cases: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        cases.setdefault((r["mode"], r["method"]), []).append(r)
    base = {m: statistics.median(r["compile"] for r in runs)
            for (m, method), runs in cases.items() if method == "baseline"}  # fmt: skip
    for (mode, method), runs in cases.items():
        compile_s = [r["compile"] for r in runs]
        median = statistics.median(compile_s)
        lines.append(
            f"| {mode} | {method} | {len(runs)} "
            f"| {statistics.median(r['steps'][-1] for r in runs):.2f} "
            f"| {median:.1f} ({min(compile_s):.1f}–{max(compile_s):.1f}) "
            f"| {median / base[mode]:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser, MODES)
    parser.add_argument("--out", type=Path, help="folder for compile_time.md (else stdout)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=sorted(METHODS), help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of every (mode, method)")
    parser.set_defaults(attention="sdpa")
    args = parser.parse_args()
    if args.case:
        args.mode = args.case
        print(json.dumps(run_case(args)))
        return
    rows, before = [], os.getloadavg()[0]
    for mode in args.modes.split(","):
        for _ in range(args.repeats):
            for method in METHODS:
                row = {"mode": mode, "method": method, **case_in_child(args, mode, method)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    text = report(args, rows, (before, os.getloadavg()[0]))
    if args.out is None:
        print(text)
    else:
        (args.out / "compile_time.md").write_text(text)


if __name__ == "__main__":
    main()
