"""Train a small ResNet on scikit-learn's bundled handwritten digits with Lightning + memopt.

    python examples/train_digits_lightning.py --config convnet --epochs 5
    python examples/train_digits_lightning.py --no-memopt

The conv-net preset runs BatchNorm on running statistics (after a warm-up), stores dropout masks
as bits and activations at 4 bits; the drift check escalates a layer that needs more.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data import digits  # noqa: E402
from memopt_plugins.callbacks import MemOptCallback  # noqa: E402
from models import SmallResNet  # noqa: E402


class DigitsResNet(pl.LightningModule):
    """``SmallResNet`` for 1-channel 8x8 digits.

    Args:
        width: channels of the first stage (the second has twice as many).
        dropout: dropout before the classifier.
        lr: Adam learning rate.
    """

    def __init__(self, width: int = 32, dropout: float = 0.1, lr: float = 2e-3):
        super().__init__()
        self.save_hyperparameters()
        self.model = SmallResNet(in_channels=1, classes=10, width=width, dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="convnet", help="memopt preset name or YAML file")
    parser.add_argument("--no-memopt", action="store_true", help="train without memopt")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop earlier (-1: no limit)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--log-dir", default="lightning_logs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("memopt").setLevel(logging.INFO)
    pl.seed_everything(args.seed, verbose=False)
    train, val = digits()
    callbacks = [] if args.no_memopt else [MemOptCallback(args.config)]
    trainer = pl.Trainer(
        accelerator="auto",
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        callbacks=callbacks,
        logger=CSVLogger(args.log_dir, name="digits"),
        log_every_n_steps=5,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(
        DigitsResNet(width=args.width),
        DataLoader(train, batch_size=args.batch_size, shuffle=True),
        DataLoader(val, batch_size=256),
    )
    result = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    print("validation: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(result.items())))
    return result


if __name__ == "__main__":
    main()
