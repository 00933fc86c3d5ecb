"""Step time of PEFT LoRA on a Llama under bf16 autocast, memopt int4 against none (lora_step.md).

A small ``LlamaForCausalLM`` (4 layers, hidden 256, SDPA) wrapped by PEFT LoRA (r=8 on every
projection, ``lora_dropout=0.05``), trained under ``torch.autocast("cpu", bfloat16)`` with AdamW
on the adapters. Two copies with the same weights run in ONE process on one intra-op thread,
their steps interleaved (baseline, memopt, baseline, ...), so both see the same load of the
machine: each pair's ratio is memopt's step over the baseline step beside it, read in thread CPU
time (``time.thread_time``: what this thread ran, not what it waited for) and in wall time; the
table gives the median and quartiles of the pairs. Deterministic proxies beside them: the
Python function calls of one step (cProfile's count) and the saves the hooks see per step, by
what they did with them.

    python -m benchmarks.lora_step --out benchmarks
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import os
import pstats
import shlex
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from memopt_plugins import MemoryOptimizer

SETUP = dict(layers=4, hidden=256, intermediate=688, heads=4, kv_heads=2, vocab=8000)


def lora_llama(seq: int) -> torch.nn.Module:
    """The PEFT LoRA Llama of the module docstring, seeded."""
    import peft
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=SETUP["layers"], hidden_size=SETUP["hidden"],
        intermediate_size=SETUP["intermediate"], num_attention_heads=SETUP["heads"],
        num_key_value_heads=SETUP["kv_heads"], vocab_size=SETUP["vocab"],
        max_position_embeddings=seq, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = peft.LoraConfig(r=8, target_modules=targets, lora_dropout=0.05)
    return peft.get_peft_model(model, lora)


class Run:
    """One model, its optimizer, and a training step on a fixed batch."""

    def __init__(self, model: torch.nn.Module, batch: torch.Tensor):
        self.model = model
        self.batch = batch
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=1e-4)
        self.opt: MemoryOptimizer | None = None

    def step(self) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = self.model(input_ids=self.batch, labels=self.batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.opt is not None:
            self.opt.count_step()


def timed(run: Run) -> tuple[float, float]:
    """(thread CPU seconds, wall seconds) of one step."""
    cpu, wall = time.thread_time(), time.perf_counter()
    run.step()
    return time.thread_time() - cpu, time.perf_counter() - wall


def calls_per_step(run: Run) -> int:
    """Python function calls of one step, as cProfile counts them."""
    profile = cProfile.Profile()
    profile.runcall(run.step)
    return pstats.Stats(profile).total_calls


def saves_per_step(run: Run) -> Counter:
    """What the hooks did with the saves of one step, counted by outcome and size class."""
    seen: Counter = Counter()

    class Observer:
        def packed(self, t: torch.Tensor, saved: object, added: int) -> None:
            kind = "kept" if saved is t else "packed"
            size = "small" if t.numel() < run.opt.config.quantize.min_numel else "large"
            seen[f"{kind} {size}"] += 1

    with run.opt.internal.compression.observed(Observer()):
        run.step()
    return seen


def pairs(base: Run, mem: Run, repeats: int) -> list[dict]:
    """``repeats`` interleaved (baseline, memopt) steps, the order alternating per pair."""
    out = []
    for i in range(repeats):
        first, second = (base, mem) if i % 2 == 0 else (mem, base)
        a, b = timed(first), timed(second)
        b_cpu, b_wall = a if first is base else b
        m_cpu, m_wall = b if first is base else a
        out.append({"cpu": m_cpu / b_cpu, "wall": m_wall / b_wall, "base_cpu": b_cpu})
    return out


def quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4)
    return f"{statistics.median(values):.3f}× ({q[0]:.3f}–{q[2]:.3f})"


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    batch = torch.randint(
        0, SETUP["vocab"], (args.batch, args.seq), generator=torch.Generator().manual_seed(1)
    )
    model = lora_llama(args.seq)
    base = Run(copy.deepcopy(model), batch)
    mem = Run(model, batch)
    mem.opt = MemoryOptimizer({"quantize": {"bits": 4}})
    mem.opt.apply(mem.model)
    for _ in range(args.warmup):
        base.step(), mem.step()
    readings = pairs(base, mem, args.repeats)
    return {
        "readings": readings,
        "calls": {"baseline": calls_per_step(base), "memopt int4": calls_per_step(mem)},
        "saves": dict(sorted(saves_per_step(mem).items())),
        "base_ms": 1e3 * statistics.median(r["base_cpu"] for r in readings),
    }


def report(result: dict, args: argparse.Namespace, load: tuple[float, float]) -> str:
    r = result["readings"]
    calls = result["calls"]
    saves = ", ".join(f"{k}: {v}" for k, v in result["saves"].items())
    return "\n".join([
        f"`{args.command}` (torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
        f"{load[0]:.2f} before, {load[1]:.2f} after; {len(r)} pairs, baseline step "
        f"{result['base_ms']:.0f} ms thread CPU):",
        "",
        "| memopt int4 ÷ baseline | median (quartiles) |",
        "|---|--:|",
        f"| thread CPU time | {quartiles([x['cpu'] for x in r])} |",
        f"| wall time | {quartiles([x['wall'] for x in r])} |",
        "",
        f"Python calls per step: baseline {calls['baseline']}, memopt {calls['memopt int4']} "
        f"(+{calls['memopt int4'] - calls['baseline']}). Saves per step ({saves}).",
        "",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="append the reading to OUT/lora_step.md")
    parser.add_argument("--label", default="", help="a heading for the reading")
    parser.add_argument("--repeats", type=int, default=30, help="interleaved pairs of steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each model")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args(argv)
    args.command = shlex.join(["python", "-m", "benchmarks.lora_step", *(argv or sys.argv[1:])])
    load = os.getloadavg()
    result = measure(args)
    text = (f"## {args.label}\n\n" if args.label else "") + report(
        result, args, (load[0], os.getloadavg()[0])
    )
    if args.out is None:
        print(text)
    else:
        with open(args.out / "lora_step.md", "a") as f:
            f.write(text + "\n")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
