"""The three workloads of the benchmark: a model, its loss, the batch it is measured on, real data.

* ``gpt``: our character GPT (``examples/models.py``) on the Python standard library's source.
* ``hf-gpt2``: Hugging Face GPT-2 built from a small config (no download), same text.
* ``cnn``: ``SmallResNet`` (ResNet basic blocks, BatchNorm, dropout) on scikit-learn's digits.

Memory, step time and gradient error are taken on one fixed batch of real data (``measure``);
convergence trains from the same initial weights on ``train_batches(seed)`` and reports the mean
loss on the held-out ``val`` batches (BatchNorm statistics re-estimated first, see
:func:`precise_batchnorm`). How big each one is comes from ``sizes.py`` (:class:`sizes.Sizes`:
the full run's or ``--quick``'s).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from examples.data import CharWindows, digits, encode, stdlib_text
from examples.models import GPT, SmallResNet, classification_loss, hf_gpt2_model, lm_loss
from memopt_plugins.tree import map_tensors

from .. import ROOT
from .sizes import Sizes

CONFIGS = ROOT / "configs"

Batch = Any
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


@dataclass
class Workload:
    """One model with its data, as every method sees it.

    Attributes:
        key: short id (``--only``); label: short name (headline columns); title: the heading.
        build: a fresh model with the workload's initial weights (seeded, so every call agrees).
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        block_class: class name of the blocks that PyTorch checkpointing wraps.
        preset: the combined memopt preset for this kind of model (``configs/*.yaml``).
        measure: the batch memory, step time and gradient error are measured on.
        train_batches: ``train_batches(seed)`` -> the batches of one training run, or ``None``
            when the workload is measured but not trained.
        val: held-out batches for the final loss.
        calibration: training batches that re-estimate BatchNorm statistics for the final
            weights before the held-out loss is taken (:func:`precise_batchnorm`); empty for
            models without BatchNorm.
        lr: AdamW learning rate of the training runs.
        seeds: the seeds every method trains with (data order, dropout); results are means.
        short_steps: length of a second, short training schedule (its first batches, the
            learning-rate schedule fitted to it), whose final held-out loss is compared with the
            baseline's seed by seed; ``None``: no short schedule.
        short_seeds: the seeds of the short schedule.
        bar_seeds: the seeds of the short schedule for the baseline and the methods with a loss
            bar (``methods.LOSS_BARS``): more of them, to resolve a 1% difference; they include
            ``short_seeds``, so every method still pairs with the baseline.
        data: a line saying what the data is.
        accuracy: whether the final evaluation also reports classification accuracy.
    """

    key: str
    label: str
    title: str
    build: Callable[[], nn.Module]
    loss_fn: LossFn
    block_class: str
    preset: Path
    measure: Batch
    train_batches: Callable[[int], list[Batch]] | None
    val: list[Batch]
    lr: float
    data: str
    accuracy: bool = False
    seeds: tuple[int, ...] = (0,)
    short_steps: int | None = None
    short_seeds: tuple[int, ...] = ()
    bar_seeds: tuple[int, ...] = ()
    calibration: list[Batch] = field(default_factory=list)
    #: ``optimizer(model, lr)`` when the model's own code builds it (default: AdamW, wd 0.01)
    optimizer: Callable[[nn.Module, float], torch.optim.Optimizer] | None = None
    #: gradient-norm clipping of the model's own training script (``None``: none)
    clip: float | None = None

    def to(self, device: torch.device) -> Workload:
        """Move the batches to ``device`` (models are moved where they are built)."""
        self.measure = to_device(self.measure, device)
        self.val = [to_device(b, device) for b in self.val]
        self.calibration = [to_device(b, device) for b in self.calibration]
        make = self.train_batches
        if make is not None:
            self.train_batches = lambda seed: [to_device(b, device) for b in make(seed)]
        return self


def to_device(batch: Batch, device: torch.device) -> Batch:
    """``batch`` (a tensor or a tuple of tensors) on ``device``."""
    return map_tensors(lambda t: t.to(device), batch)


def _windows(tokens: torch.Tensor, length: int, count: int, seed: int) -> torch.Tensor:
    """``count`` windows of ``length + 1`` tokens at random offsets fixed by ``seed``."""
    offsets = CharWindows(tokens, length, count, seed=seed).offsets.tolist()
    return torch.stack([tokens[o : o + length + 1] for o in offsets])


def _text_splits(sizes: Sizes) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = encode(stdlib_text(sizes.gpt.text_chars))
    cut = int(0.9 * tokens.numel())
    return tokens[:cut], tokens[cut:]


def _char_batches(
    tokens: torch.Tensor, batch: int, length: int, count: int, seed: int
) -> list[torch.Tensor]:
    """``count`` batches of ``batch`` windows (``length + 1`` tokens each)."""
    return list(_windows(tokens, length, batch * count, seed).split(batch))


def gpt_workload(sizes: Sizes) -> Workload:
    """Our character GPT (GPT-2 layout, dropout 0.1) on the standard library's source."""
    gpt, training = sizes.gpt, sizes.gpt.training
    train, val = _text_splits(sizes)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return GPT(vocab=128, dim=gpt.dim, depth=gpt.depth, block_size=128)

    def xy(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return w[:, :-1], w[:, 1:]

    measure = _char_batches(train, gpt.measure_batch, gpt.measure_len, 1, seed=99)[0]
    return Workload(
        key="gpt",
        label="GPT",
        title=f"GPT (examples/models.py, {gpt.depth} blocks x width {gpt.dim})",
        build=build,
        loss_fn=lm_loss,
        block_class="Block",
        preset=CONFIGS / "gpt_int4_auto.yaml",
        measure=xy(measure),
        train_batches=lambda seed: [
            xy(w)
            for w in _char_batches(
                train, training.batch, training.length, training.steps, seed=seed
            )
        ],
        val=[
            xy(w)
            for w in _char_batches(val, training.batch, training.length, training.val_batches, 1)
        ],
        lr=3e-3,
        data=f"characters of the standard library's .py files ({train.numel() / 1e6:.1f} M "
        f"train, {val.numel() / 1e6:.2f} M held out)",
    )


def nanogpt_workload(sizes: Sizes) -> Workload:
    """karpathy/nanoGPT's ``model.py``, unmodified (``benchmarks/clients/nanogpt_model.py``),
    trained as its ``train.py`` trains ``config/train_shakespeare_char.py``, scaled to a CPU: a
    character model (4 layers x 128, 4 heads, no biases, dropout 0.2) on the characters of the
    standard library's source (the GPT workload's data), AdamW from the model's own
    ``configure_optimizers`` (weight decay 0.1 on matrices, betas 0.9 / 0.99), learning rate
    1e-3 warmed up and cosine-decayed to a tenth, gradients clipped at norm 1.0."""
    from ..clients.nanogpt_model import GPT as NanoGPT
    from ..clients.nanogpt_model import GPTConfig

    base = gpt_workload(sizes)
    length = sizes.gpt.training.length

    def build() -> nn.Module:
        torch.manual_seed(0)
        config = GPTConfig(
            block_size=length, vocab_size=128, n_layer=4, n_head=4, n_embd=128, dropout=0.2,
            bias=False,
        )  # fmt: skip
        with contextlib.redirect_stdout(io.StringIO()):  # its parameter count
            return NanoGPT(config)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch  # nanoGPT views its targets: they must be contiguous
        return model(x.contiguous(), y.contiguous())[1]

    def optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
        with contextlib.redirect_stdout(io.StringIO()):  # its parameter groups
            return model.configure_optimizers(0.1, lr, (0.9, 0.99), "cpu")

    return Workload(
        key="nano",
        label="nanoGPT",
        title="karpathy/nanoGPT model.py (4 layers x 128, dropout 0.2), as its train.py trains",
        build=build,
        loss_fn=loss_fn,
        block_class="Block",
        preset=CONFIGS / "int4_drift.yaml",
        measure=base.measure,
        train_batches=base.train_batches,
        val=base.val,
        lr=1e-3,
        data=base.data,
        optimizer=optimizer,
        clip=1.0,
    )


def hf_lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Hugging Face causal-LM loss (the model shifts the labels itself)."""
    return model(input_ids=batch, labels=batch).loss


def hf_gpt2_workload(sizes: Sizes, trained: bool = False) -> Workload:
    """Hugging Face GPT-2 from a config (the tests' too), with ASCII vocabulary and dropout 0.1.

    Measured only in the bench: its training curve would repeat the GPT's at twice the cost.
    ``trained``: with the GPT's training and held-out text batches (``drift_metrics.py``).
    """
    gpt = sizes.gpt
    train, val = _text_splits(sizes)

    def build() -> nn.Module:
        return hf_gpt2_model(128, 128, gpt.dim, gpt.depth, dropout=0.1, use_cache=False)

    measure = _char_batches(train, gpt.measure_batch, gpt.measure_len - 1, 1, seed=99)[0]
    t = gpt.training

    def train_batches(seed: int) -> list[torch.Tensor]:
        return _char_batches(train, t.batch, t.length, t.steps, seed)

    return Workload(
        key="hf-gpt2",
        label="HF GPT-2",
        title=f"Hugging Face GPT-2 (transformers, from a config: {gpt.depth} layers x "
        f"width {gpt.dim}, eager attention)",
        build=build,
        loss_fn=hf_lm_loss,
        block_class="GPT2Block",
        preset=CONFIGS / "gpt_int4_auto.yaml",
        measure=measure,
        train_batches=(
            (lambda seed: _char_batches(train, t.batch, t.length, t.steps, seed))
            if trained
            else None
        ),
        val=_char_batches(val, t.batch, t.length, t.val_batches, 1) if trained else [],
        lr=3e-3,
        data="characters of the standard library's .py files"
        + ("" if trained else " (measurement batch only)"),
    )


def cnn_workload(sizes: Sizes) -> Workload:
    """``SmallResNet`` (two stages of basic blocks, BatchNorm, dropout 0.1) on 8x8 digits."""
    cnn, training = sizes.cnn, sizes.cnn.training
    train, val = digits(val_fraction=0.2, seed=0)
    images, labels = train.tensors

    def build() -> nn.Module:
        torch.manual_seed(0)
        return SmallResNet(in_channels=1, classes=10, width=cnn.width)

    def train_batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(seed)
        per_epoch = len(labels) // training.batch
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        while len(out) < training.steps:
            order = torch.randperm(len(labels), generator=generator)
            for chunk in order[: per_epoch * training.batch].split(training.batch):
                out.append((images[chunk], labels[chunk]))
        return out[: training.steps]

    val_x, val_y = val.tensors
    n = cnn.measure_batch
    return Workload(
        key="cnn",
        label="CNN",
        title=f"ResNet-style CNN (examples/models.py SmallResNet, width {cnn.width})",
        build=build,
        loss_fn=classification_loss,
        block_class="BasicBlock",
        preset=CONFIGS / "convnet.yaml",
        measure=(images[:n], labels[:n]),
        train_batches=train_batches,
        val=[(val_x, val_y)],
        lr=3e-3,
        data=f"scikit-learn's load_digits, 8x8 images ({len(labels)} train, {len(val_y)} held out)",
        accuracy=True,
        seeds=tuple(range(training.seeds)),
        short_steps=training.short_steps,
        short_seeds=tuple(range(training.short_seeds)),
        bar_seeds=tuple(range(max(training.bar_seeds, training.short_seeds))),
        calibration=list(
            zip(
                images[: training.calibration].split(training.batch),
                labels[: training.calibration].split(training.batch),
                strict=True,
            )
        ),
    )


def workloads(sizes: Sizes) -> list[Workload]:
    """All three workloads at ``sizes``."""
    return [gpt_workload(sizes), hf_gpt2_workload(sizes), cnn_workload(sizes)]


def precise_batchnorm(model: nn.Module, workload: Workload) -> None:
    """Re-estimate every BatchNorm's running statistics for the model's current weights.

    Running statistics are an average over the steps of training, each step's batch seen by that
    step's weights; after a short schedule they lag the final weights (on the CNN's 40 steps the
    held-out loss in eval mode read 0.33 with them against 0.18 re-estimated, a mean over 60
    seeds), and anything that moves them moves the loss: ``torch.utils.checkpoint`` updates them
    twice a step (the replayed forward), which read as an 11% lower loss with gradients equal to
    the baseline's. The held-out loss is meant to judge the weights, so every method is evaluated
    with statistics re-estimated the same way ("precise BN", Wu & Johnson, *Rethinking "Batch" in
    BatchNorm*, 2021): a cumulative average over ``workload.calibration`` (training images in
    training-size batches: 512 of them for the full CNN), in training mode, without grad, with a
    fixed RNG seed (the same dropout masks for every method; the global RNG is left as it was).
    """
    norms = [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]
    if not norms or not workload.calibration:
        return
    was_training = model.training
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over the calibration batches
    device = norms[0].running_mean.device
    cuda = [device.index or 0] if device.type == "cuda" else []
    model.train()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            torch.manual_seed(0)
            for batch in workload.calibration:
                workload.loss_fn(model, batch)
    finally:
        for m, momentum in zip(norms, momenta, strict=True):
            m.momentum = momentum
        model.train(was_training)


def evaluate(model: nn.Module, workload: Workload) -> tuple[float, float | None]:
    """Mean loss over the held-out batches (eval mode, no grad), and accuracy where it applies."""
    was_training = model.training
    model.eval()
    losses, correct, total = [], 0, 0
    with torch.no_grad():
        for batch in workload.val:
            if workload.accuracy:
                x, y = batch
                logits = model(x)
                losses.append(float(F.cross_entropy(logits, y)))
                correct += int((logits.argmax(-1) == y).sum())
                total += len(y)
            else:
                losses.append(float(workload.loss_fn(model, batch)))
    model.train(was_training)
    return sum(losses) / len(losses), (correct / total if total else None)
