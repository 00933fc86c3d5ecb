"""memopt on a CUDA GPU: builds and tests, codec throughput, memory and step time.

    python -m benchmarks.cuda [--out benchmarks/results-cuda.md] [--device cuda[:i]]

The one script for a lent GPU (a few minutes). 0. Builds and tests: every Triton kernel
specialization compiled ahead of time for sm_80, sm_90 and the device's architecture
(``memopt_plugins.compress.codec.cuda_build``: failures, spills), then ``pytest`` of the CUDA
tests (``tests/test_cuda_codec.py``, ``tests/test_cuda_training.py``), each in a child process;
their summary lines go into the report.

1. Codec throughput: quantize (nearest and stochastic) and decode of 2**26 elements, the Triton
   kernels against the torch reference (``harness.timing.median_seconds``), and a device copy of
   the same tensor as the bandwidth to compare with.

2. Memory and step time, on the bench's GPT and CNN (``harness/workloads.py`` at the bench's
   sizes and at a GPU-sized scale-up), in float32 and under bf16 autocast: the baseline and
   memopt at 8/4/2 bits and the combined preset, each on its own copy
   (``harness.measured.Measured``). Peak is ``max_memory_allocated`` over a step and retained is
   ``memory_allocated`` after the forward, both above what the step started with (gradients
   allocated by a warm-up step; ``harness.memory.read_memory``); ratios are the baseline's ÷ the
   method's. Step time is the median forward + backward (``harness.timing.time_steps``:
   round-robin after a warm-up), as a ratio to the baseline of the same precision, with the
   Triton codec and again with ``MEMOPT_CODEC=torch``; the gradient error is against that
   baseline (``harness.gradients``). On CUDA also Hugging Face GPT-2 (``hf_gpt2_workload``) at
   the GPU-sized scale under bf16 autocast.

Correctness on the GPU (the Triton kernels' bytes, unbiased rounding, dropout's one mask, exact
recompute, drift) is tested by ``tests/test_cuda_codec.py`` and ``tests/test_cuda_training.py``,
which skip without CUDA. ``python -m benchmarks.run --device cuda`` runs the whole bench on the GPU.

Writes ``--out`` (markdown). Without a CUDA device it says so and exits with status 2.
``--device cpu`` runs the build check and section 2 on tiny sizes, for checking this script
where there is no GPU (no memory figures); it writes nothing unless ``--out`` is given. Timings
are reported, never asserted.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from memopt_plugins.compress.codec import ops

from . import RESULTS
from .harness.gradients import gradient_errors
from .harness.measured import (
    FULL_SETTINGS,
    QUICK_SETTINGS,
    Measured,
    Settings,
    describe_device,
    failure,
)
from .harness.memory import one_step, read_memory
from .harness.methods import BASELINE, INT2, INT4, INT8, METHODS, under_autocast
from .harness.sizes import FULL, QUICK
from .harness.timing import median_seconds, time_steps
from .harness.workloads import Workload, cnn_workload, gpt_workload, hf_gpt2_workload

PRESET = "memopt combined preset"
MEASURED = (BASELINE, INT8, INT4, INT2, PRESET)
#: The bench's sizes scaled up until kernels, not launches, take a step's time on a GPU.
GPU_SIZED = replace(
    FULL,
    gpt=replace(FULL.gpt, dim=512, depth=8, measure_batch=64),
    cnn=replace(FULL.cnn, width=128, measure_batch=1024),
)


ROOT = Path(__file__).resolve().parents[1]
CUDA_TESTS = ("tests/test_cuda_codec.py", "tests/test_cuda_training.py")


def _child(args: list[str], timeout: float) -> tuple[int, str]:
    """Exit status and output of ``python args`` in the repository root, without the Triton
    interpreter (the kernels must compile for the GPU)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        done = subprocess.run(
            [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout:.0f} s"
    return done.returncode, done.stdout + done.stderr


def build_check(device: torch.device) -> list[str]:
    """Section 0, the builds: every kernel specialization for sm_80, sm_90 and this device."""
    archs = {80, 90}
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        archs.add(10 * major + minor)
    jobs = str(os.cpu_count() or 1)
    args = ["-m", "memopt_plugins.compress.codec.cuda_build", "--jobs", jobs, "--arch"]
    status, output = _child([*args, *map(str, sorted(archs))], timeout=300)
    lines = output.strip().splitlines() or ["no output"]
    problems = [line for line in lines[:-1] if "FAILED" in line or "spilled" in line]
    return [f"- Ahead-of-time builds (exit {status}): {lines[-1]}", *problems[:20]]


def test_check() -> list[str]:
    """Section 0, the tests: the CUDA tests' pytest summary line."""
    status, output = _child(["-m", "pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS], 300)
    last = output.strip().splitlines()[-1] if output.strip() else "no output"
    return [f"- `pytest {' '.join(CUDA_TESTS)}` (exit {status}): {last}"]


@contextmanager
def codec(name: str) -> Iterator[None]:
    """``MEMOPT_CODEC=name`` inside the block (the codec reads the variable once, at import:
    :data:`~memopt_plugins.compress.codec.ops.REQUESTED` is what it goes by)."""
    before = ops.REQUESTED
    ops.REQUESTED = name
    try:
        yield
    finally:
        ops.REQUESTED = before


def _codec_seconds(x: torch.Tensor, bits: int, device: torch.device) -> list[float]:
    """Median seconds of quantize (nearest, stochastic) and decode of ``x`` in groups of 256."""
    packed = ops.quantize(x, bits, 256, None)
    return [
        median_seconds(lambda: ops.quantize(x, bits, 256, None), device),
        median_seconds(lambda: ops.quantize(x, bits, 256, 7), device),
        median_seconds(lambda: ops.dequantize(*packed, bits, 256, x.numel(), x.dtype), device),
    ]


def codec_throughput(device: torch.device) -> list[str]:
    """Section 1 as markdown rows: 2**26 elements, the torch reference against Triton."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2**26, device=device).to(dtype)
        gigabytes = x.numel() * x.element_size() / 1e9
        copy = median_seconds(x.clone, device)  # reads and writes x: the bandwidth to compare
        rows.append(
            f"| device copy | {str(dtype)[6:]} | - | - | {copy * 1e3:.2f} | "
            f"{gigabytes / copy:.0f} (read) | - |"
        )
        for bits in (8, 4):
            with codec("torch"):
                reference = _codec_seconds(x, bits, device)
            with codec("triton"):
                kernels = _codec_seconds(x, bits, device)
            calls = ("quantize (nearest)", "quantize (stochastic)", "decode")
            for call, ref, fused in zip(calls, reference, kernels, strict=True):
                rows.append(
                    f"| {call} | {str(dtype)[6:]} | {bits} | {ref * 1e3:.2f} | "
                    f"{fused * 1e3:.2f} | {gigabytes / fused:.0f} | {ref / fused:.1f}x |"
                )
    return rows


def measure_workload(
    workload: Workload, device: torch.device, settings: Settings, autocast: bool
) -> list[str]:
    """Markdown rows for the measured methods of one workload at one precision."""
    methods = [m for m in METHODS if m.name in MEASURED]
    if autocast:
        methods = [under_autocast(m, "cuda") for m in methods]
    measured = Measured(workload, methods, device)
    one_step(measured, workload)  # allocates the gradients: the readings cover activations
    memory: dict[int, tuple[float, float]] = {}
    if device.type == "cuda":  # CPU memory: benchmarks.run (a child process, malloc tuned)
        readings = read_memory(measured, workload, device, repeats=1)
        memory = {i: (float(r.retained), float(r.peak)) for i, r in readings.items()}
    errors = gradient_errors(measured, workload)
    times = time_steps(measured, workload, settings, device)
    with codec("torch"):
        torch_times = time_steps(measured, workload, settings, device)
    rows = []
    for i, method in enumerate(methods):
        if i in measured.errors:
            rows.append(f"| {method.name} | failed: {measured.errors[i]} |" + " |" * 7)
            continue
        retained, peak = memory.get(i, (math.nan, math.nan))
        base_retained, base_peak = memory.get(0, (math.nan, math.nan))
        rows.append(
            f"| {method.name} | {_mib(peak)} | {_ratio(base_peak, peak)} | "
            f"{_mib(retained)} | {_ratio(base_retained, retained)} | "
            f"{times[i] * 1e3:.1f} | {_ratio(times[i], times.get(0))} | "
            f"{_ratio(torch_times.get(i), torch_times.get(0))} | {errors.get(i, math.nan):.4f} |"
        )
    measured.close()
    return rows


def _mib(nbytes: float) -> str:
    return "-" if math.isnan(nbytes) else f"{nbytes / 2**20:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as ``1.23x``, or ``-`` where either is missing (``None`` or NaN)."""
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def report(
    device: torch.device, checks: list[str], throughput: list[str], tables: list[str]
) -> str:
    """The results file: the sections as markdown."""
    try:
        import triton

        version = triton.__version__
    except ImportError:
        version = "not installed"
    lines = [
        "# memopt on CUDA: codec throughput, memory, step time",
        "",
        f"`python -m benchmarks.cuda` on {describe_device(device)}; "
        f"torch {torch.__version__}, triton {version}, {time.strftime('%Y-%m-%d')}. "
        "Ratios are the baseline's "
        "÷ the method's for memory and the method's ÷ the baseline's for step time. "
        "Correctness on the GPU: `pytest tests/test_cuda_codec.py tests/test_cuda_training.py`.",
    ]
    if checks:
        lines += ["", "## Builds and tests", "", *checks]
    if throughput:
        lines += [
            "",
            "## Codec throughput (2**26 elements, group 256)",
            "",
            "| call | dtype | bits | torch ms | Triton ms | Triton GB/s of input | speed-up |",
            "|---|---|---|---|---|---|---|",
            *throughput,
        ]
    lines += ["", "## Memory and step time", "", *tables]
    return "\n".join(lines) + "\n"


def _workload_runs(cuda: bool) -> list[tuple[str, Workload, bool]]:
    """(scale, workload, under bf16 autocast) of section 2: on CUDA the GPT and the CNN at both
    scales and precisions, and HF GPT-2 GPU-sized under autocast; on the CPU tiny ones."""
    if not cuda:
        return [("tiny", build(QUICK), False) for build in (gpt_workload, cnn_workload)]
    runs = [
        (scale, build(sizes), autocast)
        for scale, sizes in (("bench sizes", FULL), ("GPU-sized", GPU_SIZED))
        for build in (gpt_workload, cnn_workload)
        for autocast in (False, True)
    ]
    return [*runs, ("GPU-sized", hf_gpt2_workload(GPU_SIZED), True)]


def memory_and_step_time(device: torch.device) -> list[str]:
    """Section 2 as markdown tables, one per workload, scale and precision."""
    header = (
        "| method | peak MiB | peak ratio | retained MiB | retained ratio | step ms | "
        "step ratio | step ratio, torch codec | gradient error |"
    )
    cuda = device.type == "cuda"
    settings = FULL_SETTINGS if cuda else QUICK_SETTINGS
    tables = []
    for scale, workload, autocast in _workload_runs(cuda):
        workload = workload.to(device)
        try:
            rows = measure_workload(workload, device, settings, autocast)
        except Exception as exc:  # one workload's failure is a row; the others go on
            rows = [f"| failed: {failure(exc)} |" + " |" * 8]
        precision = "bf16 autocast" if autocast else "float32"
        title = f"### {workload.title}, {scale}, {precision}"
        tables += [title, "", header, "|---" * 9 + "|", *rows, ""]
        print(f"{title[4:]} done", file=sys.stderr)
    return tables


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda[:i] (default cuda), or cpu")
    parser.add_argument(
        "--out",
        type=Path,
        help="markdown to write (on CUDA, by default benchmarks/results-cuda.md)",
    )
    parser.add_argument(
        "--skip-builds", action="store_true", help="leave out the ahead-of-time build check"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "benchmarks.cuda: no CUDA device here (torch.cuda.is_available() is False). This "
            "measures memopt on a GPU; run it on a machine with one (or --device cpu to check "
            "the script itself).",
            file=sys.stderr,
        )
        return 2
    cuda = device.type == "cuda"
    out = args.out or (RESULTS / "results-cuda.md" if cuda else None)
    checks = ([] if args.skip_builds else build_check(device)) + (test_check() if cuda else [])
    print(*checks, sep="\n", file=sys.stderr)
    try:
        throughput = codec_throughput(device) if cuda else []
    except Exception as exc:  # reported, and the measurements still run
        throughput = [f"| failed: {failure(exc)} |" + " |" * 6]
    tables = memory_and_step_time(device)
    text = report(device, checks, throughput, tables)
    if out is not None:
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
