"""What fits: the step's peak per sample, how much larger a batch fits, and its samples/s.

The peak of a training step decides the batch that fits. For third-party models built from
configs (Hugging Face GPT-2 and Llama, a ResNet-50-style CNN; no dropout), each as its library
builds it by default (transformers: SDPA attention, ``use_cache`` on, what a user trains), every
method patches a fresh copy of the same model, and one step is read on the allocator's timeline
(:func:`memopt_plugins.profiler.run.step_memory`: after a warm-up step, at the batch and at its
first half: 16 and 8 for the language models, 64 and 32 for the CNN) so that weights, gradients
and workspaces cancel in the slope: the peak per sample.
``fits`` is the baseline's peak per sample over the method's: how many times larger a batch fits
in the memory the baseline's step needs. ``samples/s`` is read at that batch in fresh processes of
its own (``speed_note`` says how), so the price of the larger batch shows too.

Beside memopt: PyTorch's checkpoint around every block (non-reentrant). The lean-ops rows take
``configs/lean.yaml``'s ``ops`` section for the language models (the loss head in chunks, every
exact chain fused, no KV cache in training) and swap the CNN's batch norms, convolutions, ReLUs
and max-pool for the lean ones. For the language models, the baseline and lean ops + int4 / int2
again under bf16 autocast, against the bf16 baseline. For GPT-2: torch.compile with and without
its ``activation_memory_budget`` and memopt compiled, each (method, batch) read in a fresh process
(``COMPILED_NOTE`` says how and why). Writes ``fits.md`` and ``fits.json`` to ``--out``;
``--compiled-only`` runs only the compiled rows and merges them into the fits.json there.

    python -m benchmarks.fits [--quick] [--out DIR] [--only gpt2,llama,resnet] [--threads N]
                              [--compiled-only] [--time METHODS|all|none]
                              [--warmup W] [--steps N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Collection
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # before transformers is imported

from transformers import ResNetConfig, ResNetForImageClassification  # noqa: E402

from examples.models import hf_gpt2_model, hf_llama_model  # noqa: E402
from memopt_plugins import MemoryOptimizer  # noqa: E402
from memopt_plugins.profiler.fit import resize_batch  # noqa: E402
from memopt_plugins.profiler.meter import MemoryMeter  # noqa: E402
from memopt_plugins.profiler.run import step_memory  # noqa: E402
from memopt_plugins.tree import batch_size_of  # noqa: E402

from . import RESULTS, ROOT, chosen  # noqa: E402
from .harness.memory import child_json  # noqa: E402
from .harness.methods import Method, declared  # noqa: E402
from .harness.records import BatchFit, Row  # noqa: E402
from .harness.speed import Spread, timed_steps  # noqa: E402

MIB = 1 << 20
#: This module, which its child processes run (``--child``).
MODULE = "benchmarks.fits"


@dataclass(frozen=True)
class Model:
    name: str
    build: Callable[[bool], tuple[torch.nn.Module, Any, Callable[..., torch.Tensor]]]
    block_class: str
    lean: dict[str, Any] | None = None  # the ``ops`` section that fits it (None: no lean op)


def _lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def _image_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(pixel_values=x).logits, y)


def gpt2(quick: bool):
    seq, dim, layers = (64, 128, 2) if quick else (256, 256, 4)
    model = hf_gpt2_model(2048, seq, dim, layers, eager=False)  # seeded
    return model, torch.randint(0, 2048, (16, seq)), _lm_loss


def llama(quick: bool):
    seq, dim, layers = (64, 128, 2) if quick else (256, 256, 3)
    model = hf_llama_model(4096, seq, dim, layers, eager=False)  # seeded
    return model, torch.randint(0, 4096, (16, seq)), _lm_loss


def resnet(quick: bool):
    torch.manual_seed(0)
    size, depths = (32, [1, 1, 1, 1]) if quick else (64, [3, 4, 6, 3])
    cfg = ResNetConfig(
        embedding_size=16, hidden_sizes=[32, 64, 128, 256], depths=depths,
        layer_type="bottleneck", num_labels=10,
    )  # fmt: skip
    # 64 (the slope between 32 and 64): PyTorch's CPU convolution backward allocates a fixed
    # 1.3 MiB workspace at some batch sizes only (8 and 16 here, 32 and 64 not), which puts a small
    # batch's peak on a fixed cost: between 8 and 16 int4 grew by 0.226 MiB/sample where 16, 32
    # and 64 grow by 0.264, and with the lean ops it read 0.25 where 32, 48 and 64 grow by 0.185
    n = 16 if quick else 64
    batch = (torch.randn(n, 3, size, size), torch.randint(0, 10, (n,)))
    return ResNetForImageClassification(cfg), batch, _image_loss


#: configs/lean.yaml's ``ops`` section: what a user of the lean preset gets on a causal LM.
LEAN_OPS: dict[str, Any] = yaml.safe_load((ROOT / "configs" / "lean.yaml").read_text())["ops"]

MODELS = {
    "gpt2": Model("HF GPT-2", gpt2, "GPT2Block", LEAN_OPS),
    "llama": Model("HF Llama", llama, "LlamaDecoderLayer", LEAN_OPS),
    "resnet": Model(
        "ResNet-50-style",
        resnet,
        "ResNetBottleNeckLayer",
        {"fuse": ["batchnorm", "conv", "relu", "maxpool"]},
    ),
}


INT8, INT4, INT2 = ({"quantize": {"bits": b}} for b in (8, 4, 2))
LEAN_INT4, LEAN_INT2 = ({"ops": "lean", **q} for q in (INT4, INT2))
#: The rows read on the allocator's timeline, ``fits`` against the first.
METHODS = [
    declared("baseline"),
    declared("checkpoint every block", checkpointed=True),
    declared("memopt int8", INT8),
    declared("memopt int4", INT4),
    declared("memopt int2", INT2),
    declared("memopt planner 0.3 + int8", {**INT8, "recompute": {"auto": {"budget": 0.3}}}),
    # int8 alone keeps about a quarter: under it, the planner recomputes on top
    declared("memopt planner 0.1 + int8", {**INT8, "recompute": {"auto": {"budget": 0.1}}}),
    declared("memopt lean ops", {"ops": "lean"}),
    declared("memopt lean ops + int4", LEAN_INT4),
    declared("memopt lean ops + int2", LEAN_INT2),
]
#: The same under bf16 autocast, on these models, read the same way, ``fits`` against the first.
BF16_MODELS = ("gpt2", "llama")
BF16_METHODS = [
    declared("bf16 autocast baseline", bf16=True),
    declared("bf16 autocast memopt lean ops + int4", LEAN_INT4, bf16=True),
    declared("bf16 autocast memopt lean ops + int2", LEAN_INT2, bf16=True),
]
#: torch.compile rows, on these models, read in fresh processes (``COMPILED_NOTE``): ``fits``
#: against the first (eager, not compiled), and against the second (the compiled baseline).
COMPILED_MODELS = ("gpt2",)
COMPILED_METHODS = [
    declared("eager baseline, read as the compiled rows"),
    declared("torch.compile", compiled=True),
    declared("torch.compile activation_memory_budget 0.5", compiled=True, budget=0.5),
    declared("torch.compile activation_memory_budget 0.1", compiled=True, budget=0.1),
    declared("torch.compile + memopt int8", INT8, compiled=True),
    declared("torch.compile + memopt lean ops + int4", LEAN_INT4, compiled=True),
]
BY_NAME = {m.name: m for m in (*METHODS, *BF16_METHODS, *COMPILED_METHODS)}
#: The rows whose samples/s is read by default (``--time``), each in ``--repeats`` processes:
#: the baselines, PyTorch's checkpoint and lean ops + int4 (the issue's bar). A lean row's batch is
#: eight or more times the baseline's, so its steps take most of the time; ``--time all`` reads
#: every row.
TIMED = (
    "baseline",
    "checkpoint every block",
    "memopt lean ops + int4",
    "bf16 autocast baseline",
    "bf16 autocast memopt lean ops + int4",
    "torch.compile",
    "torch.compile + memopt lean ops + int4",
)
#: Intra-op threads of every timing process.
SPEED_THREADS = 1
#: Steps before the compiled readings and timings (the first compiles); readings per process
#: (the smallest is kept).
COMPILE_WARMUP, READINGS = 2, 3


def fits_row(model: str, method: str, peak: float, retained: float, peak_at_batch: int) -> Row:
    """A row of this study: ``peak`` and ``retained`` per sample, the step's peak at the model's
    batch; its ``fits`` and batch are :func:`_fit`'s, its samples/s :func:`time_rows`'."""
    return Row(
        method,
        model,
        peak=peak_at_batch,
        peak_per_sample=peak,
        retained_per_sample=retained,
        fits=1.0,
        samples_per_s=0.0,
        batch_fit=BatchFit(),
    )


@dataclass
class Prepared:
    """A fresh copy of a model with a method applied, its batch and its loss."""

    model: torch.nn.Module
    batch: Any
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    optimizer: MemoryOptimizer | None
    backend: Any = None  # the compiled methods' (its graph count)

    def step(self) -> None:
        self.loss_fn(self.model, self.batch).backward()


def _within(
    context: Callable[[], Any], loss_fn: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    def loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        with context():
            return loss_fn(model, batch)

    return loss


def prepared(key: str, method: Method, quick: bool, n: int | None = None) -> Prepared:
    """``key``'s model built afresh with ``method`` applied, at batch ``n`` (None: its own)."""
    spec = MODELS[key]
    model, batch, loss_fn = spec.build(quick)
    if n is not None:
        batch = resize_batch(batch, n)
    patched = method.apply(model, spec, None, steady=False)
    if patched.context is not nullcontext:  # bf16 autocast around the forward
        loss_fn = _within(patched.context, loss_fn)
    return Prepared(model, batch, loss_fn, patched.optimizer, patched.backend)


def _compiled_warm(p: Prepared, warmup: int) -> None:
    """``warmup`` steps (at least :data:`COMPILE_WARMUP`: the first compiles); raises if a
    compiled model ran eagerly."""
    for _ in range(max(warmup, COMPILE_WARMUP)):
        p.step()  # the gradients stay allocated: they cancel
    if p.backend is not None and not p.backend.graphs:
        raise RuntimeError("torch.compile compiled no graph: the model ran eagerly")


def memory_child(key: str, method: str, n: int, quick: bool) -> dict[str, int]:
    """In a child process: ``key``'s model with ``method`` at batch ``n``, warmed up;
    ``{"peak", "retained"}``, the smallest of :data:`READINGS` steps' bytes."""
    p = prepared(key, BY_NAME[method], quick, n)
    _compiled_warm(p, COMPILE_WARMUP)
    meter = MemoryMeter("cpu")
    with torch._dynamo.config.patch(error_on_recompile=True):
        readings = [meter.measure(lambda: p.loss_fn(p.model, p.batch)) for _ in range(READINGS)]
    return {"peak": min(r.peak for r in readings), "retained": min(r.retained for r in readings)}


def speed_child(key: str, method: str, n: int, quick: bool, warmup: int, steps: int) -> list[float]:
    """In a child process: the seconds of ``steps`` training steps (forward and backward) of
    ``key``'s model with ``method`` at batch ``n``, after ``warmup`` (compiled: at least
    :data:`COMPILE_WARMUP`, the first compiles; no recompile after them)."""
    p = prepared(key, BY_NAME[method], quick, n)
    if p.backend is not None:
        _compiled_warm(p, warmup)
        warmup = 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        return timed_steps(p.step, warmup, steps)


def _fit(rows: list[Row], n: int, compiled: Row | None = None) -> None:
    """Each row's ``fits`` against the first (and ``compiled``), and its batch from ``n``."""
    for row in rows:
        fit = row.batch_fit
        row.fits = rows[0].peak_per_sample / row.peak_per_sample
        fit.batch = max(1, int(n * row.fits))
        against = ""
        if compiled is not None:
            fit.fits_compiled = compiled.peak_per_sample / row.peak_per_sample
            against = f" ({fit.fits_compiled:5.2f}x vs compiled)"
        print(
            f"{row.model:16s} {row.method:44s} peak/sample {row.peak_per_sample / MIB:7.3f} MiB"
            f"  fits {row.fits:5.2f}x{against}  batch {fit.batch:4d}",
            flush=True,
        )


def eager_rows(names: list[str], quick: bool) -> list[Row]:
    """The :data:`METHODS` rows of ``names``, then the :data:`BF16_METHODS` ones of the
    :data:`BF16_MODELS` among them, each read by ``step_memory`` on the allocator's timeline."""
    rows: list[Row] = []
    for key in names:
        spec = MODELS[key]
        for methods in (METHODS, BF16_METHODS if key in BF16_MODELS else []):
            group: list[Row] = []
            for method in [m for m in methods if m.applies_to(spec)]:
                p = prepared(key, method, quick)
                step = step_memory(p.model, p.batch, p.loss_fn)
                half = resize_batch(p.batch, batch_size_of(p.batch) // 2)
                below = step_memory(p.model, half, p.loss_fn).per_sample.peak
                if p.optimizer is not None:
                    p.optimizer.remove()
                per = step.per_sample
                group.append(
                    fits_row(spec.name, method.name, per.peak, per.retained, step.reading.peak)
                )
                group[-1].batch_fit.peak_per_sample_below = below
            if group:
                _fit(group, batch_size_of(p.batch))
            rows += group
    return rows


def compiled_rows(names: list[str], quick: bool, threads: int) -> list[Row]:
    """The :data:`COMPILED_METHODS` rows of the :data:`COMPILED_MODELS` among ``names``: each
    (method, batch) read by :func:`memory_child` in a fresh process."""
    rows: list[Row] = []
    for key in [k for k in names if k in COMPILED_MODELS]:
        spec = MODELS[key]
        n = batch_size_of(spec.build(quick)[1])
        group: list[Row] = []
        for method in COMPILED_METHODS:
            big, small = (
                child_json(MODULE, {"task": "memory", "key": key, "method": method.name,
                                    "n": size, "quick": quick}, threads)
                for size in (n, n // 2)
            )  # fmt: skip
            per = {k: (big[k] - small[k]) / (n - n // 2) for k in ("peak", "retained")}
            print(f"  {spec.name} {method.name}: batch {n} {big}, {n // 2} {small}", flush=True)
            if per["peak"] <= 0:
                raise RuntimeError(f"{spec.name} {method.name}: peak per sample {per['peak']} <= 0")
            group.append(
                fits_row(spec.name, method.name, per["peak"], per["retained"], big["peak"])
            )
        _fit(group, n, compiled=group[1])
        rows += group
    return rows


@dataclass(frozen=True)
class Timing:
    """How samples/s is read: per process ``warmup`` steps, then ``steps`` timed; ``repeats``
    processes per row."""

    warmup: int = 1
    steps: int = 2
    repeats: int = 3


#: A smoke run's: every part of the protocol, least time.
QUICK_TIMING = Timing(warmup=1, steps=1, repeats=2)


def time_rows(rows: list[Row], timed: Collection[str], quick: bool, timing: Timing) -> None:
    """Fill the samples/s of the rows whose method is in ``timed``: each reading
    :func:`speed_child` at the row's batch in a fresh process on :data:`SPEED_THREADS` thread(s),
    the rows taken round-robin ``timing.repeats`` times (load that drifts hits them alike)."""
    chosen = [r for r in rows if r.method in timed]
    key_of = {spec.name: key for key, spec in MODELS.items()}
    for r in chosen:
        r.batch_fit.samples_per_s_runs = []
    for round_ in range(timing.repeats):
        for row in chosen:
            fit = row.batch_fit
            task = {"task": "speed", "key": key_of[row.model], "method": row.method,
                    "n": fit.batch, "quick": quick, "warmup": timing.warmup,
                    "steps": timing.steps}  # fmt: skip
            seconds = child_json(MODULE, task, SPEED_THREADS, malloc=False)
            fit.samples_per_s_runs.append(fit.batch / statistics.median(seconds))
            print(
                f"{row.model:16s} {row.method:44s} batch {fit.batch:4d} process {round_ + 1}: "
                f"{fit.samples_per_s_runs[-1]:7.2f} samples/s",
                flush=True,
            )
    for row in chosen:
        row.samples_per_s = Spread.of(row.batch_fit.samples_per_s_runs).median


BF16_NOTE = (
    "The `bf16 autocast` rows run the step's forward under "
    '`torch.autocast("cpu", dtype=torch.bfloat16)` (the backward outside it, as training loops '
    "do) and are read as the rows above them; their `fits` is against the bf16 baseline (their "
    "first row)."
)
COMPILED_NOTE = (
    "The torch.compile rows are read differently, because a compiled step cannot be read on the "
    "allocator's timeline: its per-module `record_function` hooks made the compiled model "
    "recompile inside the measured step, and with `dynamic=True` the two batch sizes got "
    "different partitions (an earlier try gave negative slopes). So each (method, batch) runs in "
    "a fresh spawned process with glibc's malloc returning freed blocks at once "
    "(`MALLOC_MMAP_THRESHOLD_=4096 MALLOC_TRIM_THRESHOLD_=0`), memopt is applied (drift off), "
    "then the whole model is compiled (inductor, `dynamic=False`: each batch size its own graphs) "
    "at the method's `torch._functorch.config.activation_memory_budget`, runs "
    f"{COMPILE_WARMUP} warm-up steps, and then {READINGS} steps, any recompile in them an error, "
    "each read by the process's high-water mark (`VmHWM`, reset through `/proc/self/clear_refs` "
    "before the step, minus RSS before it; `MemoryMeter`), the smallest kept. The eager "
    "baseline is read the same way (its row), and these rows' `fits` is against it, then in "
    "brackets against the compiled baseline (docs/benchmarks.md: under torch.compile, compare "
    "against the compiled baseline)."
)


def speed_note(timing: Timing) -> str:
    """How this run read samples/s."""
    return (
        "`samples/s`: training steps (forward and backward) at the row's batch, each reading a "
        "fresh process of its own, one after another (glibc's malloc as it is, "
        f"{SPEED_THREADS} intra-op thread): {timing.warmup} warm-up step(s) (compiled: "
        f"{max(timing.warmup, COMPILE_WARMUP)}, the first compiles at that batch), then "
        f"{timing.steps} timed steps, whose median step time gives the process's samples/s; "
        f"{timing.repeats} such processes per row, the rows taken in turn, give the median and in "
        "brackets the lowest and the highest. `-`: not timed in this run (`--time`)."
    )


def _speed(row: Row) -> str:
    if row.batch_fit.samples_per_s_runs:
        return str(Spread.of(row.batch_fit.samples_per_s_runs))
    return f"{row.samples_per_s:.1f}" if row.samples_per_s else "-"


def markdown(rows: list[Row], timing: Timing, source: str) -> str:
    """fits.md: ``source`` (which runs made the rows), how they were read, and the table."""
    out = [
        "# What fits: the step's peak per sample",
        "",
        source + " `fits`: how many times larger a batch fits in the memory the "
        "baseline's step needs at the model's batch (the baseline's peak per sample over the "
        "method's); `samples/s` at that batch. Per sample: the slope between the model's batch "
        "and its half (16 and 8 for GPT-2 and Llama, 64 and 32 for the ResNet), on the "
        "allocator's timeline; `peak, ¼–½`: the peak's slope one halving lower (4 to 8, 16 to "
        "32), which reads low where a small batch's peak sits on what does not grow with it "
        "(the gradients, a workspace): where the two slopes agree, the slope is stable. The lean "
        "rows of Llama and the bf16 lean rows read 27-41% lower there, as their smallest "
        "batches peak where the gradients are made; no batch above the model's was read.",
        "",
        speed_note(timing),
        "",
        BF16_NOTE,
        "",
        COMPILED_NOTE,
        "",
        "| model | method | peak / sample | peak, ¼–½ | retained / sample | fits | batch | "
        "samples/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        fits = f"{r.fits:.2f}x"
        if r.batch_fit.fits_compiled is not None:
            fits += f" ({r.batch_fit.fits_compiled:.2f}x)"
        below = r.batch_fit.peak_per_sample_below
        below = "-" if below is None else f"{below / MIB:.3f} MiB"
        out.append(
            f"| {r.model} | {r.method} | {r.peak_per_sample / MIB:.3f} MiB | {below} | "
            f"{r.retained_per_sample / MIB:.3f} MiB | {fits} | {r.batch_fit.batch} | {_speed(r)} |"
        )
    return "\n".join(out) + "\n"


def merged(old: list[Row], new: list[Row]) -> list[Row]:
    """``old`` with ``new``'s rows in place of those of the same model and method, and the rest
    of ``new`` after its model's last row (or at the end)."""
    fresh = {(r.model, r.method): r for r in new}
    rows = [fresh.pop((r.model, r.method), r) for r in old]
    for row in fresh.values():
        after = [i for i, r in enumerate(rows) if r.model == row.model]
        rows.insert(after[-1] + 1 if after else len(rows), row)
    return rows


def _timed(parser: argparse.ArgumentParser, value: str | None) -> Collection[str]:
    """``--time``: the method names to time (``all``, ``none``; default :data:`TIMED`)."""
    if value is None:
        return TIMED
    if value in ("all", "none"):
        return BY_NAME if value == "all" else ()
    return chosen(parser, value, BY_NAME, "--time")


def _timing(args: argparse.Namespace) -> Timing:
    given = {k: getattr(args, k) for k in ("warmup", "steps", "repeats")}
    default = QUICK_TIMING if args.quick else Timing()
    return replace(default, **{k: v for k, v in given.items() if v is not None})


def _header_runs(out: Path) -> str:
    """The sentences of ``out``'s fits.md that say which runs made its rows."""
    return (out / "fits.md").read_text().split("\n")[2].split(" `fits`: how many")[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, for a smoke run")
    parser.add_argument("--out", default=str(RESULTS), help="folder for fits.md and fits.json")
    parser.add_argument("--only", default=",".join(MODELS), help="models, comma-separated")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (memory)")
    runs = parser.add_mutually_exclusive_group()
    runs.add_argument(
        "--compiled-only",
        action="store_true",
        help="only the torch.compile rows, merged into the --out folder's fits.json",
    )
    runs.add_argument(
        "--time-only",
        action="store_true",
        help="only samples/s, of the rows in the --out folder's fits.json (at their batch)",
    )
    parser.add_argument(
        "--time",
        default=None,
        help="methods whose samples/s is read, comma-separated, or all / none "
        f"(default: {', '.join(TIMED)})",
    )
    for name, what in (("warmup", "untimed steps"), ("steps", "timed steps"),
                       ("repeats", "processes per row")):  # fmt: skip
        parser.add_argument(
            f"--{name}", type=int, default=None,
            help=f"samples/s: {what} (default {getattr(Timing(), name)}, "
            f"--quick {getattr(QUICK_TIMING, name)})",
        )  # fmt: skip
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a child's task, JSON
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child is not None:  # one reading, written to --out (a file)
        task = json.loads(args.child)
        child = memory_child if task.pop("task") == "memory" else speed_child
        Path(args.out).write_text(json.dumps(child(**task)))
        return 0
    names = chosen(parser, args.only, MODELS)
    timed, timing = _timed(parser, args.time), _timing(args)
    start = time.perf_counter()
    out = Path(args.out)
    threads = torch.get_num_threads()
    command = shlex.join(["python", "-m", MODULE, *(sys.argv[1:] if argv is None else argv)])
    if args.compiled_only or args.time_only:
        old = [Row.from_json(r) for r in json.loads((out / "fits.json").read_text())]
    if args.compiled_only:
        rows = compiled_rows(names, args.quick, threads)
        time_rows(rows, timed, args.quick, timing)
        rows = merged(old, rows)
        minutes = (time.perf_counter() - start) / 60
        earlier = _header_runs(out).split("The other rows: ")[-1]  # an earlier one's left out
        source = (
            f"The torch.compile rows: `{command}` on {threads} CPU threads, {minutes:.1f} min. "
            f"The other rows: {earlier}"
        )
    elif args.time_only:
        rows = old
        keys = {MODELS[k].name for k in names}
        time_rows([r for r in rows if r.model in keys], timed, args.quick, timing)
        minutes = (time.perf_counter() - start) / 60
        earlier = _header_runs(out).split(" Their samples/s: ")[0]  # an earlier one's left out
        source = f"{earlier} Their samples/s: `{command}`, {minutes:.1f} min."
    else:
        rows = merged(eager_rows(names, args.quick), compiled_rows(names, args.quick, threads))
        time_rows(rows, timed, args.quick, timing)
        minutes = (time.perf_counter() - start) / 60
        source = (
            f"Generated by `{command}` in {minutes:.1f} min, the memory read on {threads} CPU "
            "threads (the module docstring says how)."
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "fits.md").write_text(markdown(rows, timing, source))
    (out / "fits.json").write_text(json.dumps([r.to_json() for r in rows], indent=2) + "\n")
    print(f"wrote {out / 'fits.md'}, {out / 'fits.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
