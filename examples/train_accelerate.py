"""A plain Accelerate training loop with memopt: the character GPT on the standard library.

    python examples/train_accelerate.py --config int4_drift --max-steps 200
    accelerate launch --multi_gpu --num_processes 2 examples/train_accelerate.py --cpu

(On a machine without GPUs, ``--cpu`` makes each process train on CPU and talk over gloo;
``accelerate launch --cpu`` alone starts a single process unless MPI is set up.)

``--save-state DIR`` writes ``accelerator.save_state`` at the end (model, optimizer and memopt's
bits and drift history); ``--resume DIR`` starts from such a state. ``--report FILE`` writes a
JSON summary per process (``FILE`` gets ``.rank<N>`` appended under several processes).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data import VOCAB, char_splits  # noqa: E402
from models import GPT, lm_loss  # noqa: E402

from memopt_plugins.accelerate import MemOptPlugin  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="int4_drift", help="memopt preset name or YAML file")
    parser.add_argument("--max-steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=1, help="gradient accumulation")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--save-state", default=None, help="save_state here at the end")
    parser.add_argument("--resume", default=None, help="load_state from here first")
    parser.add_argument("--report", default=None, help="write a JSON summary here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="train on CPU even with a GPU")
    args = parser.parse_args(argv)

    accelerator = Accelerator(
        cpu=args.cpu or not torch.cuda.is_available(),
        gradient_accumulation_steps=args.accumulate,
    )
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if accelerator.is_main_process:
        logging.getLogger("memopt").setLevel(logging.INFO)
    set_seed(args.seed)

    micro_batches = args.max_steps * args.accumulate
    train, _ = char_splits(args.block_size, micro_batches * args.batch_size * 2, 1)
    loader = DataLoader(train, batch_size=args.batch_size)
    model = GPT(VOCAB, args.dim, args.depth, 4, args.block_size, dropout=0.1)

    plugin = MemOptPlugin(args.config, log_every=args.log_every)
    model = plugin.apply(model)  # before prepare: the hooks sit on the model's own modules
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    plugin.attach(accelerator)
    if args.resume:
        accelerator.load_state(args.resume)

    losses: list[float] = []
    escalations: dict[str, list[int]] = {}
    step = plugin.steps  # restored by load_state
    for batch in loader:
        if step >= args.max_steps:
            break
        with accelerator.accumulate(model):
            loss = lm_loss(model, batch)
            accelerator.backward(loss)
            report = plugin.after_backward(step, lm_loss, batch)  # lm_loss(model, batch)
            if report is not None:
                escalations.update({k: list(v) for k, v in report.escalated.items()})
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            losses.append(loss.item())
            if accelerator.is_main_process and step % args.log_every == 0:
                print(f"step {step:4d}  loss {losses[-1]:.3f}", flush=True)
            step += 1

    if args.save_state:
        accelerator.save_state(args.save_state)
    summary = {
        "rank": accelerator.process_index,
        "processes": accelerator.num_processes,
        "steps": plugin.steps,
        "final_loss": losses[-1] if losses else None,
        "bits": plugin.bits,
        "escalations": escalations,
        "escalation_count": int(plugin.metrics().get("memopt/escalations", 0)),
    }
    if args.report:
        path = Path(args.report)
        if accelerator.num_processes > 1:
            path = path.with_name(f"{path.name}.rank{accelerator.process_index}")
        path.write_text(json.dumps(summary))
    if accelerator.is_main_process and losses:
        print(f"final training loss: {losses[-1]:.4f} after {plugin.steps} steps", flush=True)
    accelerator.wait_for_everyone()  # no rank tears the process group down while another uses it
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
