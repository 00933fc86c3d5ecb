"""What fits: the step's peak per sample, and how much larger a batch fits, per method.

The peak of a training step decides the batch that fits. For third-party models built from
configs (Hugging Face GPT-2 and Llama, a ResNet-50-style CNN; no dropout), each as its library
builds it by default (transformers: SDPA attention, ``use_cache`` on, what a user trains), every
method patches a fresh copy of the same model, and one step is read on the allocator's timeline
(:func:`memopt_plugins.profiler.run.step_memory`: after a warm-up step, at the batch and at its
first half: 16 and 8 for the language models, 64 and 32 for the CNN) so that weights, gradients
and workspaces cancel in the slope: the peak per sample.
``fits`` is the baseline's peak per sample over the method's: how many times larger a batch fits
in the memory the baseline's step needs. ``samples/s`` is measured at that batch (the median of a
few steps after a warm-up, no profiler), so the price of the larger batch shows too.

Beside memopt: PyTorch's checkpoint around every block (non-reentrant). The lean-ops rows take
``configs/lean.yaml``'s ``ops`` section for the language models (the loss head in chunks, every
exact chain fused, no KV cache in training) and swap the CNN's batch norms, convolutions, ReLUs
and max-pool for the lean ones. Beside them, for GPT-2: torch.compile with and without its
``activation_memory_budget``, each (method, batch) read in a fresh process (``COMPILED_NOTE``
says how and why). Writes ``fits.md`` and ``fits.json`` to ``--out``; ``--compiled-only`` runs
only the compiled rows and merges them into the fits.json there.

    python -m benchmarks.fits [--quick] [--out DIR] [--only gpt2,llama,resnet] [--threads N]
                                [--compiled-only]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # before transformers is imported

from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    ResNetConfig,
    ResNetForImageClassification,
)

from memopt_plugins import MemoryOptimizer  # noqa: E402
from memopt_plugins.profiler.fit import resize_batch  # noqa: E402
from memopt_plugins.profiler.meter import MemoryMeter  # noqa: E402
from memopt_plugins.profiler.run import step_memory  # noqa: E402

from . import RESULTS, ROOT, chosen  # noqa: E402
from .harness.memory import in_fresh_process  # noqa: E402
from .harness.methods import checkpoint_blocks, inductor  # noqa: E402

MIB = 1 << 20


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
    torch.manual_seed(0)
    seq, dim, layers = (64, 128, 2) if quick else (256, 256, 4)
    cfg = GPT2Config(
        vocab_size=2048, n_positions=seq, n_embd=dim, n_layer=layers, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg), torch.randint(0, 2048, (16, seq)), _lm_loss


def llama(quick: bool):
    torch.manual_seed(0)
    seq, dim, layers = (64, 128, 2) if quick else (256, 256, 3)
    cfg = LlamaConfig(
        vocab_size=4096, hidden_size=dim, intermediate_size=4 * dim, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=seq,
    )  # fmt: skip
    return LlamaForCausalLM(cfg), torch.randint(0, 4096, (16, seq)), _lm_loss


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

#: (name, memopt config or None, checkpoint every block?)
METHODS: list[tuple[str, dict[str, Any] | None, bool]] = [
    ("baseline", None, False),
    ("checkpoint every block", None, True),
    ("memopt int8", {"quantize": {"bits": 8}}, False),
    ("memopt int4", {"quantize": {"bits": 4}}, False),
    ("memopt int2", {"quantize": {"bits": 2}}, False),
    (
        "memopt planner 0.3 + int8",
        {"quantize": {"bits": 8}, "recompute": {"auto": {"budget": 0.3}}},
        False,
    ),
    (  # int8 alone keeps about a quarter: under it, the planner recomputes on top
        "memopt planner 0.1 + int8",
        {"quantize": {"bits": 8}, "recompute": {"auto": {"budget": 0.1}}},
        False,
    ),
    ("memopt lean ops", {"ops": "lean"}, False),
    ("memopt lean ops + int4", {"ops": "lean", "quantize": {"bits": 4}}, False),
    ("memopt lean ops + int2", {"ops": "lean", "quantize": {"bits": 2}}, False),
]


@dataclass
class Row:
    model: str
    method: str
    peak_per_sample: float
    retained_per_sample: float
    fits: float = 1.0
    batch: int = 0
    samples_per_s: float = 0.0
    peak_at_batch: int = 0
    fits_compiled: float | None = None  # torch.compile rows: against the compiled baseline


def _steps_per_second(model, batch, loss_fn, steps: int) -> float:
    loss_fn(model, batch).backward()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss_fn(model, batch).backward()
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return 1.0 / statistics.median(times)


def run(names: list[str], quick: bool) -> list[Row]:
    rows: list[Row] = []
    for key in names:
        spec = MODELS[key]
        model0, batch, loss_fn = spec.build(quick)
        baseline: Row | None = None
        for method, config, checkpointed in METHODS:
            if config is not None and config.get("ops") == "lean":
                if spec.lean is None:
                    continue
                config = {**config, "ops": spec.lean}
            model = copy.deepcopy(model0)
            if checkpointed:
                checkpoint_blocks(model, spec.block_class)
            opt = MemoryOptimizer({**config, "drift": {"enabled": False}}) if config else None
            if opt is not None:
                opt.apply(model)
            step = step_memory(model, batch, loss_fn)
            per = step.per_sample
            row = Row(spec.name, method, per.peak, per.retained)
            if baseline is None:
                baseline = row
            row.fits = baseline.peak_per_sample / row.peak_per_sample
            n = len(batch[0]) if isinstance(batch, tuple) else len(batch)
            row.batch = max(1, int(n * row.fits))
            bigger = resize_batch(batch, row.batch)
            row.samples_per_s = row.batch * _steps_per_second(
                model, bigger, loss_fn, 2 if quick else 3
            )
            row.peak_at_batch = step.reading.peak
            rows.append(row)
            print(
                f"{spec.name:16s} {method:28s} peak/sample {per.peak / MIB:7.3f} MiB  fits "
                f"{row.fits:5.2f}x  batch {row.batch:4d}  {row.samples_per_s:7.1f} samples/s",
                flush=True,
            )
            if opt is not None:
                opt.remove()
    return rows


#: torch.compile rows, on these models: (method, ``activation_memory_budget`` while compiling;
#: ``None``: torch's default, 1.0; ``"eager"``: not compiled, the eager baseline read the same way)
COMPILED_MODELS = ("gpt2",)
COMPILED_METHODS: list[tuple[str, float | str | None]] = [
    ("eager baseline, read as the compiled rows", "eager"),
    ("torch.compile", None),
    ("torch.compile activation_memory_budget 0.5", 0.5),
    ("torch.compile activation_memory_budget 0.1", 0.1),
]
#: Steps before the readings (the first compiles); readings per process (the smallest is kept).
COMPILE_WARMUP, READINGS = 2, 3
COMPILED_NOTE = (
    "The torch.compile rows are read differently, because a compiled step cannot be read on the "
    "allocator's timeline: its per-module `record_function` hooks made the compiled model "
    "recompile inside the measured step, and with `dynamic=True` the two batch sizes got "
    "different partitions (an earlier try gave negative slopes). So each (method, batch) runs in "
    "a fresh spawned process with glibc's malloc returning freed blocks at once "
    "(`MALLOC_MMAP_THRESHOLD_=4096 MALLOC_TRIM_THRESHOLD_=0`), the whole model is compiled "
    "(inductor, `dynamic=False`: each batch size its own graphs) at the method's "
    "`torch._functorch.config.activation_memory_budget`, runs "
    f"{COMPILE_WARMUP} warm-up steps, and then {READINGS} steps, any recompile in them an error, "
    "each read by the process's high-water mark (`VmHWM`, reset through `/proc/self/clear_refs` "
    "before the step, minus RSS before it; `MemoryMeter`), the smallest kept. The eager "
    "baseline is read the same way (its row), and these rows' `fits` is against it, then in "
    "brackets against the compiled baseline (DESIGN.md: under torch.compile, compare against the "
    "compiled baseline). No samples/s (`-`): that needs a compile at the larger batch."
)


def compiled_child(key: str, budget: float | str | None, n: int, quick: bool) -> dict[str, int]:
    """In the child process: ``key``'s model at batch ``n``, compiled at ``budget`` (or eager),
    warmed up; ``{"peak", "retained"}``, the smallest of :data:`READINGS` steps' bytes."""
    model, batch, loss_fn = MODELS[key].build(quick)
    batch = resize_batch(batch, n)
    backend = None
    if budget != "eager":
        backend = inductor(None if budget is None else float(budget))
        model.compile(backend=backend, dynamic=False)
    for _ in range(COMPILE_WARMUP):
        loss_fn(model, batch).backward()  # the gradients stay allocated: they cancel
    if backend is not None and not backend.graphs:
        raise RuntimeError("torch.compile compiled no graph: the model ran eagerly")
    meter = MemoryMeter("cpu")
    with torch._dynamo.config.patch(error_on_recompile=True):
        readings = [meter.measure(lambda: loss_fn(model, batch)) for _ in range(READINGS)]
    return {"peak": min(r.peak for r in readings), "retained": min(r.retained for r in readings)}


def _compiled_reading(key: str, budget: Any, n: int, quick: bool) -> dict[str, int]:
    """:func:`compiled_child` in a fresh interpreter (this module with ``--child``)."""
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "reading.json"
        child = {"key": key, "budget": budget, "n": n, "quick": quick}
        command = ["--child", json.dumps(child), "--out", str(target)]
        command += ["--threads", str(torch.get_num_threads())]
        in_fresh_process("benchmarks.fits", command)
        print(f"  {key} budget {budget} batch {n}: {target.read_text()}", flush=True)
        return json.loads(target.read_text())


def compiled_rows(names: list[str], quick: bool) -> list[Row]:
    """The :data:`COMPILED_METHODS` rows of the :data:`COMPILED_MODELS` among ``names``."""
    rows: list[Row] = []
    for key in [k for k in names if k in COMPILED_MODELS]:
        spec = MODELS[key]
        _, batch, _ = spec.build(quick)
        n = len(batch)
        read: dict[str, tuple[dict[str, int], dict[str, int]]] = {}
        for method, budget in COMPILED_METHODS:
            read[method] = (_compiled_reading(key, budget, n, quick),
                            _compiled_reading(key, budget, n // 2, quick))  # fmt: skip
            big, small = read[method]
            per = {k: (big[k] - small[k]) / (n - n // 2) for k in ("peak", "retained")}
            if per["peak"] <= 0:
                raise RuntimeError(f"{spec.name} {method}: peak per sample {per['peak']} <= 0")
            row = Row(spec.name, method, per["peak"], per["retained"], peak_at_batch=big["peak"])
            rows.append(row)
        eager, compiled = rows[-len(COMPILED_METHODS)], rows[-len(COMPILED_METHODS) + 1]
        for row in rows[-len(COMPILED_METHODS) :]:
            row.fits = eager.peak_per_sample / row.peak_per_sample
            row.fits_compiled = compiled.peak_per_sample / row.peak_per_sample
            row.batch = max(1, int(n * row.fits))
            print(
                f"{spec.name:16s} {row.method:44s} peak/sample {row.peak_per_sample / MIB:7.3f} "
                f"MiB  fits {row.fits:5.2f}x ({row.fits_compiled:5.2f}x vs compiled)  "
                f"peak at {n}: {row.peak_at_batch / MIB:.1f} MiB",
                flush=True,
            )
    return rows


def markdown(rows: list[Row], quick: bool, seconds: float, source: str | None = None) -> str:
    """The table; ``source`` replaces the first sentence (which run made which rows)."""
    ran = (
        "Generated by `python -m benchmarks.fits`" + (" --quick" if quick else "") + f" on "
        f"{torch.get_num_threads()} CPU threads in {seconds / 60:.1f} min (the module docstring "
        "says how)."
    )
    out = [
        "# What fits: the step's peak per sample",
        "",
        (source or ran) + " `fits`: how many times larger a batch fits in the memory the "
        "baseline's step needs at the model's batch (the baseline's peak per sample over the "
        "method's); `samples/s` at that batch. Per sample: the slope between the model's batch "
        "and its half (16 and 8 for GPT-2 and Llama, 64 and 32 for the ResNet), on the "
        "allocator's timeline.",
        "",
        COMPILED_NOTE,
        "",
        "| model | method | peak / sample | retained / sample | fits | batch | samples/s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        fits = f"{r.fits:.2f}x"
        if r.fits_compiled is not None:
            fits += f" ({r.fits_compiled:.2f}x)"
        speed = f"{r.samples_per_s:.1f}" if r.samples_per_s else "-"
        out.append(
            f"| {r.model} | {r.method} | {r.peak_per_sample / MIB:.3f} MiB | "
            f"{r.retained_per_sample / MIB:.3f} MiB | {fits} | {r.batch} | {speed} |"
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, for a smoke run")
    parser.add_argument("--out", default=str(RESULTS), help="folder for fits.md and fits.json")
    parser.add_argument("--only", default=",".join(MODELS), help="models, comma-separated")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads")
    parser.add_argument(
        "--compiled-only",
        action="store_true",
        help="only the torch.compile rows, merged into the --out folder's fits.json",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # compiled_child's JSON
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child is not None:  # one compiled reading, written to --out (a file)
        Path(args.out).write_text(json.dumps(compiled_child(**json.loads(args.child))))
        return 0
    names = chosen(parser, args.only, MODELS)
    start = time.perf_counter()
    out = Path(args.out)
    source = None
    if args.compiled_only:
        rows = compiled_rows(names, args.quick)
        old = json.loads((out / "fits.json").read_text())
        rows = merged([Row(**r) for r in old], rows)
        # the header's first paragraph, less this sentence from an earlier --compiled-only run
        kept = (out / "fits.md").read_text().split("\n")[2].split(" The other rows: ")[-1]
        kept = kept.split(" `fits`: how many")[0]
        source = (
            "The torch.compile rows: `python -m benchmarks.fits --compiled-only --only "
            f"{args.only}` on {torch.get_num_threads()} CPU threads, "
            f"{(time.perf_counter() - start) / 60:.1f} "
            f"min. The other rows: {kept}"
        )
    else:
        rows = merged(run(names, args.quick), compiled_rows(names, args.quick))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fits.md").write_text(markdown(rows, args.quick, time.perf_counter() - start, source))
    (out / "fits.json").write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    print(f"wrote {out / 'fits.md'}, {out / 'fits.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
