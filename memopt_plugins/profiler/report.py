"""The per-module memory report of one training step, and its text forms (table, Markdown, JSON).

:func:`~.run.profile_model` builds it; :meth:`ProfileReport.plot` hands its rows to :mod:`.plot`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..config import OFF_BITS, MemOptConfig
from ..engine import COMPRESS, KEEP
from ..measure.process import batch_fits
from ..measure.step import Measurement
from ..measure.timeline import StepTimeline
from .meter import MemoryReading
from .plot import Bar, plot_holders, plot_timeline
from .units import human_bytes

ROOT = "<root>"  # how the whole model (fqn "") is shown
LOSS_ROW = "<loss_fn>"  # saved outside every module: the loss computed by loss_fn itself


@dataclass(frozen=True)
class StepMemory:
    """One profiled step: the allocator's reading, the per-module count, the timeline, and the
    per-sample slope of the peak and retained bytes (``None`` for a batch of one sample)."""

    reading: MemoryReading
    measurement: Measurement
    timeline: StepTimeline
    per_sample: PerSample | None


@dataclass(frozen=True)
class PerSample:
    """Bytes per sample: the slope between the full batch and its first half, so that what
    does not grow with the batch (weights, gradients, optimizer state, workspaces) cancels."""

    samples: tuple[int, int]  # the two batch sizes
    retained: float
    peak: float


def step_fits(before: StepMemory, after: StepMemory | None) -> float | None:
    """How many times larger a batch fits with memopt (:func:`.process.batch_fits`): the step's
    peak per sample without it (``before``) over the same with it (``after``). ``None`` without
    ``after`` or a per-sample slope. The profile report and ``memopt plan`` print this figure,
    and ``MemOptProfileCallback`` logs it as ``memopt/batch_fits_x``."""
    if after is None or before.per_sample is None or after.per_sample is None:
        return None
    return batch_fits(before.per_sample.peak, after.per_sample.peak)


def fits_line(before: StepMemory, after: StepMemory | None) -> str | None:
    """:func:`step_fits` in words, with the per-sample figures it is read from."""
    fits = step_fits(before, after)
    if fits is None:
        return None
    was, now = before.per_sample, after.per_sample
    return (
        f"a batch {fits:.1f}x as large fits: peak per sample {human_bytes(was.peak)}"
        f" -> {human_bytes(now.peak)} (retained per sample "
        f"{human_bytes(was.retained)} -> {human_bytes(now.retained)}; slope "
        f"between batches of {was.samples[0]} and {was.samples[1]})"
    )


@dataclass
class ModuleProfile:
    """One row: a module and everything below it (inclusive), plus what it saves itself."""

    fqn: str
    kind: str
    params: int = 0
    grads: int = 0
    optimizer_state: int = 0
    saved: int = 0  # saved-activation bytes, the module and its children
    self_saved: int = 0  # saved while the module itself was the innermost one running
    tensors: int = 0
    forward_s: float = 0.0  # inclusive forward time of the measured step
    freeable: int = 0  # bytes recompute would free: saved inside, less the inputs it must keep
    kept_inputs: int = 0  # input bytes a recompute region would keep that are freed otherwise
    action: str = KEEP
    bits: int = OFF_BITS
    lean: str | None = None  # the memory-lean op it runs as (ops), e.g. "lean swiglu"
    saved_after: int | None = None
    self_saved_after: int | None = None

    @property
    def label(self) -> str:
        return ROOT if self.fqn == "" else self.fqn

    @property
    def action_text(self) -> str:
        text = f"{self.action} {self.bits}" if self.action == COMPRESS else self.action
        return text if self.lean is None else f"{text}, {self.lean}"


@dataclass
class ProfileReport:
    """Per-module memory of one training step; see :func:`profile_model`.

    ``modules`` lists every module in ``named_modules`` order (``""`` is the model), then
    :data:`LOSS_ROW` when ``loss_fn`` saved tensors outside the model.
    """

    modules: list[ModuleProfile]
    step: StepMemory  # measured without the plan
    step_after: StepMemory | None  # measured with the plan (None: no config given)
    config: MemOptConfig
    has_optimizer: bool = False

    @property
    def reading(self) -> MemoryReading:
        return self.step.reading

    @property
    def after(self) -> MemoryReading | None:
        return self.step_after.reading if self.step_after is not None else None

    @property
    def measurement(self) -> Measurement:
        """The step without the plan, which estimates and plans read."""
        return self.step.measurement

    @property
    def fits(self) -> float | None:
        """How many times larger a batch fits with the plan (:func:`step_fits`): the step's
        peak above its start per sample without the plan over the same with it (``None``
        without a plan or a per-sample slope). The training integrations log this figure for
        the step it profiled (``MemOptProfileCallback``)."""
        return step_fits(self.step, self.step_after)

    def __getitem__(self, fqn: str) -> ModuleProfile:
        for row in self.modules:
            if row.fqn == fqn:
                return row
        raise KeyError(fqn)

    @property
    def saved_total(self) -> int:
        """All saved-activation bytes counted, inside and outside the model."""
        return sum(row.self_saved for row in self.modules)

    @property
    def saved_after_total(self) -> int | None:
        if self.after is None:
            return None
        return sum(row.self_saved_after or 0 for row in self.modules)

    def top(self, n: int | None = None, by: str = "saved") -> list[ModuleProfile]:
        """The ``n`` largest rows by ``by`` (``saved`` or ``self_saved``), in model order.

        By inclusive bytes a parent is never below its child, so the cut keeps whole branches.
        """
        order = {id(row): i for i, row in enumerate(self.modules)}
        depth = {id(row): row.fqn.count(".") + bool(row.fqn) for row in self.modules}
        ranked = sorted(self.modules, key=lambda r: (-getattr(r, by), depth[id(r)], order[id(r)]))
        chosen = ranked if n is None else ranked[:n]
        return sorted(chosen, key=lambda r: order[id(r)])

    # ----------------------------------------------------------------- text
    def summary(self) -> str:
        """A few lines of totals: counted vs measured, where the step peaks, and what the plan
        does, per sample too."""
        r = self.reading
        total = self.saved_total
        lines = [
            f"memopt profile: one training step on {r.device}",
            f"saved activations: {human_bytes(total)} counted in "
            f"{sum(row.tensors for row in self.modules if row.fqn in ('', LOSS_ROW))} tensors; "
            f"measured retained {human_bytes(r.retained)}, peak {human_bytes(r.peak)}",
            _peak_line(self.step),
            f"parameters {human_bytes(self.modules[0].params)}, "
            f"gradients {human_bytes(self.modules[0].grads)}"
            + (
                f", optimizer state {human_bytes(self.modules[0].optimizer_state)}"
                if self.has_optimizer
                else ""
            )
            + " (held before the step, not in its figures)",
        ]
        if self.step_after is not None:
            after_step = self.step_after
            after = self.saved_after_total or 0
            ratio = f" ({total / after:.1f}x less)" if after else ""
            lines.append(
                f"with the plan: {human_bytes(after)} counted{ratio}; measured retained "
                f"{human_bytes(after_step.reading.retained)}, peak "
                f"{human_bytes(after_step.reading.peak)}, compressed payloads "
                f"{human_bytes(after_step.reading.packed)}"
            )
            lines.append("with the plan, " + _peak_line(after_step))
        fits = fits_line(self.step, self.step_after)
        if fits is not None:
            lines.append(fits)
        return "\n".join(lines)

    def _rows(self, top: int | None) -> tuple[list[str], list[list[str]], list[bool]]:
        total = self.saved_total or 1
        header = ["module", "kind", "params", "grads"]
        header += ["optim"] if self.has_optimizer else []
        header += ["saved", "share", "self", "tensors", "fwd ms", "action"]
        header += ["after"] if self.after is not None else []
        numeric = [False, False] + [True] * (len(header) - 2)
        numeric[header.index("action")] = False
        rows = []
        for row in self.top(top):
            cells = [row.label, row.kind, human_bytes(row.params), human_bytes(row.grads)]
            cells += [human_bytes(row.optimizer_state)] if self.has_optimizer else []
            cells += [
                human_bytes(row.saved),
                f"{100 * row.saved / total:.1f}%",
                human_bytes(row.self_saved),
                str(row.tensors),
                f"{1000 * row.forward_s:.2f}",
                row.action_text,
            ]
            if self.after is not None:
                cells.append(human_bytes(row.saved_after or 0))
            rows.append(cells)
        return header, rows, numeric

    def table(self, top: int | None = None) -> str:
        """An aligned text table of the ``top`` largest holders (all modules by default)."""
        header, rows, numeric = self._rows(top)
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

        def line(cells: list[str]) -> str:
            return "  ".join(
                c.rjust(w) if num else c.ljust(w)
                for c, w, num in zip(cells, widths, numeric, strict=True)
            ).rstrip()

        return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])

    def __str__(self) -> str:
        return f"{self.summary()}\n\n{self.table()}"

    def to_markdown(
        self, top: int | None = None, image: str | None = None, timeline: str | None = None
    ) -> str:
        """The summary and the table as Markdown, with links under the summary to the PNGs
        written beside it: ``image`` (:meth:`plot`) and ``timeline`` (:meth:`plot_timeline`)."""
        header, rows, numeric = self._rows(top)
        out = ["# Memory profile", "", *(f"- {s}" for s in self.summary().splitlines()[1:]), ""]
        if image:
            out += [f"![saved activations by module]({image})", ""]
        if timeline:
            out += [f"![the step's memory over time]({timeline})", ""]
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "|".join("---:" if num else "---" for num in numeric) + "|")
        out += ["| " + " | ".join([f"`{r[0]}`", *r[1:]]) + " |" for r in rows]
        out += ["", "Bytes are saved-activation bytes unless named otherwise; `saved` includes the"]
        out += [
            "children, `self` is what the module saved itself; `after` is measured with the plan."
        ]
        return "\n".join(out) + "\n"

    def to_dict(self) -> dict[str, Any]:
        """Plain data (bytes as integers, seconds as floats) for JSON."""
        return {
            "device": self.reading.device,
            "config": self.config.to_dict(),
            "totals": {
                "saved": self.saved_total,
                "saved_after": self.saved_after_total,
                "measured": asdict(self.reading),
                "measured_after": asdict(self.after) if self.after is not None else None,
                "peak": _peak_dict(self.step),
                "peak_after": _peak_dict(self.step_after) if self.step_after else None,
                "fits": self.fits,
            },
            "modules": [asdict(row) for row in self.modules],
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)

    def plot(self, path: str | Path, top: int = 15) -> Path:
        """Write a PNG bar chart of the ``top`` largest holders (self bytes), before/after the plan.

        Needs matplotlib (``pip install memopt-plugins[plot]``).
        """
        rows = [row for row in self.top(top, by="self_saved") if row.self_saved > 0]
        rows.sort(key=lambda row: row.self_saved, reverse=True)
        after = self.after is not None
        bars = [
            Bar(
                row.label,
                row.self_saved,
                (row.self_saved_after or 0) if after else None,
                row.action_text,
            )
            for row in rows
        ]
        totals = (self.saved_total, (self.saved_after_total or 0) if after else None)
        return plot_holders(bars, totals, Path(path))

    def plot_timeline(self, path: str | Path) -> Path:
        """Write a PNG of the step's live bytes over time, by kind, without and with the plan
        (the picture of PyTorch's memory snapshot viewer). Needs matplotlib."""
        steps = [("without memopt", self.step.timeline)]
        if self.step_after is not None:
            steps.append(("with the plan", self.step_after.timeline))
        return plot_timeline(steps, Path(path))


def _peak_line(step: StepMemory) -> str:
    """Where the step peaks and what is alive there, e.g. ``peak in the backward of lm_head,
    MmBackward0 (aten::mm): activations 40.0 MiB, decoded 2.0 MiB, backward 12.0 MiB``."""
    timeline = step.timeline
    alive = ", ".join(f"{k} {human_bytes(v)}" for k, v in timeline.alive_at_peak.items() if v > 0)
    return f"peak {timeline.site}: {alive or 'nothing'}"


def _peak_dict(step: StepMemory) -> dict[str, Any]:
    site = step.timeline.site
    return {
        "phase": site.phase,
        "op": site.op,
        "node": site.node,
        "module": site.module,
        "alive": dict(step.timeline.alive_at_peak),
        "per_sample": asdict(step.per_sample) if step.per_sample is not None else None,
    }
