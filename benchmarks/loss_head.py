"""The loss head side by side: memopt's chunked loss, PyTorch's own, and the unfused one.

``memopt_plugins.lean.linear_cross_entropy`` against PyTorch's ``F.linear_cross_entropy`` on its
chunked path (``options=torch.nn.LinearCrossEntropyOptions()``, PyTorch 2.13) and against
``F.cross_entropy(F.linear(...))``: fp32, one thread, forward + backward of the mean loss over
``tokens x hidden`` states and ``classes`` classes (no bias, no ignored targets).

* peak: each (shape, implementation) in a fresh process (glibc's malloc returning freed blocks at
  once, ``harness.memory.MALLOC_ENV``), one warm-up step, then the least of two readings of the
  process's high-water mark over a step above what it held before
  (:class:`~memopt_plugins.profiler.meter.MemoryMeter`);
* time: per shape one fresh process runs the implementations in turn, a warm-up step each and
  then ``--repeats`` rounds, and keeps each one's median step (interleaved, so that load from
  other processes falls on both alike);
* the loss and gradients of both chunked ones against the unfused ones (largest relative error).

Writes ``loss_head.md`` and ``loss_head.json`` to ``--out``.

    python -m benchmarks.loss_head [--quick] [--out DIR] [--repeats N]
    python -m benchmarks.loss_head --cpu-time 8192x512x32000 [--repeats N] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from memopt_plugins.lean.loss import linear_cross_entropy
from memopt_plugins.profiler.meter import MemoryMeter

from . import RESULTS
from .harness.memory import in_fresh_process
from .harness.paired import timed
from .harness.timing import seconds

MIB = 1 << 20
#: (tokens, hidden, classes); the unfused loss only where its logits are small enough to run.
SHAPES = [(2048, 128, 8192), (4096, 256, 32000), (8192, 512, 32000)]
QUICK_SHAPES = [(512, 64, 2048), (1024, 128, 8192)]
UNFUSED_UP_TO = 4096 * 32000  # logits elements: beyond, three of them (GiBs) are not run
IMPLEMENTATIONS = ("memopt", "torch", "unfused")


def _loss(name: str) -> Callable[..., torch.Tensor]:
    if name == "memopt":
        return lambda h, w, t: linear_cross_entropy(h, w, t)
    if name == "torch":
        options = torch.nn.LinearCrossEntropyOptions()
        return lambda h, w, t: F.linear_cross_entropy(h, w, t, options=options)
    return lambda h, w, t: F.cross_entropy(F.linear(h, w), t)


def _inputs(tokens: int, hidden: int, classes: int):
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=generator).requires_grad_()
    w = (torch.randn(classes, hidden, generator=generator) / hidden**0.5).requires_grad_()
    return h, w, torch.randint(0, classes, (tokens,), generator=generator)


def _step(loss: Callable[..., torch.Tensor], h, w, t) -> torch.Tensor:
    h.grad = w.grad = None
    out = loss(h, w, t)
    out.backward()
    return out.detach()


def peak_child(name: str, shape: tuple[int, int, int]) -> dict[str, float]:
    """In the child process: the step's peak above what it held before, in MiB."""
    h, w, t = _inputs(*shape)
    loss = _loss(name)
    _step(loss, h, w, t)  # warm-up: the gradients' memory, the library's first calls
    meter = MemoryMeter("cpu")
    readings = []
    for _ in range(2):
        h.grad = w.grad = None  # as a training step after zero_grad(set_to_none=True)
        readings.append(meter.measure(lambda: loss(h, w, t)).peak)
    return {"peak_mib": min(readings) / MIB}


def time_child(shape: tuple[int, int, int], names: list[str], repeats: int) -> dict[str, float]:
    """In the child process: each implementation's median step in seconds, interleaved."""
    h, w, t = _inputs(*shape)
    losses = {n: _loss(n) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    for n in names:
        _step(losses[n], h, w, t)
    for _ in range(repeats):
        for n in names:
            times[n].append(seconds(lambda n=n: _step(losses[n], h, w, t)))
    return {n: statistics.median(v) for n, v in times.items()}


def cpu_child(name: str, shape: tuple[int, int, int], steps: int) -> dict[str, list[float]]:
    """In the child process: the thread CPU time of each step after a warm-up, in seconds (on a
    loaded machine the wall clock counts other processes' time; this thread's CPU time does not)."""
    h, w, t = _inputs(*shape)
    loss = _loss(name)
    _step(loss, h, w, t)
    return {"cpu_s": [timed(lambda: _step(loss, h, w, t))[0] for _ in range(steps)]}


def cpu_time(shape: str, repeats: int, steps: int) -> dict[str, float]:
    """Each implementation's median step in thread CPU time: a fresh process per implementation
    and repeat, memopt and torch in turn (the first of them alternating)."""
    import tempfile

    seconds: dict[str, list[float]] = {"memopt": [], "torch": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for name in ("memopt", "torch")[:: 1 if r % 2 == 0 else -1]:
                seconds[name] += _run_child(Path(tmp), "cpu", shape, name, str(steps))["cpu_s"]
    return {n: statistics.median(v) for n, v in seconds.items()}


def agreement(shape: tuple[int, int, int]) -> dict[str, float]:
    """The largest relative error of loss and gradients of each chunked loss against unfused."""
    h, w, t = _inputs(*shape)
    ref_loss = _step(_loss("unfused"), h, w, t)
    ref = [h.grad.clone(), w.grad.clone()]
    errors = {}
    for name in ("memopt", "torch"):
        value = _step(_loss(name), h, w, t)
        error = float((value - ref_loss).abs() / ref_loss.abs())
        for mine, theirs in zip((h.grad, w.grad), ref, strict=True):
            error = max(error, float((mine - theirs).abs().max() / theirs.abs().max()))
        errors[name] = error
    return errors


def _child(args: list[str]) -> dict:
    out = Path(args[1])
    torch.set_num_threads(1)
    shape = tuple(int(x) for x in args[2].split("x"))
    if args[0] == "peak":
        result = peak_child(args[3], shape)
    elif args[0] == "cpu":
        result = cpu_child(args[3], shape, int(args[4]))
    elif args[0] == "time":
        result = time_child(shape, args[3].split(","), int(args[4]))
    else:
        result = agreement(shape)
    out.write_text(json.dumps(result))
    return result


def _run_child(tmp: Path, *args: str) -> dict:
    path = tmp / "child.json"
    in_fresh_process("benchmarks.loss_head", ["--child", args[0], str(path), *args[1:]])
    return json.loads(path.read_text())


def markdown(rows: list[dict], repeats: int) -> str:
    lines = [
        "# The loss head: memopt's chunked loss, PyTorch's, unfused",
        "",
        f"Generated by `python -m benchmarks.loss_head`: torch {torch.__version__}, CPU, fp32, one "
        "thread, forward + backward of the mean loss (no bias). Peak: a fresh process per "
        "implementation and shape, the high-water mark of a step above what the process held "
        "before (the least of two). Time: the median of "
        f"{repeats} steps, the implementations interleaved in one process per shape. `torch` is "
        "`F.linear_cross_entropy(..., options=torch.nn.LinearCrossEntropyOptions())` (its "
        "chunked path, defaults resolved per device); `unfused` is "
        "`F.cross_entropy(F.linear(...))`, run only where its three logits-sized tensors are "
        "small. `error`: the largest relative error of loss and gradients against unfused.",
        "",
        "| tokens x hidden x classes | peak memopt MiB | peak torch MiB | peak unfused MiB "
        "| time memopt s | time torch s | memopt / torch time | error memopt | error torch |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        unfused = f"{r['peak_mib']['unfused']:.0f}" if "unfused" in r["peak_mib"] else "-"
        error = r.get("error", {})
        lines.append(
            f"| {r['shape']} | {r['peak_mib']['memopt']:.1f} | {r['peak_mib']['torch']:.1f} | "
            f"{unfused} | {r['seconds']['memopt']:.3f} | {r['seconds']['torch']:.3f} | "
            f"{r['seconds']['memopt'] / r['seconds']['torch']:.2f} | "
            + (f"{error['memopt']:.1e} | {error['torch']:.1e} |" if error else "- | - |")
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        _child(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu-time", metavar="TxHxV", help="only the CPU-time comparison")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per process")
    args = parser.parse_args(argv)
    if args.cpu_time:
        seconds = cpu_time(args.cpu_time, args.repeats, args.steps)
        print(json.dumps({**seconds, "memopt / torch": seconds["memopt"] / seconds["torch"]}))
        return 0
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in QUICK_SHAPES if args.quick else SHAPES:
            text = "x".join(map(str, shape))
            unfused = shape[0] * shape[2] <= UNFUSED_UP_TO
            names = [n for n in IMPLEMENTATIONS if n != "unfused" or unfused]
            peaks = {n: _run_child(Path(tmp), "peak", text, n)["peak_mib"] for n in names}
            seconds = _run_child(Path(tmp), "time", text, "memopt,torch", str(args.repeats))
            row = {"shape": text.replace("x", " x "), "peak_mib": peaks, "seconds": seconds}
            if unfused:
                row["error"] = _run_child(Path(tmp), "agree", text)
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loss_head.json").write_text(json.dumps(rows, indent=2) + "\n")
    (args.out / "loss_head.md").write_text(markdown(rows, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
