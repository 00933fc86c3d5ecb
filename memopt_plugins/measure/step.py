"""One measured forward: what each module saves for backward, what recompute would free, its cost.

:class:`StepRecorder` watches a forward through the model's :class:`~.scopes.ScopeTracker` and a
pack counter; :meth:`StepRecorder.stop` gives a :class:`Measurement`, which the recompute planner,
``memopt plan`` and the profiler read. A storage is counted once however many ops save it, only
when still held after the forward, and never when it existed before the step (parameters,
buffers, the batch). It belongs to the innermost watched module running when first saved. A
module's recompute frees the storages inside it that are not its inputs and costs the inputs
nothing else keeps (``ModuleCost.saved_bytes``, ``kept_inputs``); its price is its count of
operations (:class:`OpCounter`), not a clock, so plans repeat. A module that changed an input in
place is unsafe to replay. Storages are recognised by address only while a tensor on them is alive
(weak references).
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ..compress.codec import encode_mask
from ..policy import compressible, mask_candidate
from ..select import layer_kind
from ..tree import tensors_in
from .isolate import isolated
from .scopes import ScopeTracker, Watch
from .storage import ModelStorages, storage_key, tensor_version

Ratio = Callable[["SavedStorage"], float]


@dataclass(frozen=True)
class ModuleCost:
    """What one module saves, and what recomputing it frees and costs, from one forward."""

    fqn: str
    kind: str
    saved_bytes: int  # bytes no longer held for backward if recomputed (may be <= 0)
    flops: float  # its forward's operations (see :class:`OpCounter`): the price of a replay
    before_bytes: int = 0  # saved by the forward before this module started
    start: int = 0  # distinct saved storages when it first started / last ended: its place
    end: int = 0
    self_bytes: int = 0  # saved while it was the innermost watched module running
    kept_inputs: int = 0  # input bytes a checkpoint would keep that are freed otherwise
    seconds: float = 0.0  # its forward time in this measurement (shown, never planned with)

    @property
    def bytes_per_flop(self) -> float:
        return self.saved_bytes / max(self.flops, 1e-9)


class OpCounter(TorchDispatchMode):
    """Counts the operations of a forward as it runs, the clock-free price of a replay:
    matmuls, convolutions and attention by ``torch.utils.flop_counter``'s formulas (what
    torch.compile's memory budget ranks by), every other op one per output element, views none.
    The same model and batch give the same count on every run."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        elif not func.is_view:
            self.total += sum(t.numel() for t in tensors_in(out))
        return out


@dataclass(frozen=True)
class SavedStorage:
    """One storage held for backward after the forward."""

    nbytes: int  # the whole storage, or the compact payload the compression hooks kept
    owner: str | None  # innermost watched module at its first save; None: outside all of them
    inside: frozenset[str]  # modules enclosing every save of it
    inputs_of: frozenset[str]  # modules it was an input of (their recompute keeps it)
    element_size: int
    numel: int
    compressible: bool  # kept as saved, and compression would touch it (policy.compressible)
    order: int  # rank of its first save among the step's saved storages
    mask: bool = False  # compression keeps it as a bit an element (codec.encode_mask)


@dataclass(frozen=True)
class Measurement:
    """One measured forward: the saved bytes, per-module costs, unsafe modules, the storages."""

    baseline_bytes: int  # held for backward after the forward
    costs: dict[str, ModuleCost]
    unsafe: frozenset[str] = frozenset()  # changed an input in place: never recomputed
    storages: tuple[SavedStorage, ...] = field(default=(), repr=False)

    def kept_bytes(self, recompute: Iterable[str] = (), ratio: Ratio | None = None) -> int:
        """Bytes still held when the modules in ``recompute`` are recomputed and every storage
        keeps ``ratio(storage)`` of its bytes (compression; default 1)."""
        regions = set(recompute)
        total = 0.0
        for s in self.storages:
            if any(r in s.inside and r not in s.inputs_of for r in regions):
                continue
            total += s.nbytes * (ratio(s) if ratio is not None else 1.0)
        total += sum(self.costs[r].kept_inputs for r in regions if r in self.costs)
        return int(total)

    def scaled(self, ratio: Ratio) -> Measurement:
        """The same forward with every storage holding ``ratio(storage)`` of its bytes."""
        storages = tuple(
            dataclasses.replace(s, nbytes=int(s.nbytes * ratio(s))) for s in self.storages
        )
        return _measurement(storages, self.costs.values(), self.unsafe)


def _measurement(
    storages: tuple[SavedStorage, ...], modules: Iterable[ModuleCost], unsafe: frozenset[str]
) -> Measurement:
    """Costs recomputed from ``storages`` for ``modules`` (whose times, spans and kept inputs
    are kept)."""
    freed: dict[str, int] = defaultdict(int)
    owned: dict[str, int] = defaultdict(int)
    for s in storages:
        for fqn in s.inside - s.inputs_of:
            freed[fqn] += s.nbytes
        if s.owner is not None:
            owned[s.owner] += s.nbytes
    by_order = sorted(storages, key=lambda s: s.order)
    orders = [s.order for s in by_order]
    prefix = [0]
    for s in by_order:
        prefix.append(prefix[-1] + s.nbytes)

    def before(start: int) -> int:  # bytes held of the storages first saved before `start`
        count = next((i for i, order in enumerate(orders) if order >= start), len(orders))
        return prefix[count]

    costs = {
        m.fqn: dataclasses.replace(
            m,
            saved_bytes=freed[m.fqn] - m.kept_inputs,
            before_bytes=before(m.start),
            self_bytes=owned[m.fqn],
        )
        for m in modules
    }
    return Measurement(sum(s.nbytes for s in storages), costs, unsafe, storages)


class _Record:
    """A storage seen during the step: saved, an input of modules, or both."""

    __slots__ = ("nbytes", "owner", "inside", "inputs_of", "element_size", "numel")
    __slots__ += ("compressible", "mask", "order", "refs")

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.owner: str | None = None
        self.inside: set[str] = set()
        self.inputs_of: set[str] = set()
        self.element_size = 1
        self.numel = 0
        self.compressible = False
        self.mask = False
        self.order: int | None = None  # None: never saved
        self.refs: list[weakref.ref] = []

    def alive(self) -> bool:
        return any(ref() is not None for ref in self.refs)


class StepRecorder:
    """Records one forward of ``model`` (see the module docstring).

    Args:
        model: the root module; fqns are names within it.
        extra: tensors that exist before the step besides parameters and buffers (a batch).
        watch_root: also watch the root module (False when started from inside its own
            pre-hook, as the ``recompute.auto`` planner does; pass its inputs as ``extra``).
    """

    def __init__(
        self, model: nn.Module, extra: Iterable[torch.Tensor] = (), *, watch_root: bool = True
    ):
        self.model = model
        self.watch_root = watch_root
        self._frozen = ModelStorages(model, extra)
        self._records: dict[tuple, _Record] = {}
        self._saved: list[_Record] = []
        self._inputs: dict[str, dict[int, _Record]] = defaultdict(dict)
        self._stack: list[str] = []
        self._starts: list[float] = []
        self._calls: list[list[tuple[torch.Tensor, int | None]]] = []
        self._seconds: dict[str, float] = defaultdict(float)
        self._flops: dict[str, float] = defaultdict(float)
        self._flop_starts: list[float] = []
        self._counter = OpCounter()
        self._span: dict[str, list[int]] = {}
        self._ran: list[str] = []
        self._unsafe: set[str] = set()
        self._watch: Watch | None = None
        self._contexts = ExitStack()
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._device = device
        self._clock: Callable[[], float] = (
            time.thread_time if device.type == "cpu" else time.perf_counter
        )

    # ----------------------------------------------------------------- start / stop
    def start(self) -> StepRecorder:
        """Begin recording (module hooks and the pack counter)."""
        names = [f for f, _ in self.model.named_modules() if f or self.watch_root]
        self._watch = ScopeTracker.of(self.model).watch(self, names)
        self._contexts.enter_context(saved_tensors_hooks(self._pack, _same))
        self._contexts.enter_context(self._counter)
        return self

    def stop(self) -> Measurement:
        """Stop recording and measure (call while the forward's output is still alive)."""
        self._contexts.close()
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        held = [r for r in self._saved if r.alive()]
        storages = tuple(
            SavedStorage(
                r.nbytes,
                r.owner,
                frozenset(r.inside),
                frozenset(r.inputs_of),
                r.element_size,
                r.numel,
                r.compressible,
                r.order,
                r.mask,
            )
            for r in held
        )
        modules = dict(self.model.named_modules())
        ran = list(dict.fromkeys(self._ran))
        costs = []
        for fqn in ran:
            kept = sum(
                r.nbytes for r in self._inputs[fqn].values() if r.order is None and not r.alive()
            )
            start, end = self._span[fqn]
            kind = layer_kind(modules[fqn]) if fqn in modules else "other"
            costs.append(
                ModuleCost(
                    fqn, kind, 0, self._flops[fqn], 0, start, end, 0, kept, self._seconds[fqn]
                )
            )
        order = {f: i for i, f in enumerate(modules)}
        costs.sort(key=lambda c: order.get(c.fqn, len(order)))
        self._records.clear()
        self._saved.clear()
        self._inputs.clear()
        return _measurement(storages, costs, frozenset(self._unsafe))

    def __enter__(self) -> StepRecorder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self._watch is not None:
            self.stop()

    # ----------------------------------------------------------------- records
    def _record_of(self, t: torch.Tensor) -> _Record | None:
        """The record of ``t``'s storage (a new one when the address held a dead storage);
        ``None`` for a pre-existing storage or a tensor without one."""
        if t.numel() == 0 or t in self._frozen:
            return None
        key = storage_key(t)
        if key is None:
            return None
        record = self._records.get(key)
        if record is None or not record.alive():
            record = self._records[key] = _Record(t.untyped_storage().nbytes())
        record.refs.append(weakref.ref(t))
        return record

    def _mark_saved(self, record: _Record, t: torch.Tensor, nbytes: int, raw: bool) -> None:
        if record.order is None:
            record.order = len(self._saved)
            self._saved.append(record)
            record.nbytes = nbytes
            record.owner = self._stack[-1] if self._stack else None
            record.inside = set(self._stack)
            record.element_size = t.element_size()
            record.numel = t.numel()
            record.compressible = raw and compressible(t)
            record.mask = record.compressible and mask_candidate(t) and encode_mask(t) is not None
        else:
            record.inside &= set(self._stack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.count(t)
        return t

    def count(self, t: torch.Tensor) -> None:
        """Count a tensor autograd keeps as it is."""
        record = self._record_of(t)
        if record is not None:
            self._mark_saved(record, t, t.untyped_storage().nbytes(), raw=True)

    def packed(self, t: torch.Tensor, saved: object, added: int) -> None:
        """The compression hooks' observer: they kept ``saved`` (``added`` new bytes) for ``t``."""
        if saved is t:
            self.count(t)
        elif added > 0:  # 0: a cache hit, counted where it was first packed
            record = _Record(added)
            record.refs.append(weakref.ref(saved))
            self._mark_saved(record, t, added, raw=False)

    # ----------------------------------------------------------------- module scopes
    def enter(self, fqn: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        tensors = [t for t in tensors_in((args, kwargs)) if t.numel()]
        if fqn == "":
            self._frozen.add(tensors)  # the batch: not the step's memory
        mine = self._inputs[fqn]
        for t in tensors:
            record = self._record_of(t)
            if record is not None:
                record.inputs_of.add(fqn)
                mine[id(record)] = record
        self._calls.append([(t, tensor_version(t)) for t in tensors])
        self._stack.append(fqn)
        self._span.setdefault(fqn, [len(self._saved), 0])
        self._sync()
        self._starts.append(self._clock())
        self._flop_starts.append(self._counter.total)

    def exit(self, fqn: str, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._stack or self._stack[-1] != fqn:
            return  # its entry ran where nothing records (inside a compiled frame)
        self._sync()
        self._seconds[fqn] += self._clock() - self._starts.pop()
        self._flops[fqn] += self._counter.total - self._flop_starts.pop()
        self._span[fqn][1] = len(self._saved)
        self._stack.pop()
        self._ran.append(fqn)
        if any(v is not None and tensor_version(t) != v for t, v in self._calls.pop()):
            self._unsafe.add(fqn)

    def _sync(self) -> None:
        backend = getattr(torch, self._device.type, None)
        if self._device.type != "cpu" and hasattr(backend, "synchronize"):
            backend.synchronize()


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def measure(
    model: nn.Module,
    run: Callable[[], Any],
    contexts: Sequence[Callable[[], Any]] = (),
) -> Measurement:
    """Run ``run()`` once (forward only; its output is dropped) and measure every module.

    ``contexts`` are context-manager factories entered around the pass (e.g. suspending
    compression). The model is left as it was (:func:`~.isolate.isolated`: RNG streams, buffers,
    ``.grad``, modes).
    """
    with isolated(model), torch.enable_grad(), ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context())
        recorder = StepRecorder(model).start()
        try:
            output = run()
        finally:
            measurement = recorder.stop()
        del output
    return measurement
