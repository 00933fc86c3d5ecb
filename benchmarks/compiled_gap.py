"""What compiled compression keeps, against the compiled baseline (issue 30's table).

Hugging Face GPT-2 (4 layers x 256, batch 8 x 256, vocabulary 2048; eager attention and no
dropout by default, ``--attention sdpa --dropout 0.1`` as transformers builds it),
eager / per-block ``block.compile()`` / ``model.transformer.compile()`` / whole ``model.compile()``,
without memopt and with it (int8 nearest by default), on ``--threads`` threads. Each case runs in a
fresh process with malloc told to return freed memory (docs/peak-and-planning.md, "Reading memory
yourself"), two warm-up steps (the first compiles), then reads the memory retained by one forward
three ways:

* the process's RSS while only the loss is held, as Lightning's ``training_step`` and the HF
  Trainer's ``compute_loss`` hold it (the least of two readings; for memopt at least the packed
  bytes the eager hooks hold): what autograd keeps for backward;
* the allocator's live bytes over the same forward (the profiler's allocation events, as
  tests/test_compile_large.py reads them), which checks the RSS reading;
* the process's RSS while the whole output is held until the backward, as a hand-written loop
  ``out = model(...); out.loss.backward()`` holds it: the logits and, with ``use_cache`` on,
  the keys and values of every layer come on top, at full size with or without memopt.

Besides: memopt's ``SavedStats`` (the counters behind ``memopt/compression_ratio``) and, walking
the autograd graph, the distinct storages every compiled region keeps (``--detail`` lists them).

    python -m benchmarks.compiled_gap                  # the table, markdown
    python -m benchmarks.compiled_gap --modes per-block --detail --threads 2
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from examples.models import hf_gpt2_model
from memopt_plugins import MemoryOptimizer
from memopt_plugins.compress.compiled import compiled_nodes
from memopt_plugins.profiler.meter import MemoryMeter

from .harness.memory import in_fresh_process, least_retained

MODES = ("eager", "per-block", "body", "whole")
MIB = 2**20


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model (``--dropout``, ``--attention``) and its batch of random tokens."""
    model = hf_gpt2_model(args.vocab, args.seq, args.dim, args.layers, dropout=args.dropout)
    model.config._attn_implementation = args.attention
    batch = torch.randint(0, args.vocab, (args.batch, args.seq))
    return model, batch


def compile_model(model, mode: str) -> None:
    if mode == "per-block":
        for block in model.transformer.h:
            block.compile()
    elif mode == "body":
        model.transformer.compile()
    elif mode == "whole":
        model.compile()


def compiled_saved(loss) -> list[dict]:
    """Every distinct storage the compiled regions' autograd nodes keep for backward."""
    seen, rows = set(), []
    for node in compiled_nodes(loss):
        for t in (*node.saved_tensors, *getattr(node, "_tensors_no_vc_check", ())):
            if t is None:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in seen:
                continue
            seen.add(key)
            rows.append(
                {
                    "node": type(node).__name__,
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape),
                    "bytes": t.numel() * t.element_size(),
                    "storage": storage.nbytes(),
                }
            )
    return rows


def allocator_retained(forward) -> int:
    """Bytes the CPU allocator holds after ``forward()`` that it allocated during it (the
    profiler's allocation events, as tests/test_compile_large.py reads them)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = forward()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            events.append(e)
    alive: dict[int, int] = {}
    for e in sorted(events, key=lambda e: e.start_time_ns):
        size, ptr = e.extra_fields.alloc_size, e.extra_fields.ptr
        if size > 0:
            alive[ptr] = size
        else:
            alive.pop(ptr, None)
    del out
    return sum(alive.values())


def user_retained(model, batch, stats) -> int:
    """RSS retained by a user's step, ``out = model(...)`` then ``out.loss.backward()``: the
    whole output (logits, a cache of keys and values) held until the backward."""
    meter, held, least = MemoryMeter("cpu"), [], None
    for _ in range(2):

        def forward():
            out = model(input_ids=batch, labels=batch)
            held.append(out)
            return out.loss

        reading = meter.measure(forward, stats)
        held.clear()
        least = reading.retained if least is None else min(least, reading.retained)
    return least


def run_case(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    model, batch = build(args)
    opt = None
    if args.bits < 32:
        quantize = {"bits": args.bits, "rounding": args.rounding}
        opt = MemoryOptimizer({"quantize": quantize, "drift": {"enabled": False}})
        opt.apply(model)
    compile_model(model, args.mode)

    def loss():
        return model(input_ids=batch, labels=batch).loss

    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss().backward()
    stats = opt.internal.compression.stats if opt is not None else None
    reading = least_retained(MemoryMeter("cpu"), loss, 2, stats)
    out = {"retained": reading.retained, "peak": reading.peak, "packed": reading.packed}
    out["allocator"] = allocator_retained(loss)
    out["user"] = user_retained(model, batch, stats)
    held = loss()
    rows = compiled_saved(held)
    out["compiled_saved"] = sum(r["storage"] for r in rows)
    out["compiled_rows"] = rows
    if stats is not None:
        out["stats"] = {
            "eager_original": stats.forward_original,
            "eager_stored": stats.forward_stored,
            "compiled": {str(k): v for k, v in stats.compiled.items()},
            "original": stats.saved_original,
            "stored": stats.saved_stored,
            "ratio": stats.forward_ratio,
        }
    del held
    return out


def case_in_child(args: argparse.Namespace, mode: str, bits: int) -> dict:
    command = ["--case", mode, "--case-bits", str(bits)]
    for flag in (
        "layers",
        "dim",
        "batch",
        "seq",
        "vocab",
        "threads",
        "rounding",
        "dropout",
        "attention",
    ):
        command += [f"--{flag}", str(getattr(args, flag))]
    done = in_fresh_process("benchmarks.compiled_gap", command, capture=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def detail(rows: list[dict]) -> str:
    kinds = Counter()
    for r in rows:
        kinds[(r["dtype"], tuple(r["shape"]), r["storage"])] += 1
    lines = []
    for (dtype, shape, storage), n in sorted(kinds.items(), key=lambda kv: -kv[0][2] * kv[1]):
        lines.append(f"    {n:3d} x {dtype:9s} {list(shape)!s:28s} {storage / MIB:8.3f} MiB")
    return "\n".join(lines)


def model_arguments(parser: argparse.ArgumentParser, modes: tuple[str, ...] = MODES) -> None:
    """The options :func:`build` reads (the model, its batch, the threads), and ``--modes``
    (default: all of ``modes``)."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--attention", default="eager", choices=("eager", "sdpa"))
    parser.add_argument("--modes", default=",".join(modes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--rounding", default="nearest")
    parser.add_argument("--detail", action="store_true")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--case-bits", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        args.mode, args.bits = args.case, args.case_bits
        print(json.dumps(run_case(args)))
        return
    print(
        f"HF GPT-2 {args.layers} x {args.dim}, batch {args.batch} x {args.seq}, vocab {args.vocab},"
        f" int{args.bits} {args.rounding}, {args.attention} attention, dropout {args.dropout},"
        f" {args.threads} thread(s)\n"
    )
    print(
        "| mode | without memopt | with memopt | ratio | allocator ratio "
        "| output held (base -> memopt) | output held ratio "
        "| compiled saved (base -> memopt) | SavedStats original -> stored | SavedStats ratio |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for mode in args.modes.split(","):
        base = case_in_child(args, mode, 32)
        ours = case_in_child(args, mode, args.bits)
        held = max(ours["retained"], ours["packed"])
        s = ours["stats"]
        print(
            f"| {mode} | {base['retained'] / MIB:.1f} MiB | {held / MIB:.1f} MiB "
            f"| {base['retained'] / held:.2f}x | {base['allocator'] / ours['allocator']:.2f}x "
            f"| {base['user'] / MIB:.1f} -> {ours['user'] / MIB:.1f} MiB "
            f"| {base['user'] / ours['user']:.2f}x "
            f"| {base['compiled_saved'] / MIB:.1f} -> {ours['compiled_saved'] / MIB:.1f} MiB "
            f"| {s['original'] / MIB:.1f} -> {s['stored'] / MIB:.1f} MiB | {s['ratio']:.2f}x |",
            flush=True,
        )
        if args.detail:
            print("  baseline compiled saved:\n" + detail(base["compiled_rows"]))
            print("  memopt compiled saved:\n" + detail(ours["compiled_rows"]))
            print("  stats:", {k: v for k, v in s.items()})


if __name__ == "__main__":
    main()
