"""Depth: the batch that fits at 4, 12 and 24 layers, with the bytes kept for backward beside it.

Compression shrinks what every layer keeps for backward, so the kept bytes fall with depth by
about the codec's ratio; the step's peak also holds one layer's working set (its forward
temporaries before packing, the backward's decoded inputs and gradients in flight), which does
not grow with depth. How far apart the two ratios are says where the peak is left. Two models
from Hugging Face configs, as transformers builds them by default (SDPA attention, no dropout):
GPT-2-style (width 256, 4 heads) and Llama-style (width 256, intermediate 1024, 4 heads), both on
256 tokens with a vocabulary of 2048, at each depth. Methods: the baseline, and
``configs/lean.yaml``'s ``ops`` section with int4 and with int2.

Each (model, depth, method) runs in a fresh process on one thread and is read on the allocator's
timeline (:func:`memopt_plugins.measure.timeline.record_step`) after a warm-up step at the
largest batch, at batches 4, 8 and 16: the per-sample figures are the slopes between 8 and 16,
so that weights, gradients and workspaces cancel; the slope between 4 and 8 is shown beside
them, as at small batches the gradients' allocation can set the peak and the slope reads low.
``fits``: the baseline's peak per sample over the method's; ``kept``: the baseline's retained
bytes per sample over the method's. ``peaks in``: where the step peaks at batch 16. Writes
``depth.md`` and ``depth.json`` to ``--out``.

    python -m benchmarks.depth [--quick] [--out DIR] [--only gpt2,llama] [--depths 4,12,24]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # before transformers is imported

from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from memopt_plugins import MemoryOptimizer  # noqa: E402
from memopt_plugins.config import load_config  # noqa: E402
from memopt_plugins.logs import quiet  # noqa: E402
from memopt_plugins.measure.isolate import isolated
from memopt_plugins.measure.timeline import StepTimeline, record_step  # noqa: E402

from . import RESULTS, chosen  # noqa: E402
from .fits import LEAN_OPS  # noqa: E402
from .harness.memory import in_fresh_process  # noqa: E402
from .harness.records import Depth, Row  # noqa: E402

MIB = 1 << 20
DEPTHS, QUICK_DEPTHS = (4, 12, 24), (1, 2)
#: the batches measured: the full run's, and --quick's; slopes between consecutive ones
BATCHES, QUICK_BATCHES = (4, 8, 16), (2, 4, 8)
#: (width, tokens, vocabulary): the full run's, and --quick's
SIZES = {False: (256, 256, 2048), True: (32, 16, 128)}
MODEL_NAMES = {"gpt2": "GPT-2-style", "llama": "Llama-style"}
#: (name, memopt config or None)
METHODS: list[tuple[str, dict[str, Any] | None]] = [
    ("baseline", None),
    ("lean ops + int4", {"ops": LEAN_OPS, "quantize": {"bits": 4}, "drift": {"enabled": False}}),
    ("lean ops + int2", {"ops": LEAN_OPS, "quantize": {"bits": 2}, "drift": {"enabled": False}}),
]


def build(key: str, layers: int, quick: bool) -> torch.nn.Module:
    """``key``'s model (``gpt2`` or ``llama``) at ``layers`` layers, seeded."""
    width, tokens, vocab = SIZES[quick]
    torch.manual_seed(0)
    if key == "gpt2":
        cfg = GPT2Config(
            vocab_size=vocab, n_positions=tokens, n_embd=width, n_layer=layers, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return GPT2LMHeadModel(cfg)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=tokens,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def _lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def steps(
    model: torch.nn.Module, batches: list[torch.Tensor], config: dict[str, Any] | None
) -> list[StepTimeline]:
    """One step per batch on the allocator's timeline, after a warm-up step at the largest (its
    gradients and lazy state exist first), as is or under ``config`` (applied, then removed);
    the model, its gradients and the RNG are left as they were."""
    with isolated(model, clear_grads=True):
        optimizer = MemoryOptimizer(load_config(config)) if config is not None else None
        if optimizer is not None:
            with quiet():
                optimizer.apply(model)
        try:
            _lm_loss(model, batches[-1]).backward()
            return [record_step(model, lambda b=b: _lm_loss(model, b)) for b in batches]
        finally:
            if optimizer is not None:
                optimizer.remove()


def _slopes(sizes: tuple[int, ...], values: list[int]) -> list[float]:
    """Bytes per sample between consecutive batches."""
    points = zip(sizes, values, strict=True)
    return [(v1 - v0) / (n1 - n0) for (n0, v0), (n1, v1) in itertools.pairwise(points)]


def cell(key: str, layers: int, method: str, quick: bool) -> dict[str, Any]:
    """One (model, depth, method), in this process: its :class:`Row` as a dict."""
    config = dict(METHODS)[method]
    model = build(key, layers, quick)
    _, tokens, vocab = SIZES[quick]
    sizes = QUICK_BATCHES if quick else BATCHES
    batch = torch.randint(0, vocab, (sizes[-1], tokens))
    timelines = steps(model, [batch[:n] for n in sizes], config)
    peaks = _slopes(sizes, [t.peak for t in timelines])
    retained = _slopes(sizes, [t.retained for t in timelines])
    last = timelines[-1]
    depth = Depth(layers, str(last.site), dict(last.alive_at_peak), peaks, retained)
    per_sample = {"peak_per_sample": peaks[-1], "retained_per_sample": retained[-1]}  # the largest
    row = Row(method, MODEL_NAMES[key], **per_sample, fits=1.0, depth=depth)
    return row.to_json()


def _in_child(key: str, layers: int, method: str, quick: bool) -> Row:
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "row.json"
        child = {"key": key, "layers": layers, "method": method, "quick": quick}
        in_fresh_process("benchmarks.depth", ["--child", json.dumps(child), "--out", str(target)])
        return Row.from_json(json.loads(target.read_text()))


def run(keys: list[str], quick: bool, depths: tuple[int, ...] | None = None) -> list[Row]:
    rows: list[Row] = []
    for key in keys:
        for layers in depths or (QUICK_DEPTHS if quick else DEPTHS):
            baseline: Row | None = None
            for method, _ in METHODS:
                row = _in_child(key, layers, method, quick)
                baseline = baseline or row
                row.fits = baseline.peak_per_sample / row.peak_per_sample
                row.depth.kept = baseline.retained_per_sample / row.retained_per_sample
                rows.append(row)
                print(
                    f"{row.model:12s} {layers:3d} layers {method:16s} peak/sample "
                    f"{row.peak_per_sample / MIB:7.3f} MiB  fits {row.fits:5.2f}x  kept "
                    f"{row.retained_per_sample / MIB:7.3f} MiB ({row.depth.kept:5.2f}x)  "
                    f"{row.depth.peak_site}",
                    flush=True,
                )
    return rows


def markdown(rows: list[Row], quick: bool) -> str:
    width, tokens, vocab = SIZES[quick]
    sizes = QUICK_BATCHES if quick else BATCHES
    out = [
        "# Depth: the batch that fits, and the bytes kept for backward",
        "",
        "Generated by `python -m benchmarks.depth" + (" --quick" if quick else "") + "` (the "
        f"module docstring says how): width {width}, {tokens} tokens, vocabulary {vocab}, SDPA "
        "attention, one thread, each row in a fresh process. Per sample: the slope between "
        f"batches {sizes[-2]} and {sizes[-1]} on the allocator's timeline (after a warm-up "
        f"step); `peak, {sizes[0]}-{sizes[1]}`: the peak's slope between the two smaller "
        "batches, for how stable it is. `fits`: the baseline's peak per sample over the "
        "method's (how many times larger a batch fits in the same peak); `kept`: the "
        "baseline's retained bytes per sample over the method's. `peaks in`: where the step "
        f"peaks at batch {sizes[-1]}.",
        "",
        f"| model | layers | method | peak / sample | peak, {sizes[0]}-{sizes[1]} | fits | "
        "retained / sample | kept | peaks in |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        d = r.depth
        first = f"{d.peak_slopes[0] / MIB:.3f} MiB" if d.peak_slopes else "-"  # older rows: none
        out.append(
            f"| {r.model} | {d.layers} | {r.method} | {r.peak_per_sample / MIB:.3f} MiB | "
            f"{first} | {r.fits:.2f}x | "
            f"{r.retained_per_sample / MIB:.3f} MiB | {d.kept:.2f}x | {d.peak_site} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, for a smoke run")
    parser.add_argument("--out", default=str(RESULTS), help="folder for depth.md and depth.json")
    parser.add_argument("--only", default=",".join(MODEL_NAMES), help="models, comma-separated")
    parser.add_argument("--depths", default=None, help="layers, comma-separated (4,12,24)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # cell's JSON arguments
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.child is not None:  # one row, written to --out (a file)
        Path(args.out).write_text(json.dumps(cell(**json.loads(args.child))))
        return 0
    keys = chosen(parser, args.only, MODEL_NAMES)
    depths = tuple(int(d) for d in args.depths.split(",")) if args.depths else None
    rows = run(keys, args.quick, depths)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "depth.md").write_text(markdown(rows, args.quick))
    (out / "depth.json").write_text(json.dumps([r.to_json() for r in rows], indent=2) + "\n")
    print(f"wrote {out / 'depth.md'}, {out / 'depth.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
