"""Step time of PEFT LoRA on a Llama under bf16 autocast, memopt int4 against none (lora_step.md).

A small ``LlamaForCausalLM`` (4 layers, hidden 256, SDPA) wrapped by PEFT LoRA (r=8 on every
projection, ``lora_dropout=0.05``), trained under ``torch.autocast("cpu", bfloat16)`` with AdamW
on the adapters. Two copies with the same weights run in ONE process on one intra-op thread,
their steps interleaved as ``harness/paired.py`` says (thread CPU time and wall time, each
pair's ratio to the baseline step beside it; the median and quartiles of the pairs).
Deterministic proxies beside them: the Python function calls of one step (cProfile's count) and
the saves the hooks see per step, by what they did with them.

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
from collections import Counter
from pathlib import Path

import torch

from memopt_plugins import MemoryOptimizer

from .harness.paired import TrainStep, interleaved, quartiles, ratios

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


def _lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def bf16_autocast() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def calls_per_step(step: TrainStep) -> int:
    """Python function calls of one step, as cProfile counts them."""
    profile = cProfile.Profile()
    profile.runcall(step)
    return pstats.Stats(profile).total_calls


def saves_per_step(run: TrainStep) -> Counter:
    """What the hooks did with the saves of one step, counted by outcome and size class."""
    seen: Counter = Counter()

    class Observer:
        def packed(self, t: torch.Tensor, saved: object, added: int) -> None:
            kind = "kept" if saved is t else "packed"
            size = "small" if t.numel() < run.opt.config.quantize.min_numel else "large"
            seen[f"{kind} {size}"] += 1

    with run.opt.internal.compression.observed(Observer()):
        run()
    return seen


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    batch = torch.randint(
        0, SETUP["vocab"], (args.batch, args.seq), generator=torch.Generator().manual_seed(1)
    )
    model = lora_llama(args.seq)
    opt = MemoryOptimizer({"quantize": {"bits": 4}})
    base = TrainStep(copy.deepcopy(model), batch, _lm_loss, bf16_autocast)
    mem = TrainStep(opt.apply(model), batch, _lm_loss, bf16_autocast, opt=opt)
    interleaved([base, mem], args.warmup)
    times = interleaved([base, mem], args.repeats)
    return {
        "readings": ratios(times, 1),
        "calls": {"baseline": calls_per_step(base), "memopt int4": calls_per_step(mem)},
        "saves": dict(sorted(saves_per_step(mem).items())),
        "base_ms": 1e3 * statistics.median(row[0][0] for row in times),
    }


def report(result: dict, args: argparse.Namespace, load: tuple[float, float]) -> str:
    r = result["readings"]
    calls = result["calls"]
    saves = ", ".join(f"{k}: {v}" for k, v in result["saves"].items())
    return "\n".join([
        f"`{args.command}` (torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
        f"{load[0]:.2f} before, {load[1]:.2f} after; {len(r['cpu'])} pairs, baseline step "
        f"{result['base_ms']:.0f} ms thread CPU):",
        "",
        "| memopt int4 ÷ baseline | median (quartiles) |",
        "|---|--:|",
        f"| thread CPU time | {quartiles(r['cpu'])} |",
        f"| wall time | {quartiles(r['wall'])} |",
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
