"""What the benchmarks record: a :class:`Row` per method and model, a workload's rows together.

Every study (``run.py``'s results.md, ``fits.py``, ``depth.py``) fills a :class:`Row`: who it is
(model, method), what every study reads (bytes at the measured batch, bytes per sample, the batch
that fits, speed), and the group of its own study (:class:`Bench` and :class:`Trained`,
:class:`BatchFit`, :class:`Depth`). The JSON files stay flat: :meth:`Row.to_json` writes the
fields that are set and the whole of each group present, :meth:`Row.from_json` reads them back.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .stats import Paired

#: The row of the baseline trained on other seeds: the run-to-run spread, for scale.
NOISE = "baseline, other seeds"


@dataclass
class Bench:
    """results.md's method record beside its memory: how it was applied and how it went."""

    family: str
    detail: str = "-"
    meter_retained: int = 0
    packed: int = 0
    grad_error: float = 0.0
    error: str | None = None
    compile_seconds: float | None = None  # compiled methods: the first step's (it compiles)


@dataclass
class Trained:
    """results.md's training outcome of a method (means over the training seeds)."""

    val_loss: float | None = None
    val_spread: float | None = None  # half the range over the seeds (None for one seed)
    accuracy: float | None = None
    train_loss: float | None = None
    train_seconds: float | None = None
    paired: Paired | None = None  # final loss against the baseline's, seed by seed
    short_loss: float | None = None  # held-out loss after the short schedule
    short_paired: Paired | None = None  # the same comparison on the short schedule
    training: str = "-"
    mean_bits: float | None = None  # compressed modules' mean bits after training

    def __post_init__(self) -> None:
        # read back from JSON, a comparison is a dict: it is a Paired again
        for name in ("paired", "short_paired"):
            if isinstance(getattr(self, name), dict):
                setattr(self, name, Paired(**getattr(self, name)))


@dataclass
class BatchFit:
    """fits.py's batch: the one that fits in the baseline's memory, and its timing processes."""

    batch: int = 0
    fits_compiled: float | None = None  # torch.compile rows: against the compiled baseline
    # the peak's slope one halving lower (a quarter to a half of the batch): how stable it is
    peak_per_sample_below: float | None = None
    samples_per_s_runs: list[float] = field(default_factory=list)  # one per timing process


@dataclass
class Depth:
    """depth.py's model depth and where its step peaks."""

    layers: int
    peak_site: str
    alive_at_peak: dict[str, int]  # at the largest batch, by kind (the timeline's)
    peak_slopes: list[float] = field(default_factory=list)  # between batches, smallest first
    retained_slopes: list[float] = field(default_factory=list)
    kept: float = 1.0  # the baseline's retained per sample over this row's


#: The groups a row may hold: its field name, the group's class.
GROUPS = {"bench": Bench, "trained": Trained, "batch_fit": BatchFit, "depth": Depth}


@dataclass
class Row:
    """One method measured on one model (bytes, seconds, plain numbers; None: not read)."""

    method: str
    model: str | None = None  # None in results.json, whose workload names it
    peak: int | None = None  # the step's peak at the measured batch
    retained: int | None = None  # kept for backward at the measured batch
    peak_per_sample: float | None = None  # slope between two batches
    retained_per_sample: float | None = None
    fits: float | None = None  # the baseline's peak per sample over this row's
    step_seconds: float | None = None
    samples_per_s: float | None = None  # fits.py: median over timing processes (0: not timed)
    bench: Bench | None = None
    trained: Trained | None = None
    batch_fit: BatchFit | None = None
    depth: Depth | None = None

    def to_json(self) -> dict[str, Any]:
        """Flat: the fields that are set, then every field of each group present."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in GROUPS}
        out = {k: v for k, v in out.items() if v is not None}
        for name in GROUPS:
            group = getattr(self, name)
            if group is not None:
                out.update(asdict(group))
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Row:
        """The row :meth:`to_json` wrote: a group for each whose fields are there; an unknown
        field raises (``TypeError``)."""
        rest, groups = dict(data), {}
        for name, kind in GROUPS.items():
            names = [f.name for f in fields(kind)]
            if any(n in rest for n in names):
                groups[name] = kind(**{n: rest.pop(n) for n in names if n in rest})
        return cls(**rest, **groups)


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

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return out | {k: [r.to_json() for r in out[k]] for k in ("rows", "compiled")}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkloadResult:
        rows = {k: [Row.from_json(r) for r in data.get(k, [])] for k in ("rows", "compiled")}
        return cls(**(data | rows))


def harness_row(method: str, family: str, detail: str = "-") -> Row:
    """A results.md row before any phase fills it: zero bytes and seconds, nothing trained."""
    bench, trained = Bench(family, detail), Trained()
    return Row(method, peak=0, retained=0, step_seconds=0.0, bench=bench, trained=trained)


def load_results(path: Path) -> tuple[dict[str, Any], list[WorkloadResult]]:
    """``results.json``'s meta and its workloads, with their rows."""
    payload = json.loads(path.read_text())
    return payload["meta"], [WorkloadResult.from_json(w) for w in payload["workloads"]]


def write_results_json(path: Path, meta: dict[str, Any], workloads: list[WorkloadResult]) -> None:
    payload = {"meta": meta, "workloads": [w.to_json() for w in workloads]}
    path.write_text(json.dumps(payload, indent=1) + "\n")
