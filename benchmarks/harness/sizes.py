"""How big each workload is: :data:`FULL` for ``make bench``, :data:`QUICK` for ``--quick``.

:class:`Sizes` groups them by what they size: the transformers (:class:`GPTSizes`: our GPT and
Hugging Face GPT-2, their text, the GPT's training in :class:`GPTTraining`) and the CNN
(:class:`CNNSizes`, its training and BatchNorm re-estimation in :class:`CNNTraining`).
``workloads.py`` builds the workloads from them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GPTTraining:
    """Our GPT's convergence runs on text, and the held-out text they are judged on."""

    batch: int  # sequences of `length` tokens, for training and held-out batches alike
    length: int
    steps: int
    val_batches: int


@dataclass(frozen=True)
class GPTSizes:
    """The transformers (our GPT and Hugging Face GPT-2), their text and their training."""

    dim: int
    depth: int
    measure_batch: int  # sequences of `measure_len`
    measure_len: int
    text_chars: int  # characters of standard-library source, 90% train and 10% held out
    training: GPTTraining


@dataclass(frozen=True)
class CNNTraining:
    """The CNN's convergence runs on digits, and the BatchNorm re-estimation before evaluation."""

    batch: int
    steps: int
    seeds: int
    short_steps: int  # a second, short schedule, compared seed by seed
    short_seeds: int
    bar_seeds: int  # the short schedule's seeds for the baseline and the loss-bar methods
    calibration: int  # training images that re-estimate BatchNorm statistics (precise BN)


@dataclass(frozen=True)
class CNNSizes:
    """The ResNet-style CNN and its training."""

    width: int
    measure_batch: int
    training: CNNTraining


@dataclass(frozen=True)
class Sizes:
    """How big each workload is; :data:`FULL` for ``make bench``, :data:`QUICK` for a smoke run."""

    gpt: GPTSizes
    cnn: CNNSizes

    def with_train_steps(self, steps: int) -> Sizes:
        """These sizes with ``steps`` training steps for the GPT and the CNN (``--train-steps``)."""
        gpt = replace(self.gpt, training=replace(self.gpt.training, steps=steps))
        cnn = replace(self.cnn, training=replace(self.cnn.training, steps=steps))
        return replace(self, gpt=gpt, cnn=cnn)


FULL = Sizes(
    gpt=GPTSizes(
        dim=128,
        depth=4,
        measure_batch=16,
        measure_len=128,
        text_chars=2_000_000,
        training=GPTTraining(batch=16, length=64, steps=200, val_batches=16),
    ),
    cnn=CNNSizes(
        width=32,
        measure_batch=256,
        training=CNNTraining(
            batch=32,
            steps=150,
            seeds=10,  # the held-out loss (~0.03) moves ~20% between seeds: average many
            short_steps=40,
            short_seeds=30,  # paired changes move ~2-3% between seeds: 30 give a ~1% 95% interval
            bar_seeds=180,  # and 180 a ~0.4% one, for the rows judged against the 1% loss bar
            calibration=512,  # 16 training batches; the same images for every run
        ),
    ),
)
# A smoke run: every workload and method once, in seconds.
_QUICK_GPT = GPTTraining(batch=4, length=32, steps=4, val_batches=2)
_QUICK_CNN = CNNTraining(
    batch=16, steps=4, seeds=2, short_steps=2, short_seeds=3, bar_seeds=4, calibration=64
)
QUICK = Sizes(
    gpt=GPTSizes(
        dim=32, depth=2, measure_batch=4, measure_len=32, text_chars=100_000, training=_QUICK_GPT
    ),
    cnn=CNNSizes(width=8, measure_batch=32, training=_QUICK_CNN),
)
