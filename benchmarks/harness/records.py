"""What the benchmark records: a :class:`Row` per method, a :class:`WorkloadResult` per workload.

Every phase fills its own fields (memory from :mod:`.memory`, gradient error from
:mod:`.gradients`, step time from :mod:`.timing`, losses from :mod:`.training`);
``benchmarks/report.py`` turns them into tables and the plot, and ``run.py`` writes them to
``results.json`` as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .stats import Paired

#: The row of the baseline trained on other seeds: the run-to-run spread, for scale.
NOISE = "baseline, other seeds"


@dataclass
class Row:
    """Everything measured for one method on one workload (bytes, seconds, plain numbers)."""

    method: str
    family: str
    detail: str = "-"
    retained: int = 0
    meter_retained: int = 0
    peak: int = 0
    packed: int = 0
    step_seconds: float = 0.0
    grad_error: float = 0.0
    val_loss: float | None = None  # mean over the training seeds
    val_spread: float | None = None  # half the range over the seeds (None for one seed)
    accuracy: float | None = None
    train_loss: float | None = None
    train_seconds: float | None = None
    paired: Paired | None = None  # final loss against the baseline's, seed by seed
    short_loss: float | None = None  # held-out loss after the short schedule, mean over seeds
    short_paired: Paired | None = None  # the same comparison on the short schedule
    training: str = "-"
    mean_bits: float | None = None  # compressed modules' mean bits after training, over seeds
    error: str | None = None
    compile_seconds: float | None = None  # compiled methods: the first step's (it compiles)


@dataclass
class WorkloadResult:
    """One workload's rows and how they were made."""

    key: str
    label: str
    title: str
    data: str
    device: str
    measure_shape: str
    rows: list[Row] = field(default_factory=list)
    train_steps: int = 0
    train_shape: str = ""
    lr: float = 0.0
    seeds: int = 0
    short_steps: int | None = None
    short_seeds: int = 0
    bar_seeds: int = 0
    precise_bn: bool = False  # BatchNorm statistics re-estimated before the held-out loss
    compiled: list[Row] = field(default_factory=list)  # whole-model torch.compile (compiled.py)
