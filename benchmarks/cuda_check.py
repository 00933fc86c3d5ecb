"""memopt on a CUDA GPU in one command: every technique's correctness, then memory and step time.

    python benchmarks/cuda_check.py [--out benchmarks/results-cuda.md] [--device cuda[:i]]

1. Correctness, one PASS/FAIL row each (any FAIL: exit status 1):

   * codec bytes: at round-to-nearest the Triton kernels (``MEMOPT_CODEC=triton``) write the
     codes, scales, zero points, side tables and decoded values of the torch reference, on the
     same GPU and on the CPU (the specification): 8/4/2 bits, float32/bfloat16/float16, ragged
     sizes, odd group sizes, and groups that take every special path (zeros, constants, NaN/Inf,
     subnormals, float16's limit);
   * stochastic rounding: the mean of 48 Triton 4-bit decodes (seeds 0-47) converges to the input;
   * dropout: ``bitmask`` and ``regenerate`` apply one mask in forward and backward, and the
     Triton mask kernels write the torch path's bits;
   * exact recompute: the planner at budget 0.5 and checkpointing every block give the
     baseline's gradients (deterministic algorithms on, so equality is the bar);
   * drift: ``check_drift`` runs on the GPU, and the drift it measures falls as bits rise.

2. Codec throughput: quantize (nearest and stochastic) and decode of 2**26 elements, the Triton
   kernels against the torch reference.

3. Memory and step time, on the bench's GPT and CNN (``workloads.py`` at the bench's sizes and at
   a GPU-sized scale-up), in float32 and under bf16 autocast: the baseline and memopt at 8/4/2
   bits and the combined preset. Peak is ``max_memory_allocated`` over a step and retained is
   ``memory_allocated`` after the forward, both above what the step started with (gradients
   allocated by a warm-up step); ratios are the baseline's ÷ the method's. Step time is the
   median forward + backward (``timing.py``: round-robin after a warm-up), as a ratio to the
   baseline of the same precision, with the Triton codec and again with ``MEMOPT_CODEC=torch``;
   the gradient error is against that baseline.

Writes ``--out`` (markdown). Without a CUDA device it says so and exits with status 2.
``--device cpu`` runs sections 1 and 3 on tiny sizes, for checking this script where there is
no GPU (no memory figures; with ``TRITON_INTERPRET=1`` in the environment the codec rows run the
Triton kernels in Triton's interpreter, else they are reported as not run); it writes nothing
unless ``--out`` is given. Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _folder in (ROOT, HERE):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import torch  # noqa: E402
from gradients import gradient_errors  # noqa: E402
from harness import (  # noqa: E402
    FULL_SETTINGS,
    QUICK_SETTINGS,
    Measured,
    Settings,
    describe_device,
    failure,
    sync,
)
from methods import (  # noqa: E402
    BASELINE,
    CHECKPOINT,
    INT2,
    INT4,
    INT8,
    METHODS,
    PLANNER_05,
    Method,
    Patched,
)
from sizes import FULL, QUICK, Sizes  # noqa: E402
from timing import time_steps  # noqa: E402
from workloads import Workload, cnn_workload, gpt_workload  # noqa: E402

from memopt_plugins import MemoryOptimizer  # noqa: E402
from memopt_plugins.compress import ops  # noqa: E402
from memopt_plugins.dropout import MemoryDropout, pack_mask, unpack_mask  # noqa: E402
from memopt_plugins.tree import slice_batch  # noqa: E402

BITS = (8, 4, 2)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: (numel, group_size): ragged, the default group, and odd sizes whose bytes straddle groups.
CODEC_CASES = ((1_000_003, 256), (40_000, 256), (12_345, 100), (3_001, 7), (9, 1))
CODEC_CASES_CPU = ((2_600, 256), (3_001, 7))
PRESET = "memopt combined preset"
NO_INTERPRETER = "the Triton kernels take CPU tensors only with TRITON_INTERPRET=1"
MEASURED = (BASELINE, INT8, INT4, INT2, PRESET)
#: The bench's sizes scaled up until kernels, not launches, take a step's time on a GPU.
GPU_SIZED = replace(
    FULL,
    gpt=replace(FULL.gpt, dim=512, depth=8, measure_batch=64),
    cnn=replace(FULL.cnn, width=128, measure_batch=1024),
)


@dataclass
class Check:
    """One correctness row: what was checked, whether it held (``None``: not run), the numbers."""

    name: str
    passed: bool | None
    detail: str


@contextmanager
def codec(name: str) -> Iterator[None]:
    """``MEMOPT_CODEC=name`` inside the block (the codec reads it at every call)."""
    before = os.environ.get("MEMOPT_CODEC")
    os.environ["MEMOPT_CODEC"] = name
    try:
        yield
    finally:
        if before is None:
            del os.environ["MEMOPT_CODEC"]
        else:
            os.environ["MEMOPT_CODEC"] = before


def hard_values(numel: int, group_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values with zeros and, one group each, every special path of the codec (CPU)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g, dtype=torch.float64) * 3
    x[torch.randint(numel, (numel // 50 + 1,), generator=g)] = 0.0
    specials = [
        lambda v: v.fill_(0.5),  # constant, decoded exactly by its codes
        lambda v: v.fill_(1e-30),  # constant the codes cannot express: side table
        lambda v: v.__setitem__(0, math.nan),  # kept exactly
        lambda v: v.__setitem__(-1, math.inf),
        lambda v: v.abs_(),  # one-signed
        lambda v: v.abs_().neg_(),
        lambda v: v.sign_().mul_(6.0e4),  # float16's limit
        lambda v: v.fill_(1e-41),  # a float32 subnormal
        lambda v: v.fill_(-math.inf),
    ]
    for i, special in enumerate(specials):
        if (i + 1) * group_size <= numel:
            special(x[i * group_size : (i + 1) * group_size])
    return x.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bit pattern (NaN and signed zeros included), on the CPU."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.cpu().view(as_int), b.cpu().view(as_int))


def codec_outputs(x: torch.Tensor, bits: int, group_size: int) -> list[torch.Tensor]:
    """The quantize operator's seven outputs at round-to-nearest, then the decoded values."""
    packed = ops.quantize(x, bits, group_size, None)
    return [*packed, ops.dequantize(*packed, bits, group_size, x.numel(), x.dtype)]


def check_codec_bytes(device: torch.device, cases: tuple[tuple[int, int], ...]) -> Check:
    fields = "codes scale zero_point exact_index exact_values const_index const_values decoded"
    mismatches: list[str] = []
    count = 0
    for bits in BITS:
        for dtype in DTYPES:
            for numel, group_size in cases:
                x = hard_values(numel, group_size, dtype, seed=numel + bits)
                with codec("triton"):
                    kernel = codec_outputs(x.to(device), bits, group_size)
                with codec("torch"):
                    here = codec_outputs(x.to(device), bits, group_size)
                    spec = codec_outputs(x, bits, group_size)
                count += 1
                case = f"{bits} bits {str(dtype)[6:]} {numel}/{group_size}"
                for name, k, h, s in zip(fields.split(), kernel, here, spec, strict=True):
                    if not same_bits(k, h):
                        mismatches.append(f"{case}: {name}, Triton vs torch")
                    if not same_bits(h, s):
                        mismatches.append(f"{case}: {name}, torch on {device} vs cpu")
    detail = f"{count} cases (8/4/2 bits x float32/bfloat16/float16 x {len(cases)} sizes)"
    if mismatches:
        return Check("codec bytes", False, f"{detail}; differ: {'; '.join(mismatches[:6])}")
    return Check("codec bytes", True, f"{detail}: Triton = torch on {device} = torch on cpu")


def check_stochastic(device: torch.device) -> Check:
    g = torch.Generator().manual_seed(11)
    x = torch.rand(512, generator=g) * 2.95 + 0.05  # above the first level, which values below
    x[torch.rand(512, generator=g) < 0.5] *= -1  # it round up to; both groups span [-3, 3]
    x[0], x[1], x[256], x[257] = 3.0, -3.0, 3.0, -3.0
    x = x.to(device)
    with codec("triton"):
        decodes = []
        for seed in range(48):
            packed = ops.quantize(x, 4, 256, seed)
            decodes.append(ops.dequantize(*packed, 4, 256, x.numel(), x.dtype).double())
    step = packed[1].double().repeat_interleave(256)
    errors = (torch.stack(decodes) - x.double()) / step
    bias = errors.mean(0)
    worst, mean = float(bias.abs().max()), float(bias.mean().abs())
    passed = float(errors.abs().max()) < 1 and worst < 0.3 and mean < 0.015
    detail = f"mean of 48 decodes: bias at most {worst:.3f} step (< 0.3), {mean:.4f} on average"
    return Check("stochastic rounding unbiased", passed, detail)


def check_dropout(device: torch.device, triton: bool) -> Check:
    """Both modes apply one mask in forward and backward; with ``triton``, the Triton mask
    kernels write the torch path's bits."""
    numbers = []
    passed = True
    for mode in ("bitmask", "regenerate"):
        layer = MemoryDropout(0.3)
        layer.mode = mode
        x = torch.ones(4096, 33, device=device, requires_grad=True)
        out = layer(x)
        out.backward(torch.ones_like(out))
        kept = float((out != 0).float().mean())
        # With x = 1, output and gradient are both mask / (1 - p): one mask, forward and backward.
        passed &= torch.equal(x.grad, out.detach()) and 0.68 < kept < 0.72
        numbers.append(f"{mode}: kept {kept:.3f}, backward mask = forward mask")
    if triton:
        noise = torch.empty(10_007, device=device).bernoulli_(0.3)
        with codec("triton"):
            packed = pack_mask(noise)
            unpacked = unpack_mask(packed, noise.shape, noise.dtype)
        with codec("torch"):
            same = torch.equal(packed, pack_mask(noise)) and torch.equal(unpacked, noise)
        passed &= same
        numbers.append(f"Triton mask bits = torch's: {same}")
    else:
        numbers.append(f"Triton masks not run ({NO_INTERPRETER})")
    return Check("dropout (bitmask, regenerate)", passed, "; ".join(numbers))


def check_recompute(workload: Workload, device: torch.device) -> Check:
    names = (BASELINE, PLANNER_05, CHECKPOINT)
    methods = [m for m in METHODS if m.name in names]
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        measured = Measured(workload, methods, device)
        errors = gradient_errors(measured, workload)
        measured.close()
    finally:
        torch.use_deterministic_algorithms(False)
    rows = [f"{methods[i].name}: {errors.get(i, math.nan):.1e}" for i in (1, 2)]
    passed = len(errors) == 3 and max(errors[1], errors[2]) <= 1e-6 and not measured.errors
    return Check(f"exact recompute ({workload.label})", passed, "gradient error " + ", ".join(rows))


def check_drift(workload: Workload, device: torch.device) -> Check:
    drifts = {}
    for bits in BITS:
        model = workload.build().to(device).train()
        opt = MemoryOptimizer({"quantize": {"bits": bits}, "drift": {"enabled": True}})
        opt.apply(model)
        sample = slice_batch(workload.measure, 8)
        report = opt.check_drift(functools.partial(workload.loss_fn, model, sample), max_rounds=1)
        drifts[bits] = report.round_max[0]  # before any escalation
        opt.remove()
    passed = all(math.isfinite(d) for d in drifts.values()) and drifts[8] < drifts[4] < drifts[2]
    detail = ", ".join(f"{b} bits {d:.3f}" for b, d in drifts.items())
    return Check(f"drift ({workload.label}, rel_l2 before escalating)", passed, detail)


def run_check(name: str, check: Callable[..., Check], *args: object) -> Check:
    """``check(*args)``, or a failed row with the error it raised."""
    try:
        return check(*args)
    except Exception as exc:  # a check that raises is a failed check, and the others go on
        return Check(name, False, failure(exc))


def correctness(device: torch.device, sizes: Sizes) -> list[Check]:
    """Section 1. On the CPU the Triton rows need the interpreter (else they are not run)."""
    triton = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if triton:
        cases = CODEC_CASES if device.type == "cuda" else CODEC_CASES_CPU
        checks = [
            run_check("codec bytes", check_codec_bytes, device, cases),
            run_check("stochastic rounding unbiased", check_stochastic, device),
        ]
    else:
        checks = [Check(n, None, NO_INTERPRETER) for n in ("codec bytes", "stochastic rounding")]
    gpt = gpt_workload(sizes).to(device)
    return [
        *checks,
        run_check("dropout", check_dropout, device, triton),
        run_check("exact recompute", check_recompute, gpt, device),
        run_check("drift", check_drift, gpt, device),
    ]


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _codec_seconds(x: torch.Tensor, bits: int, device: torch.device) -> list[float]:
    """Median seconds of quantize (nearest, stochastic) and decode of ``x`` in groups of 256."""
    packed = ops.quantize(x, bits, 256, None)
    return [
        _median_seconds(lambda: ops.quantize(x, bits, 256, None), device),
        _median_seconds(lambda: ops.quantize(x, bits, 256, 7), device),
        _median_seconds(lambda: ops.dequantize(*packed, bits, 256, x.numel(), x.dtype), device),
    ]


def codec_throughput(device: torch.device) -> list[str]:
    """Section 2 as markdown rows: 2**26 elements, the torch reference against Triton."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2**26, device=device).to(dtype)
        gigabytes = x.numel() * x.element_size() / 1e9
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


def _under_autocast(method: Method) -> Method:
    """``method`` with its forward under bf16 autocast on CUDA."""

    def patch(model, workload, batch, steady, adopt) -> Patched:
        patched = method.apply(model, workload, batch, steady, adopt)
        patched.context = functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16)
        return patched

    return Method(method.name, method.family, patch, method.exact)


def step_memory(p: Patched, workload: Workload, device: torch.device) -> tuple[float, float]:
    """(retained after the forward, peak over the step) in bytes, above the step's start."""
    p.model.zero_grad(set_to_none=False)  # the warm-up step allocated them: kept, not counted
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    loss = p.loss(workload.loss_fn, workload.measure)
    sync(device)
    retained = torch.cuda.memory_allocated(device) - start
    loss.backward()
    sync(device)
    return retained, torch.cuda.max_memory_allocated(device) - start


def measure_workload(
    workload: Workload, device: torch.device, settings: Settings, autocast: bool
) -> list[str]:
    """Markdown rows for the measured methods of one workload at one precision."""
    methods = [m for m in METHODS if m.name in MEASURED]
    if autocast:
        methods = [_under_autocast(m) for m in methods]
    measured = Measured(workload, methods, device)
    memory: dict[int, tuple[float, float]] = {}

    def warm_and_measure(i: int, p: Patched) -> None:
        p.loss(workload.loss_fn, workload.measure).backward()
        if device.type == "cuda":
            memory[i] = step_memory(p, workload, device)

    measured.each(warm_and_measure)
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
    device: torch.device, checks: list[Check], throughput: list[str], tables: list[str]
) -> str:
    """The results file: the three sections as markdown."""
    try:
        import triton

        version = triton.__version__
    except ImportError:
        version = "not installed"
    lines = [
        "# memopt on CUDA: correctness, memory, step time",
        "",
        f"`python benchmarks/cuda_check.py` on {describe_device(device)}; "
        f"torch {torch.__version__}, triton {version}, {time.strftime('%Y-%m-%d')}. "
        "Ratios are the baseline's "
        "÷ the method's for memory and the method's ÷ the baseline's for step time.",
        "",
        "## Correctness",
        "",
        "| check | result | numbers |",
        "|---|---|---|",
        *(
            f"| {c.name} | {'not run' if c.passed is None else 'PASS' if c.passed else 'FAIL'} "
            f"| {c.detail} |"
            for c in checks
        ),
    ]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda[:i] (default cuda), or cpu")
    parser.add_argument("--out", type=Path, help="markdown to write (on CUDA, by default "
                        "benchmarks/results-cuda.md)")  # fmt: skip
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "cuda_check: no CUDA device here (torch.cuda.is_available() is False). This script "
            "checks memopt on a GPU; run it on a machine with one (or --device cpu to check "
            "the script itself).",
            file=sys.stderr,
        )
        return 2
    cuda = device.type == "cuda"
    out = args.out or (HERE / "results-cuda.md" if cuda else None)
    started = time.perf_counter()
    checks = correctness(device, FULL if cuda else QUICK)
    print(f"correctness done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    try:
        throughput = codec_throughput(device) if cuda else []
    except Exception as exc:  # reported, and the measurements still run
        throughput = [f"| failed: {failure(exc)} |" + " |" * 6]
    header = (
        "| method | peak MiB | peak ratio | retained MiB | retained ratio | step ms | "
        "step ratio | step ratio, torch codec | gradient error |"
    )
    tables = []
    scales = (("bench sizes", FULL), ("GPU-sized", GPU_SIZED)) if cuda else (("tiny", QUICK),)
    for scale, sizes in scales:
        for build in (gpt_workload, cnn_workload):
            workload = build(sizes).to(device)
            for autocast in (False, True) if cuda else (False,):
                precision = "bf16 autocast" if autocast else "float32"
                settings = FULL_SETTINGS if cuda else QUICK_SETTINGS
                try:
                    rows = measure_workload(workload, device, settings, autocast)
                except Exception as exc:  # one workload's failure is a row; the others go on
                    rows = [f"| failed: {failure(exc)} |" + " |" * 8]
                title = f"### {workload.title}, {scale}, {precision}"
                tables += [title, "", header, "|---" * 9 + "|", *rows, ""]
                print(f"{title[4:]} done", file=sys.stderr)
    text = report(device, checks, throughput, tables)
    if out is not None:
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)
    else:
        print(text)
    failed = [c.name for c in checks if c.passed is False]
    if failed:
        print(f"cuda_check: FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
