"""A Hugging Face ``Trainer`` with memopt: GPT-2 (from a config) on the standard library's source.

    python examples/train_hf_trainer.py --config int4_drift --max-steps 200
    python examples/train_hf_trainer.py --lora 8        # rank-8 LoRA adapters (peft), base frozen
    torchrun --nproc_per_node 2 examples/train_hf_trainer.py --cpu    # DDP, gloo on CPU

The model is built from ``GPT2Config`` (nothing is downloaded) and reads characters: each sample
is ``block_size`` ASCII codes of the standard library's ``.py`` files (``examples/data.py``),
with the inputs as labels (the model shifts them). The one memopt line is the callback in
``Trainer(..., callbacks=[MemOptTrainerCallback(config)])``: the ``memopt/*`` metrics appear in
the Trainer's logs and in ``trainer_state.json`` of every checkpoint, escalations on the console.

``--resume DIR`` continues from a ``checkpoint-N`` folder (memopt's bits and drift history
included). ``--report FILE`` writes a JSON summary per process (``FILE`` gets ``.rank<N>``
appended under several processes).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data import VOCAB, CharWindows, char_splits  # noqa: E402
from models import hf_gpt2_model  # noqa: E402

from memopt_plugins.transformers import MemOptTrainerCallback  # noqa: E402


class CausalLMWindows(Dataset):
    """:class:`CharWindows` as the Trainer's causal-LM samples: ``{input_ids, labels}``."""

    def __init__(self, windows: CharWindows):
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, _ = self.windows[i]
        return {"input_ids": x, "labels": x}


def gpt2(block_size: int, dim: int, depth: int, dropout: float) -> GPT2LMHeadModel:
    """A character-level GPT-2 built from a config."""
    return hf_gpt2_model(VOCAB, block_size, dim, depth, dropout, eager=False, seed=None)


def with_lora(model: GPT2LMHeadModel, rank: int) -> torch.nn.Module:
    """LoRA adapters (peft) on every attention and MLP projection; the base weights are frozen."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=["c_attn", "c_proj", "c_fc"],
        fan_in_fan_out=True,  # GPT-2's projections are Conv1D: weights stored transposed
        lora_dropout=0.0,
    )
    return get_peft_model(model, config)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="int4_drift", help="memopt preset name or YAML file")
    parser.add_argument("--max-steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--accumulate", type=int, default=1, help="gradient accumulation")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="LoRA rank (0: off)")
    parser.add_argument("--logging-steps", type=int, default=25)
    parser.add_argument("--save-steps", type=int, default=0, help="checkpoint every N (0: none)")
    parser.add_argument("--output-dir", default="runs/hf_trainer")
    parser.add_argument("--resume", default=None, help="a checkpoint-N folder to resume from")
    parser.add_argument("--report", default=None, help="write a JSON summary here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="train on CPU even with a GPU")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("memopt").setLevel(logging.INFO)

    samples = args.max_steps * args.accumulate * args.batch_size
    train, _ = char_splits(args.block_size, samples, 1)
    torch.manual_seed(args.seed)
    model = gpt2(args.block_size, args.dim, args.depth, args.dropout)
    if args.lora:
        model = with_lora(model, args.lora)

    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulate,
        learning_rate=args.lr,
        logging_steps=args.logging_steps,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to="none",
        use_cpu=args.cpu or not torch.cuda.is_available(),
        seed=args.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    memopt = MemOptTrainerCallback(args.config)
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=CausalLMWindows(train),
        callbacks=[memopt],
    )
    result = trainer.train(resume_from_checkpoint=args.resume)

    state = memopt.state_dict()
    summary = {
        "rank": trainer.args.process_index,
        "processes": trainer.args.world_size,
        "steps": trainer.state.global_step,
        "train_loss": result.training_loss,
        "bits": memopt.bits,
        "checks": [h["step"] for h in state["drift"]["history"]],
        "escalations": state["drift"]["escalations"],
        "logged": [r for r in trainer.state.log_history if "memopt/escalations" in r],
        # equal on every rank under DDP: the drift check never touches gradients
        "weights_sum": sum(float(p.double().sum()) for p in model.parameters()),
    }
    if args.report:
        path = Path(args.report)
        if trainer.args.world_size > 1:
            path = path.with_name(f"{path.name}.rank{trainer.args.process_index}")
        path.write_text(json.dumps(summary))
    if trainer.is_world_process_zero():
        low = sum(b <= 4 for b in memopt.bits.values())
        print(
            f"trained {summary['steps']} steps, loss {result.training_loss:.4f}; "
            f"{summary['escalations']} escalations, {low} of {len(memopt.bits)} compressed "
            "modules at 4 bits or fewer",
            flush=True,
        )
    return summary


if __name__ == "__main__":
    main()
