"""Per-module memory report of one training step, and a config proposed from it.

:func:`profile_model` runs one step of ``loss_fn(model, batch)`` and attributes every tensor that
autograd saves for backward to the innermost module running when it is saved (a
``saved_tensors_hooks`` pack counter; a storage saved several times counts once). The bytes roll
up to the parents, next to each module's parameters, gradients, optimizer state and forward time.
With a config it runs the step again with :class:`~memopt_plugins.MemoryOptimizer` applied and
counts once more, so "after" is measured, not estimated. The model, its gradients, the optimizer
state and the global RNG are left as they were.

:func:`suggest_config` turns a report into a config for a memory budget: recompute the cheap
modules that free the most bytes per second of recompute, then compress the rest.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from .config import MemOptConfig, QuantizeConfig, load_config
from .engine import MemoryOptimizer, patched_by
from .patching import forward_hook, forward_pre_hook
from .profile import MemoryMeter, MemoryReading
from .select import ACTIVATION, COMPUTE, DROPOUT, NORM, layer_kind, parent_fqns

ROOT = "<root>"  # how the whole model (fqn "") is shown
LOSS_ROW = "<loss_fn>"  # saved outside every module: the loss computed by loss_fn itself

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``: binary units with one decimal, whole bytes below 1 KiB."""
    value = float(n)
    if abs(value) < 1024:
        return f"{value:.0f} B"
    for unit in _UNITS[1:]:
        value /= 1024
        if abs(round(value, 1)) < 1024 or unit == _UNITS[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- counting


@dataclass(frozen=True)
class SavedTensor:
    """One storage held for backward at the end of the forward, and who saved it."""

    owner: str  # innermost module running when it was first saved ("" = root, LOSS_ROW)
    nbytes: int  # bytes held (whole storage, or the compact payload under compression)
    element_size: int
    floating: bool  # floating point, kept as it is: compression would apply
    numel: int
    inputs_of: tuple[str, ...]  # running modules it was an input of (recompute keeps it)


def _tensors(obj: object) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from _tensors(item)


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Entry:
    __slots__ = ("owner", "nbytes", "element_size", "floating", "numel", "inputs_of", "refs")

    def __init__(self, owner, nbytes, element_size, floating, numel, inputs_of, ref):
        self.owner = owner
        self.nbytes = nbytes
        self.element_size = element_size
        self.floating = floating
        self.numel = numel
        self.inputs_of = inputs_of
        self.refs = [ref]

    def alive(self) -> bool:
        return any(r() is not None for r in self.refs)


class _StepCounter:
    """Module hooks (a stack of running modules, forward time) and a saved-tensor pack counter.

    Storages that existed before the step (parameters, buffers, the batch) are not counted: the
    step does not allocate them. A storage is keyed by its address, and an address is trusted
    only while a tensor saved with it is alive (addresses are reused as soon as memory is freed).
    """

    def __init__(self, fqn_of: Mapping[nn.Module, str], sync: Callable[[], None]):
        self.fqn_of = fqn_of
        self.sync = sync
        self.skip: frozenset[int] = frozenset()
        self.stack: list[tuple[str, float, frozenset[int]]] = []
        self.time: dict[str, float] = defaultdict(float)
        self.raw: dict[int, _Entry] = {}
        self.packed: list[_Entry] = []
        # fqn -> input storages of its calls: {address: [a tensor on it, storage bytes, saved?]}
        self.inputs: dict[str, dict[int, list]] = defaultdict(dict)
        self.input_records: dict[int, list[list]] = defaultdict(list)
        self.active = False
        self._handles: list = []

    def install(self, modules: Iterator[nn.Module]) -> None:
        for module in modules:
            fqn = self.fqn_of.get(module)
            if fqn is None:
                continue  # a wrapper the optimizer added: its saves belong to the enclosing module
            self._handles.append(forward_pre_hook(module, self._enter(fqn), with_kwargs=True))
            self._handles.append(forward_hook(module, self._leave, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter(self, fqn: str) -> Callable:
        def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.active:
                tensors = [t for t in _tensors((args, kwargs)) if t.numel()]
                inputs = frozenset(_ptr(t) for t in tensors)
                mine = self.inputs[fqn]
                for t in tensors:
                    ptr = _ptr(t)
                    if ptr not in self.skip and ptr not in mine:
                        entry = self.raw.get(ptr)
                        held = entry is not None and entry.alive()
                        record = [weakref.ref(t), t.untyped_storage().nbytes(), held]
                        mine[ptr] = record
                        self.input_records[ptr].append(record)
                self.sync()
                self.stack.append((fqn, time.perf_counter(), inputs))

        return enter

    def _leave(self, module: nn.Module, args: object, output: object) -> None:
        if self.active and self.stack:
            self.sync()
            fqn, start, _ = self.stack.pop()
            self.time[fqn] += time.perf_counter() - start

    def _owner(self) -> str:
        return self.stack[-1][0] if self.stack else LOSS_ROW

    def _inputs_of(self, ptr: int) -> tuple[str, ...]:
        return tuple(fqn for fqn, _, inputs in self.stack if ptr in inputs)

    def count_raw(self, t: torch.Tensor) -> None:
        """Count a tensor autograd keeps as it is (deduplicated by storage)."""
        if isinstance(t, nn.Parameter) or t.numel() == 0:
            return
        ptr = _ptr(t)
        if ptr in self.skip:
            return
        for record in self.input_records.get(ptr, ()):
            if record[0]() is not None:  # alive: the same storage, not a reused address
                record[2] = True
        entry = self.raw.get(ptr)
        if entry is not None and entry.alive():
            entry.refs.append(weakref.ref(t))
            return
        storage_bytes = t.untyped_storage().nbytes()
        self.raw[ptr] = _Entry(
            self._owner(),
            storage_bytes,
            t.element_size(),
            t.is_floating_point() and storage_bytes >= t.nbytes,  # not a broadcast view
            t.numel(),
            self._inputs_of(ptr),
            weakref.ref(t),
        )

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.count_raw(t)
        return t

    def wrap_compression(self, pack: Callable, stats: Any) -> Callable:
        """Count what the compression hooks keep: the compact bytes they add, or ``t`` itself."""

        def counting_pack(t: torch.Tensor, bits: int) -> object:
            before = stats.held_bytes
            saved = pack(t, bits)
            if saved is t:
                self.count_raw(t)
                return saved
            added = stats.held_bytes - before
            if added > 0:  # 0: a cache hit, already counted where it was first packed
                ptr = _ptr(t)
                self.packed.append(
                    _Entry(
                        self._owner(), added, 1, False, 0, self._inputs_of(ptr), weakref.ref(saved)
                    )
                )
            return saved

        return counting_pack

    @contextmanager
    def counting(self, skip: frozenset[int]) -> Iterator[None]:
        self.skip = skip
        self.stack.clear()
        self.time.clear()
        self.raw.clear()
        self.packed.clear()
        self.inputs.clear()
        self.input_records.clear()
        self.active = True
        try:
            with saved_tensors_hooks(self.pack, lambda t: t):
                yield
        finally:
            self.active = False
            self.stack.clear()

    def held(self) -> list[SavedTensor]:
        """What is still held now (call right after the forward)."""
        return [
            SavedTensor(e.owner, e.nbytes, e.element_size, e.floating, e.numel, e.inputs_of)
            for e in (*self.raw.values(), *self.packed)
            if e.alive()
        ]

    def freed_inputs(self) -> dict[str, int]:
        """Per module, bytes of its inputs that nothing holds after the forward: a recompute
        region keeps its inputs, so recomputing the module would hold these too."""
        out = {}
        for fqn, inputs in self.inputs.items():
            out[fqn] = sum(
                nbytes for ref, nbytes, saved in inputs.values() if not saved and ref() is None
            )
        return out


# --------------------------------------------------------------------------- report


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
    cheap: bool = False  # cheap to recompute: activation, norm, dropout or an MLP-like block
    action: str = "keep"
    bits: int = 32
    saved_after: int | None = None
    self_saved_after: int | None = None

    @property
    def label(self) -> str:
        return ROOT if self.fqn == "" else self.fqn

    @property
    def action_text(self) -> str:
        return f"{self.action} {self.bits}" if self.action == "compress" else self.action


@dataclass
class ProfileReport:
    """Per-module memory of one training step; see :func:`profile_model`.

    ``modules`` lists every module in ``named_modules`` order (``""`` is the model), then
    :data:`LOSS_ROW` when ``loss_fn`` saved tensors outside the model.
    """

    modules: list[ModuleProfile]
    reading: MemoryReading  # measured without the plan
    after: MemoryReading | None  # measured with the plan (None: no config given)
    config: MemOptConfig
    saved_tensors: list[SavedTensor] = field(repr=False, default_factory=list)
    has_optimizer: bool = False

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
        """A few lines of totals: counted vs measured, and what the plan does."""
        r = self.reading
        total = self.saved_total
        lines = [
            f"memopt profile: one training step on {r.device}",
            f"saved activations: {human_bytes(total)} counted in "
            f"{sum(row.tensors for row in self.modules if row.fqn in ('', LOSS_ROW))} tensors; "
            f"measured retained {human_bytes(r.retained)}, peak {human_bytes(r.peak)}",
            f"parameters {human_bytes(self.modules[0].params)}, "
            f"gradients {human_bytes(self.modules[0].grads)}"
            + (
                f", optimizer state {human_bytes(self.modules[0].optimizer_state)}"
                if self.has_optimizer
                else ""
            ),
        ]
        if self.after is not None:
            after = self.saved_after_total or 0
            ratio = f" ({total / after:.1f}x less)" if after else ""
            lines.append(
                f"with the plan: {human_bytes(after)} counted{ratio}; measured retained "
                f"{human_bytes(self.after.retained)}, peak {human_bytes(self.after.peak)}, "
                f"compressed payloads {human_bytes(self.after.packed)}"
            )
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

    def to_markdown(self, top: int | None = None, image: str | None = None) -> str:
        """The summary and the table as Markdown (``image``: a PNG to link under the summary)."""
        header, rows, numeric = self._rows(top)
        out = ["# Memory profile", "", *(f"- {s}" for s in self.summary().splitlines()[1:]), ""]
        if image:
            out += [f"![saved activations by module]({image})", ""]
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
        return _plot(self, Path(path), top)


# --------------------------------------------------------------------------- profiling


def _linear_like(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, nn.Linear) or name == "Conv1D" or "Linear" in name


def cheap_to_recompute(module: nn.Module) -> bool:
    """Activation, norm and dropout layers, and MLP-like blocks (linear layers around an
    activation, no attention, convolution or embedding): recomputing them costs little."""
    kind = layer_kind(module)
    if kind in (ACTIVATION, NORM, DROPOUT):
        return True
    if kind == COMPUTE or not any(True for _ in module.children()):
        return False
    kinds = [layer_kind(m) for m in module.modules()]
    if ACTIVATION not in kinds:
        return False
    return all(
        k != COMPUTE or _linear_like(m) for k, m in zip(kinds, module.modules(), strict=True)
    )


@contextmanager
def _model_preserved(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """Parameters, buffers, gradients and optimizer state are restored on exit."""
    grads = {p: p.grad for p in model.parameters()}
    for p in grads:
        p.grad = None
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    params = [(p, p.detach().clone()) for p in grads] if optimizer is not None else []
    state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value in (*buffers, *params):
                tensor.copy_(value)
        for p, g in grads.items():
            p.grad = g
        if optimizer is not None:
            optimizer.load_state_dict(state)


def _add_up(rows: dict[str, ModuleProfile], owner: str, attr: str, nbytes: int) -> None:
    for fqn in (owner, *parent_fqns(owner)):
        row = rows[fqn]
        setattr(row, attr, getattr(row, attr) + nbytes)


def _roll_up_saved(rows: dict[str, ModuleProfile], held: list[SavedTensor], after: bool) -> None:
    total, own = ("saved_after", "self_saved_after") if after else ("saved", "self_saved")
    for row in rows.values():
        setattr(row, total, 0)
        setattr(row, own, 0)
    for s in held:
        setattr(rows[s.owner], own, getattr(rows[s.owner], own) + s.nbytes)
        chain = [s.owner] if s.owner == LOSS_ROW else [s.owner, *parent_fqns(s.owner)]
        for fqn in chain:
            row = rows[fqn]
            setattr(row, total, getattr(row, total) + s.nbytes)
            if not after:
                row.tensors += 1
                if fqn not in s.inputs_of:
                    row.freeable += s.nbytes


def profile_model(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    config: MemOptConfig | Mapping[str, Any] | str | Path | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    device: str | torch.device | None = None,
) -> ProfileReport:
    """Measure one training step of ``loss_fn(model, batch)`` per module.

    Counts parameters, gradients, optimizer state (when ``optimizer`` is given; one ``step()`` is
    taken to create it and then undone) and the bytes each module saves for backward, next to the
    retained and peak memory of the :class:`MemoryMeter`. With ``config`` the step runs again
    under :class:`MemoryOptimizer` and every module's bytes are counted again ("after"). The model
    must not be patched already. Its parameters, buffers, gradients, the optimizer state and the
    global RNG are as before when this returns.
    """
    if patched_by(model) is not None:
        raise RuntimeError(
            "profile_model measures the model as it is, then under the plan of `config`: call it "
            "before MemoryOptimizer.apply(model) or after remove()"
        )
    cfg = load_config(config)
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    meter = MemoryMeter(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    named = list(model.named_modules())
    rows = {fqn: ModuleProfile(fqn, layer_kind(m), cheap=cheap_to_recompute(m)) for fqn, m in named}
    rows[LOSS_ROW] = ModuleProfile(LOSS_ROW, "loss")
    counter = _StepCounter({m: fqn for fqn, m in named}, sync)
    rng_devices = []
    if device.type == "cuda":
        rng_devices = [device.index if device.index is not None else torch.cuda.current_device()]

    def measured_step(stats: Any = None) -> tuple[MemoryReading, list[SavedTensor], dict]:
        skip = frozenset(
            _ptr(t) for t in (*model.parameters(), *model.buffers(), *_tensors(batch)) if t.numel()
        )
        held: list[SavedTensor] = []
        freed_inputs: dict[str, int] = {}

        def forward() -> torch.Tensor:
            with counter.counting(skip):
                loss = loss_fn(model, batch)
            held.extend(counter.held())
            freed_inputs.update(counter.freed_inputs())
            return loss

        reading = meter.measure(forward, stats)
        return reading, held, freed_inputs

    after = None
    with _model_preserved(model, optimizer), torch.random.fork_rng(devices=rng_devices):
        counter.install(iter(dict(named).values()))
        try:
            loss_fn(model, batch).backward()  # warm-up: gradients and lazy state exist first
            reading, held, freed_inputs = measured_step()
            times = dict(counter.time)
            held_after: list[SavedTensor] = []
            plan = {}
            if config is not None:
                opt = MemoryOptimizer(cfg)
                opt.apply(model)
                try:
                    plan = opt.plan
                    hooks = opt.hooks
                    loss_fn(model, batch).backward()  # warm-up under the plan as well
                    hooks.pack = counter.wrap_compression(hooks.pack, hooks.stats)
                    after, held_after, _ = measured_step(hooks.stats)
                finally:
                    opt.remove()
        finally:
            counter.remove()
        for name, p in model.named_parameters():
            owner = name.rpartition(".")[0]
            _add_up(rows, owner, "params", p.nbytes)
            if p.grad is not None:
                _add_up(rows, owner, "grads", p.grad.nbytes)
        if optimizer is not None:
            optimizer.step()
            for name, p in model.named_parameters():
                state = optimizer.state.get(p, {})
                nbytes = sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))
                _add_up(rows, name.rpartition(".")[0], "optimizer_state", nbytes)

    for fqn, seconds in times.items():
        rows[fqn].forward_s = seconds
    _roll_up_saved(rows, held, after=False)
    for fqn, nbytes in freed_inputs.items():
        rows[fqn].kept_inputs = nbytes
        rows[fqn].freeable -= nbytes
    if after is not None:
        _roll_up_saved(rows, held_after, after=True)
    for fqn, p in plan.items():
        if fqn in rows:
            rows[fqn].action, rows[fqn].bits = p.action, p.bits
    modules = [rows[fqn] for fqn, _ in named]
    if rows[LOSS_ROW].saved or rows[LOSS_ROW].saved_after:
        modules.append(rows[LOSS_ROW])
    return ProfileReport(modules, reading, after, cfg, held, optimizer is not None)


# --------------------------------------------------------------------------- plan


def _escape_glob(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def compact_globs(picked: list[str], names: list[str]) -> list[str]:
    """Globs naming exactly ``picked`` among ``names``: ``layer.0.mlp``, ``layer.1.mlp`` ... become
    ``layer.*.mlp`` when that glob matches nothing else."""
    groups: dict[str, list[str]] = {}
    for fqn in picked:
        parts = ["*" if part.isdigit() else _escape_glob(part) for part in fqn.split(".")]
        groups.setdefault(".".join(parts), []).append(fqn)
    globs = []
    for glob, members in groups.items():
        matched = [n for n in names if fnmatch.fnmatchcase(n, glob)]
        if len(members) > 1 and sorted(matched) == sorted(members):
            globs.append(glob)
        else:
            globs.extend(_escape_glob(m) for m in members)
    return globs


def _packed_ratio(bits: int, element_size: int, group_size: int) -> float:
    """Stored ÷ original bytes of a floating-point tensor at ``bits`` (codec of DESIGN.md)."""
    if bits >= 32:
        return 1.0
    if bits == 16:
        return min(1.0, 2 / element_size)
    return (bits / 8 + 4 / group_size) / element_size  # payload + a 16-bit min and scale per group


def estimate_saved(
    report: ProfileReport, recompute: set[str], bits: int, quantize: QuantizeConfig | None = None
) -> int:
    """Bytes still saved when the modules in ``recompute`` are recomputed (each region keeps
    only its inputs) and the model's other floating-point tensors are compressed to ``bits``
    (with the group size and ``min_numel`` of ``quantize``, the report's config by default)."""
    q = quantize or report.config.quantize
    total = 0.0
    for s in report.saved_tensors:
        inside = s.owner != LOSS_ROW
        chain = (s.owner, *parent_fqns(s.owner)) if inside else ()
        if any(m in recompute and m not in s.inputs_of for m in chain):
            continue
        compressible = inside and s.floating and s.numel >= q.min_numel
        total += s.nbytes * (
            _packed_ratio(bits, s.element_size, q.group_size) if compressible else 1
        )
    total += sum(row.kept_inputs for row in report.modules if row.fqn in recompute)
    return int(total)


@dataclass(frozen=True)
class Suggestion:
    """A config proposed for a memory budget, with the estimate it was chosen by."""

    budget: float  # fraction of the measured saved-activation bytes to keep
    baseline: int  # saved-activation bytes measured without memopt
    estimate: int  # bytes estimated to stay saved under ``config``
    recompute: tuple[str, ...]  # modules recomputed, best bytes per second first
    bits: int  # bits of the compressed rest (32: no compression needed)
    config: MemOptConfig
    freed: int = 0  # bytes the recompute alone frees (estimated)
    recompute_s: float = 0.0  # forward time of the recomputed modules, measured

    @property
    def reached(self) -> bool:
        return self.estimate <= self.budget * self.baseline

    def to_yaml(self) -> str:
        """The config as YAML (only keys that differ from the defaults), with a commented header;
        :meth:`MemOptConfig.from_yaml` reads it back."""
        share = self.estimate / self.baseline if self.baseline else 0.0
        budget, baseline = human_bytes(self.budget * self.baseline), human_bytes(self.baseline)
        lines = [
            f"# memopt plan: keep at most {self.budget:.0%} of the saved-activation bytes "
            f"({budget} of {baseline} measured)",
            f"# estimated with this config: {human_bytes(self.estimate)} ({share:.0%})"
            + ("" if self.reached else " - the budget is out of reach even at 2 bits"),
            f"# recompute {len(self.recompute)} module(s): frees {human_bytes(self.freed)} for "
            f"{1000 * self.recompute_s:.2f} ms of forward time recomputed per step",
            "# compress: " + ("nothing" if self.bits >= 32 else f"the rest to {self.bits} bits"),
        ]
        if self.bits < 8:
            lines.append(
                "# the drift check raises the bits of modules whose gradients drift too far"
            )
        defaults = MemOptConfig().to_dict()
        data = {
            section: {k: v for k, v in values.items() if v != defaults[section][k]}
            for section, values in self.config.to_dict().items()
        }
        data = {section: values for section, values in data.items() if values}
        text = yaml.safe_dump(data, sort_keys=False) if data else "{}\n"
        return "\n".join(lines) + "\n" + text


def suggest_config(
    report: ProfileReport, budget: float, base: MemOptConfig | None = None
) -> Suggestion:
    """Propose a config that keeps at most ``budget`` of the measured saved-activation bytes.

    Cheap modules (activation, norm, dropout, MLP-like blocks; see :func:`cheap_to_recompute`)
    are recomputed in order of bytes freed per second of forward time, never one inside another,
    until the budget is met or none is left that frees at least 1% of the bytes; then the rest is
    compressed at the largest bit width (16, 8, 4, 2) whose estimate meets the budget. Every
    other key of ``base`` (default: the report's config) is kept.
    """
    base = base or report.config
    if not 0 < budget <= 1:
        raise ValueError(f"budget must be in (0, 1], got {budget!r}")
    baseline = report.saved_total
    target = budget * baseline
    candidates = [
        row
        for row in report.modules
        if row.fqn and row.cheap and row.freeable >= 0.01 * baseline and row.forward_s > 0
    ]
    candidates.sort(key=lambda row: row.freeable / row.forward_s, reverse=True)
    picked: list[str] = []
    for row in candidates:
        if estimate_saved(report, set(picked), 32, base.quantize) <= target:
            break
        nested = any(
            p == row.fqn or p in parent_fqns(row.fqn) or row.fqn in parent_fqns(p) for p in picked
        )
        if not nested:
            picked.append(row.fqn)
    bits = 32
    for b in (32, 16, 8, 4, 2):
        bits = b
        if estimate_saved(report, set(picked), b, base.quantize) <= target:
            break
    names = [row.fqn for row in report.modules if row.fqn != LOSS_ROW]
    config = base.with_changes(
        recompute={"modules": compact_globs(picked, names)}, quantize={"bits": bits}
    )
    return Suggestion(
        budget=budget,
        baseline=baseline,
        estimate=estimate_saved(report, set(picked), bits, base.quantize),
        recompute=tuple(picked),
        bits=bits,
        config=config,
        freed=baseline - estimate_saved(report, set(picked), 32, base.quantize),
        recompute_s=sum(report[fqn].forward_s for fqn in picked),
    )


# --------------------------------------------------------------------------- chart


def _axis_unit(largest: float) -> tuple[str, float]:
    scale = 1.0
    for unit in _UNITS:
        if largest < 1024 * scale or unit == _UNITS[-1]:
            return unit, scale
        scale *= 1024
    raise AssertionError("unreachable")


def _plot(report: ProfileReport, path: Path, top: int) -> Path:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "ProfileReport.plot needs matplotlib: pip install 'memopt-plugins[plot]'"
        ) from None
    rows = [row for row in report.top(top, by="self_saved") if row.self_saved > 0]
    rows.sort(key=lambda row: row.self_saved, reverse=True)
    has_after = report.after is not None
    largest = max([row.self_saved for row in rows] or [1])
    unit, scale = _axis_unit(largest)
    labels = [row.label for row in rows]
    label_chars = max([len(label) for label in labels] or [10])
    size = (6.0 + 0.075 * label_chars, 1.9 + 0.42 * max(len(rows), 1))
    fig = Figure(figsize=size, dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ys = range(len(rows))
    height = 0.4 if has_after else 0.7
    before = [row.self_saved / scale for row in rows]
    ax.barh(
        [y - height / 2 if has_after else y for y in ys],
        before,
        height,
        label="without memopt",
        color="#4C72B0",
    )
    if has_after:
        after = [(row.self_saved_after or 0) / scale for row in rows]
        ax.barh([y + height / 2 for y in ys], after, height, label="with the plan", color="#DD8452")
        for y, value, row in zip(ys, after, rows, strict=True):
            ax.text(
                value,
                y + height / 2,
                f" {human_bytes(row.self_saved_after or 0)} ({row.action_text})",
                va="center",
                fontsize=7.5,
                color="#8C4A1E",
            )
    for y, value, row in zip(ys, before, rows, strict=True):
        ax.text(
            value,
            y - (height / 2 if has_after else 0),
            f" {human_bytes(row.self_saved)}",
            va="center",
            fontsize=7.5,
            color="#1F3A60",
        )
    ax.set_yticks(list(ys), labels, fontsize=8.5)
    ax.invert_yaxis()
    ax.set_xlabel(f"saved activations held for backward ({unit})")
    ax.set_xlim(0, max(before or [1]) * 1.3)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    title = f"Largest holders of saved activations: {human_bytes(report.saved_total)} in all"
    if has_after:
        title += f", {human_bytes(report.saved_after_total or 0)} with the plan"
    fig.suptitle(title + "\n(bytes each module saves itself, children excluded)", fontsize=10)
    if has_after:
        ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1), ncols=2, fontsize=8, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
