"""Train a character-level GPT on the Python standard library's source with Lightning + memopt.

    python examples/train_gpt_lightning.py --config int4_drift --max-steps 300
    python examples/train_gpt_lightning.py --no-memopt          # the same run without memopt

The corpus is the ``.py`` files of the standard library of the Python running this script, so
nothing is downloaded. Watch ``memopt/*`` in the CSV log (``--log-dir``) and the ``memopt`` lines
on the console (plan, memory kept for backward, drift checks and escalations).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data import VOCAB, char_splits  # noqa: E402
from memopt_plugins.callbacks import MemOptCallback  # noqa: E402
from models import GPT, lm_loss  # noqa: E402


def gpt2_init(module: nn.Module) -> None:
    """GPT-2's initialization: N(0, 0.02) weights, zero biases (the tied head starts small)."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class CharGPT(pl.LightningModule):
    """A GPT-2-style character model (``examples/models.py``) as a LightningModule.

    Args:
        dim, depth, heads, block_size, dropout: the transformer's shape.
        lr: AdamW learning rate (cosine decay to 10% over ``max_steps``).
        max_steps: length of the learning-rate schedule.
    """

    def __init__(
        self,
        dim: int = 128,
        depth: int = 4,
        heads: int = 4,
        block_size: int = 128,
        dropout: float = 0.1,
        lr: float = 3e-3,
        max_steps: int = 1000,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(VOCAB, dim, depth, heads, block_size, dropout)
        self.model.apply(gpt2_init)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        loss = lm_loss(self, batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        self.log("val_loss", lm_loss(self, batch), prog_bar=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        total = max(1, self.hparams.max_steps)

        def schedule(step: int) -> float:
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class PrintLoss(Callback):
    """Prints the training loss every ``every`` optimizer steps (the demo runs without a bar)."""

    def __init__(self, every: int = 25, label: str = ""):
        self.every = every
        self.label = label
        self.started = 0.0
        self.losses: list[float] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        step = trainer.global_step
        if step % self.every == 0:
            elapsed = time.perf_counter() - self.started
            print(
                f"{self.label}step {step:4d}  loss {self.losses[-1]:.3f}  ({elapsed:.0f} s)",
                flush=True,
            )


def loaders(
    block_size: int, batch_size: int, steps: int, val_batches: int = 8
) -> tuple[DataLoader, DataLoader]:
    """Train windows for ``steps`` batches and a fixed validation set of ``val_batches``."""
    train, val = char_splits(block_size, steps * batch_size, val_batches * batch_size)
    return (
        DataLoader(train, batch_size=batch_size, shuffle=False),
        DataLoader(val, batch_size=batch_size),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="int4_drift", help="memopt preset name or YAML file")
    parser.add_argument("--no-memopt", action="store_true", help="train without memopt")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--log-dir", default="lightning_logs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("memopt").setLevel(logging.INFO)
    if args.threads:
        torch.set_num_threads(args.threads)
    pl.seed_everything(args.seed, verbose=False)

    train, val = loaders(args.block_size, args.batch_size, args.max_steps)
    model = CharGPT(
        dim=args.dim,
        depth=args.depth,
        block_size=args.block_size,
        lr=args.lr,
        max_steps=args.max_steps,
    )
    callbacks: list[Callback] = [PrintLoss()]
    if not args.no_memopt:
        callbacks.insert(0, MemOptCallback(args.config))
    trainer = pl.Trainer(
        accelerator="auto",
        max_steps=args.max_steps,
        callbacks=callbacks,
        logger=CSVLogger(args.log_dir, name="gpt"),
        log_every_n_steps=10,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, train, val)
    print(f"final validation loss: {float(trainer.callback_metrics['val_loss']):.4f}")


if __name__ == "__main__":
    main()
