"""Selective recompute: chosen modules give up their saved activations and replay in backward.

A recomputed module keeps its class, parameters, hooks and state-dict keys: only an instance
attribute ``forward`` is set, which runs the original forward under non-reentrant
``torch.utils.checkpoint`` with the RNG state preserved (dropout draws the same mask in the
replay), and :meth:`Recompute.remove` deletes it again.

Traps handled here, each covered by tests/test_recompute.py:

* BatchNorm inside a recomputed module would update its running statistics and
  ``num_batches_tracked`` a second time in the replay (pytorch#96136). The replay runs them, and
  any other buffer the forward changed, on scratch copies, so buffers move once per step.
* Compression is suspended inside a recomputed module (recompute wins). The checkpoint's own
  saved inputs are saved outside it, so an enclosing compression scope may compress them.
* An input changed in place, by the module itself or after it, would be replayed on the wrong
  values: that raises :class:`RecomputeError` naming the module (in forward when the module did
  it, else before backward reaches the module), as does any failure of the replay itself.
* A Hugging Face KV cache handed to a recomputed module would be written again by the replay:
  in training the module runs with ``cache=None, use_cache=False``, as transformers does under
  its own gradient checkpointing.

The planner (``recompute.auto: {budget: b}``) measures one forward: the bytes each module's
recompute would free (tensors saved only inside it, minus inputs the checkpoint must now keep),
where it sits in the order of saves, and its forward time (on CPU the thread's CPU time, which
other processes do not inflate). It then picks modules by bytes freed per second of recompute
until at most ``b`` of the baseline saved bytes remain. Bytes freed count twice: off what is
kept, and off the estimated backward peak -- a replay re-creates a module's activations on top
of what is still held, so one big region can cost more peak than it saves (see :func:`choose`).
It never picks a module inside one already picked (a picked container replaces the picks
inside it), nor one freeing more than half of the baseline by itself.

The measured forward is either the first training forward (:meth:`RecomputePlanner.install`;
that step runs without recompute and compression, at baseline memory, and the plan applies
from the next forward on) or one you run on a batch of your choice
(:meth:`RecomputePlanner.plan_now`, ``MemoryOptimizer.plan_recompute``), with RNG streams and
buffers left as they were.
"""

from __future__ import annotations

import logging
import sys
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint
from torch.utils.hooks import RemovableHandle

from .config import ConfigError, RecomputeConfig
from .patching import InstanceForward, forward_hook, forward_pre_hook
from .select import (
    check_globs,
    check_types,
    layer_kind,
    outermost,
    parent_fqns,
    select_modules,
    within,
)

log = logging.getLogger("memopt")

#: Plan actions: the recomputed module itself, and every module inside it.
RECOMPUTE = "recompute"
IN_RECOMPUTE = "in-recompute"

Suspend = Callable[[], AbstractContextManager[Any]]
_BUFFER_STATS = ("running_mean", "running_var", "num_batches_tracked")


class RecomputeError(RuntimeError):
    """A recomputed module cannot be replayed in backward; the message names the module."""


# --------------------------------------------------------------------------- selection
def recompute_targets(model: nn.Module, config: RecomputeConfig) -> list[str]:
    """The modules ``recompute.modules``/``types`` select, outermost only, after validation.

    Raises:
        ConfigError: a glob or class name that matches nothing, a selection that is the whole
            model or a container that is never called (``ModuleList``), or a model that already
            checkpoints its activations (see :func:`existing_checkpointing`).
    """
    names = [fqn for fqn, _ in model.named_modules()]
    check_globs("recompute.modules", config.modules, names)
    check_types("recompute.types", config.types, model)
    if not (config.modules or config.types or config.auto is not None):
        return []
    found = existing_checkpointing(model)
    if found:
        raise ConfigError(
            "recompute: the model already checkpoints activations ("
            + "; ".join(found[:3])
            + ("; ..." if len(found) > 3 else "")
            + "). Recomputing those modules again would run them a third time: turn that "
            "checkpointing off before applying memopt, or drop the recompute section."
        )
    modules = dict(model.named_modules())
    selected = select_modules(model, config.modules, config.types)
    for fqn in selected:
        if fqn == "":
            raise ConfigError(
                f"recompute: the selection includes the whole model ({type(model).__name__}, "
                "e.g. '*' matches the root); name submodules instead, e.g. 'transformer.h.*'"
            )
        if type(modules[fqn]).forward is nn.Module.forward:
            raise ConfigError(
                f"recompute: {fqn!r} is a {type(modules[fqn]).__name__}, which is never called; "
                f"select its elements instead, e.g. '{fqn}.*'"
            )
    chosen = outermost(selected)
    if len(chosen) < len(selected):
        log.debug("memopt: %d selected modules lie inside other selected ones", len(selected))
    return chosen


def existing_checkpointing(model: nn.Module) -> list[str]:
    """Descriptions of the activation checkpointing the model already brings (empty: none).

    Detected: Hugging Face ``activation_checkpointing_enable()`` (``gradient_checkpointing_enable``
    before transformers 5; sets ``gradient_checkpointing`` on submodules), timm
    ``set_grad_checkpointing()`` (``grad_checkpointing``), torch's ``CheckpointWrapper``
    (``apply_activation_checkpointing``, Lightning FSDP's ``activation_checkpointing_policy``),
    the composable ``checkpoint()`` and memopt itself.
    """
    found: list[str] = []
    contract = sys.modules.get("torch.distributed._composable.contract")
    for fqn, module in model.named_modules():
        name = fqn or "<root>"
        if getattr(module, "gradient_checkpointing", False) is True:
            found.append(
                f"{name}.gradient_checkpointing is on: Hugging Face activation checkpointing, "
                "undo with model.activation_checkpointing_disable() (transformers >= 5) or "
                "model.gradient_checkpointing_disable()"
            )
        if getattr(module, "grad_checkpointing", False) is True:
            found.append(
                f"{name}.grad_checkpointing is on: timm set_grad_checkpointing(),"
                " undo with set_grad_checkpointing(False)"
            )
        if any(c.__name__ == "CheckpointWrapper" for c in type(module).__mro__):
            found.append(
                f"{name} is a torch CheckpointWrapper (apply_activation_checkpointing, e.g. "
                "Lightning FSDP's activation_checkpointing_policy)"
            )
        registry = contract._get_registry(module) if contract is not None else None
        if registry and "checkpoint" in registry:
            found.append(f"{name} has torch.distributed._composable.checkpoint applied")
        if isinstance(module.__dict__.get("forward"), _RecomputedForward):
            found.append(f"{name} is already recomputed by another MemoryOptimizer")
    return found


def region_actions(names: Iterable[str], regions: Iterable[str]) -> dict[str, str]:
    """``{fqn: RECOMPUTE | IN_RECOMPUTE}`` for the names that are, or lie inside, a region."""
    regions = set(regions)
    actions: dict[str, str] = {}
    for fqn in names:
        if fqn in regions:
            actions[fqn] = RECOMPUTE
        elif regions and any(p in regions for p in parent_fqns(fqn)):
            actions[fqn] = IN_RECOMPUTE
    return actions


# --------------------------------------------------------------------------- wrapping
class Recompute:
    """The recomputed modules of one model: wraps them in place and unwraps them exactly.

    Args:
        model: the root module; fqns are names from its ``named_modules()``.
        suspend: a context manager factory under which nothing is compressed (the engine's
            ``CompressionHooks.suspend``); entered inside every recomputed module.
    """

    def __init__(self, model: nn.Module, suspend: Suspend | None = None):
        self.model = model
        self.suspend = suspend
        self._regions: dict[str, _RecomputedForward] = {}
        self._bypass = 0
        self._cache_noted = False

    @property
    def wrapped(self) -> tuple[str, ...]:
        """Fqns of the recomputed modules, in the order they were wrapped."""
        return tuple(self._regions)

    @property
    def bypassing(self) -> bool:
        return self._bypass > 0

    def actions(self) -> dict[str, str]:
        """``{fqn: "recompute" | "in-recompute"}`` for every module in a recomputed region."""
        if not self._regions:
            return {}
        return region_actions((f for f, _ in self.model.named_modules()), self._regions)

    def wrap(self, fqns: Iterable[str]) -> list[str]:
        """Recompute these modules from their next forward on; returns the newly wrapped ones."""
        modules = dict(self.model.named_modules())
        new: list[str] = []
        for fqn in fqns:
            if fqn in self._regions:
                continue
            if fqn not in modules:
                raise KeyError(f"{fqn!r} is not a module of {type(self.model).__name__}")
            clash = next((w for w in self._regions if within(fqn, w) or within(w, fqn)), None)
            if clash is not None:
                raise ValueError(
                    f"cannot recompute {fqn!r}: it overlaps {clash!r}, already recomputed"
                )
            wrapper = _RecomputedForward(self, fqn, modules[fqn])
            modules[fqn].forward = wrapper
            self._regions[fqn] = wrapper
            new.append(fqn)
        return new

    def unwrap(self, fqns: Iterable[str] | None = None) -> None:
        """Stop recomputing these modules (all when ``None``): their ``forward`` is as before."""
        for fqn in list(self._regions if fqns is None else fqns):
            wrapper = self._regions.pop(fqn, None)
            if wrapper is not None:
                wrapper.restore()

    def remove(self) -> None:
        """Unwrap every module."""
        self.unwrap()

    @contextmanager
    def bypassed(self) -> Iterator[None]:
        """Recomputed modules run their plain forward inside (the planner's measured pass)."""
        self._bypass += 1
        try:
            yield
        finally:
            self._bypass -= 1

    def without_cache(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args``/``kwargs`` with Hugging Face cache objects as ``None``, ``use_cache`` False."""
        cache_cls = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
        if cache_cls is None and kwargs.get("use_cache") is not True:
            return args, kwargs
        new_args = tuple(
            None if cache_cls is not None and isinstance(a, cache_cls) else a for a in args
        )
        new_kwargs = {
            k: None if cache_cls is not None and isinstance(v, cache_cls) else v
            for k, v in kwargs.items()
        }
        if new_kwargs.get("use_cache") is True:
            new_kwargs["use_cache"] = False
        changed = any(a is not b for a, b in zip(args, new_args, strict=True)) or any(
            new_kwargs[k] is not kwargs[k] for k in kwargs
        )
        if changed and not self._cache_noted:
            self._cache_noted = True
            log.info(
                "memopt: recomputed modules run without a KV cache in training (use_cache=False),"
                " as transformers does under gradient checkpointing"
            )
        return new_args, new_kwargs


class _RecomputedForward(InstanceForward):
    """The ``forward`` instance attribute of a recomputed module (a copy of the model gets the
    module's own ``forward``)."""

    def __init__(self, owner: Recompute, fqn: str, module: nn.Module):
        self.owner = owner
        self.fqn = fqn
        self.module = module
        self.previous = module.__dict__.get("forward")
        self.original = module.forward
        self.keeps_cache = bool(getattr(module, "_can_checkpoint_with_cache", False))

    def restore(self) -> None:
        slots = self.module.__dict__
        if slots.get("forward") is not self:
            log.warning(
                "memopt: %s.forward was replaced after memopt wrapped it; left as is", self.fqn
            )
        elif self.previous is None:
            del slots["forward"]
        else:
            slots["forward"] = self.previous

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.owner.bypassing or not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        if not self.keeps_cache:
            args, kwargs = self.owner.without_cache(args, kwargs)
        inputs = list(tensors_in((args, kwargs)))
        versions = [_version(t) for t in inputs]
        # kwargs go through a closure: checkpoint() reserves some keyword names for itself.
        output = checkpoint(
            self._region(kwargs), *args, use_reentrant=False, preserve_rng_state=True
        )
        for t, v in zip(inputs, versions, strict=True):
            if v is not None and _version(t) != v:
                raise RecomputeError(
                    f"memopt recompute: {self._name} modified its input (shape "
                    f"{tuple(t.shape)}) in place during forward; the backward replay would run "
                    "on the modified values. Make that op out of place (e.g. inplace=False) or "
                    f"stop recomputing {self.fqn!r} (recompute.modules / recompute.types)."
                )
        _guard_inputs(output, inputs, versions, self._name, self.fqn)
        return output

    @property
    def _name(self) -> str:
        return f"{self.fqn!r} ({type(self.module).__name__})"

    def _region(self, kwargs: dict[str, Any]) -> Callable[..., Any]:
        """The checkpointed function of one forward: first call = forward, later = replays."""
        calls = 0
        changed: list[tuple[dict, str]] = []

        def region(*args: Any) -> Any:
            nonlocal calls
            calls += 1
            with ExitStack() as stack:
                if self.owner.suspend is not None:
                    stack.enter_context(self.owner.suspend())
                if calls == 1:
                    before = _buffer_states(self.module)
                    output = self.original(*args, **kwargs)
                    changed[:] = [
                        (slots, name)
                        for slots, name, buf, v in before
                        if slots.get(name) is not buf or _version(buf) != v
                    ]
                    return output
                stack.enter_context(_scratch_buffers(self.module, changed))
                try:
                    return self.original(*args, **kwargs)
                except Exception as err:
                    if type(err).__name__ == "_StopRecomputationError":
                        raise  # torch's early stop: the replay saved all it needs
                    raise RecomputeError(
                        f"memopt recompute: replaying {self._name} in backward failed "
                        f"({type(err).__name__}: {err}). A recomputed module must compute the "
                        "same thing twice: no in-place changes to its inputs or to state it "
                        "reads between forward and backward."
                    ) from err

        return region


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in ``obj`` and in the tuples, lists and dicts inside it."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, tuple | list):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None


def _buffer_states(module: nn.Module) -> list[tuple[dict, str, torch.Tensor, int | None]]:
    return [
        (m._buffers, name, buf, _version(buf))
        for m in module.modules()
        for name, buf in m._buffers.items()
        if buf is not None
    ]


@contextmanager
def _scratch_buffers(module: nn.Module, changed: Sequence[tuple[dict, str]]) -> Iterator[None]:
    """Buffers the replay would update a second time point at copies while it runs.

    Those are the running statistics of normalization layers in training (the kernel updates
    them without bumping a version counter) and any buffer the forward changed or replaced.
    """
    slots = list(changed)
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats:
            slots += [(m._buffers, n) for n in _BUFFER_STATS if m._buffers.get(n) is not None]
    kept = {(id(d), name): (d, name, d[name]) for d, name in slots if d.get(name) is not None}
    for d, name, buf in kept.values():
        d[name] = buf.clone()
    try:
        yield
    finally:
        for d, name, buf in kept.values():
            d[name] = buf


def _guard_inputs(
    output: Any, inputs: list[torch.Tensor], versions: list[int | None], name: str, fqn: str
) -> None:
    """Before backward enters the module, check that no input was changed in place since."""
    refs = [(weakref.ref(t), v) for t, v in zip(inputs, versions, strict=True) if v is not None]
    if not refs:
        return

    def check(grad_outputs: Any) -> None:
        for ref, version in refs:
            t = ref()
            if t is not None and t._version != version:
                raise RecomputeError(
                    f"memopt recompute: an input of {name} (shape {tuple(t.shape)}) was modified "
                    "in place after its forward; the backward replay would run on the modified "
                    "values. Clone it before the in-place op, make the op out of place, or stop "
                    f"recomputing {fqn!r}."
                )

    nodes = {id(t.grad_fn): t.grad_fn for t in tensors_in(output) if t.grad_fn is not None}
    for node in nodes.values():
        node.register_prehook(check)


# --------------------------------------------------------------------------- measurement
@dataclass(frozen=True)
class ModuleCost:
    """What recomputing one module frees and costs, from one measured forward."""

    fqn: str
    kind: str
    saved_bytes: int  # bytes no longer held for backward (may be <= 0: nothing to gain)
    seconds: float  # its forward time: the price of the replay
    before_bytes: int = 0  # saved by the forward before this module started
    start: int = 0  # distinct saved tensors when it started / ended: its place in the order
    end: int = 0

    @property
    def bytes_per_second(self) -> float:
        return self.saved_bytes / max(self.seconds, 1e-9)


@dataclass(frozen=True)
class Measurement:
    """One measured forward: the baseline saved bytes and the cost of every module that ran."""

    baseline_bytes: int
    costs: dict[str, ModuleCost]
    unsafe: frozenset[str]  # modules that changed an input in place: never recomputed


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage
        return None


class _Recorder:
    """Counts what one forward saves for backward per module, and times every module.

    A saved tensor (counted once per storage) belongs to the modules that enclose every op that
    saved it; recomputing a module frees those, except its own inputs, which the checkpoint keeps
    (and an input nothing else saved is a new cost). Module inputs are held until :meth:`stop`,
    so that a storage address stays unique for the whole pass.
    """

    def __init__(self, model: nn.Module, recompute: Recompute | None = None):
        self.model = model
        self.recompute = recompute
        self._stack: list[str] = []
        self._starts: list[float] = []
        self._calls: list[list[tuple[torch.Tensor, int | None]]] = []
        self._saved: dict[tuple, list] = {}  # storage key -> [nbytes, modules enclosing all saves]
        self._inputs: dict[str, set[tuple]] = defaultdict(set)
        self._input_bytes: dict[tuple, int] = {}
        self._alive: list[torch.Tensor] = []
        self._seconds: dict[str, float] = defaultdict(float)
        self._span: dict[str, list[int]] = {}  # fqn -> [distinct saves at first start, at last end]
        self._ran: set[str] = set()
        self._unsafe: set[str] = set()
        self._skip: frozenset[tuple] = frozenset()
        self._handles: list[RemovableHandle] = []
        self._contexts = ExitStack()
        self._device: torch.device | None = None
        self._clock: Callable[[], float] = time.perf_counter

    def start(self) -> _Recorder:
        model = self.model
        tensors = (*model.parameters(), *model.buffers())
        self._skip = frozenset(_storage_key(t) for t in tensors if t.numel())
        self._device = next((t.device for t in tensors), None)
        # On CPU the thread's own CPU time: other processes on a busy machine do not count.
        cpu = self._device is None or self._device.type == "cpu"
        self._clock = time.thread_time if cpu else time.perf_counter
        for fqn, module in model.named_modules():
            if fqn:  # the root may be running its pre-hooks right now (auto planner)
                self._handles.append(forward_pre_hook(module, self._enter(fqn), with_kwargs=True))
                self._handles.append(forward_hook(module, self._exit(fqn), always_call=True))
        if self.recompute is not None:
            if self.recompute.suspend is not None:
                self._contexts.enter_context(self.recompute.suspend())
            self._contexts.enter_context(self.recompute.bypassed())
        self._contexts.enter_context(saved_tensors_hooks(self._pack, _unchanged))
        return self

    def stop(self) -> Measurement:
        self._contexts.close()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        freed: dict[str, int] = defaultdict(int)
        for key, (nbytes, inside) in self._saved.items():
            for fqn in inside:
                if key not in self._inputs[fqn]:
                    freed[fqn] += nbytes
        before = [0]  # before[i]: bytes of the first i distinct saved tensors
        for nbytes, _ in self._saved.values():
            before.append(before[-1] + nbytes)
        costs = {}
        for fqn, module in self.model.named_modules():
            if fqn not in self._ran:
                continue
            added = sum(self._input_bytes[k] for k in self._inputs[fqn] if k not in self._saved)
            start, end = self._span[fqn]
            costs[fqn] = ModuleCost(
                fqn,
                layer_kind(module),
                freed[fqn] - added,
                self._seconds[fqn],
                before_bytes=before[start],
                start=start,
                end=end,
            )
        baseline = sum(nbytes for nbytes, _ in self._saved.values())
        self._alive.clear()
        self._saved.clear()
        return Measurement(baseline, costs, frozenset(self._unsafe))

    def _sync(self) -> None:
        device = self._device
        if device is not None and device.type != "cpu":
            backend = getattr(torch, device.type, None)
            if backend is not None and hasattr(backend, "synchronize"):
                backend.synchronize()

    def _enter(self, fqn: str) -> Callable[..., None]:
        def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
            tensors = list(tensors_in((args, kwargs)))
            keys = self._inputs[fqn]
            for t in tensors:
                key = _storage_key(t)
                if key is not None and key not in self._skip:
                    keys.add(key)
                    self._input_bytes[key] = t.untyped_storage().nbytes()
                    self._alive.append(t)
            self._calls.append([(t, _version(t)) for t in tensors])
            self._stack.append(fqn)
            self._span.setdefault(fqn, [len(self._saved), 0])
            self._sync()
            self._starts.append(self._clock())

        return enter

    def _exit(self, fqn: str) -> Callable[..., None]:
        def exit_(module: nn.Module, args: tuple, output: Any) -> None:
            if not self._starts:
                return
            self._sync()
            self._seconds[fqn] += self._clock() - self._starts.pop()
            self._span[fqn][1] = len(self._saved)
            self._stack.pop()
            self._ran.add(fqn)
            if any(v is not None and _version(t) != v for t, v in self._calls.pop()):
                self._unsafe.add(fqn)

        return exit_

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is None or key in self._skip or isinstance(t, nn.Parameter):
            return t
        inside = set(self._stack)
        entry = self._saved.get(key)
        if entry is None:
            self._saved[key] = [t.untyped_storage().nbytes(), inside]
        else:
            entry[1] &= inside
        return t


def _unchanged(t: torch.Tensor) -> torch.Tensor:
    return t


def measure(
    model: nn.Module, run: Callable[[], Any], recompute: Recompute | None = None
) -> Measurement:
    """Run ``run()`` once (forward only; its output is dropped) and measure every module.

    Compression is suspended and recomputed modules run plainly during the pass; RNG streams and
    the model's buffers are as before the call afterwards.
    """
    buffers = [b.detach().clone() for b in model.buffers()]
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda), torch.enable_grad():
        recorder = _Recorder(model, recompute).start()
        try:
            run()
        finally:
            measurement = recorder.stop()
            with torch.no_grad():
                for buf, saved in zip(model.buffers(), buffers, strict=True):
                    buf.copy_(saved)
    return measurement


# --------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class RecomputePlan:
    """The planner's choice; ``str(plan)`` is a table of the candidates, best first."""

    budget: float
    baseline_bytes: int  # saved for backward without any recompute
    kept_bytes: int  # estimated to be saved with the plan
    peak_bytes: int  # estimated most held in backward (kept, or a replay on top of what is held)
    chosen: tuple[str, ...]  # picked by the planner
    fixed: tuple[str, ...]  # recomputed by recompute.modules / types
    candidates: tuple[ModuleCost, ...]  # every module with something to free, best rate first

    @property
    def met(self) -> bool:
        """True when the kept bytes are within the budget."""
        return self.kept_bytes <= self.budget * self.baseline_bytes

    @property
    def kept_fraction(self) -> float:
        return self.kept_bytes / self.baseline_bytes if self.baseline_bytes else 1.0

    def __str__(self) -> str:
        return self.table()

    def table(self, max_rows: int = 40) -> str:
        """The summary line and up to ``max_rows`` candidates with their action."""
        mib = 1 << 20
        status = "" if self.met else " (budget not reachable with these modules)"
        head = (
            f"recompute plan: keeps {self.kept_bytes / mib:.2f} of {self.baseline_bytes / mib:.2f}"
            f" MiB saved for backward ({self.kept_fraction:.0%}, budget {self.budget:.0%})"
            f"{status}, estimated backward peak {self.peak_bytes / mib:.2f} MiB; recompute "
            f"{len(self.chosen) + len(self.fixed)} modules"
        )
        regions = set(self.chosen) | set(self.fixed)
        rows = [("module", "kind", "frees MiB", "forward ms", "MiB/s", "action")]
        for c in self.candidates:
            if c.fqn in regions:
                action = RECOMPUTE if c.fqn in self.chosen else f"{RECOMPUTE} (config)"
            elif any(p in regions for p in parent_fqns(c.fqn)):
                action = IN_RECOMPUTE
            else:
                action = "-"
            rows.append(
                (
                    c.fqn,
                    c.kind,
                    f"{c.saved_bytes / mib:.2f}",
                    f"{c.seconds * 1e3:.2f}",
                    f"{c.bytes_per_second / mib:.0f}",
                    action,
                )
            )
        hidden = max(0, len(rows) - 1 - max_rows)
        rows = rows[: max_rows + 1]
        widths = [max(len(r[i]) for r in rows) for i in range(6)]
        lines = [head] + [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
        if hidden:
            lines.append(f"... {hidden} more candidates")
        return "\n".join(lines)


def estimated_peak(regions: Sequence[ModuleCost], kept: int) -> int:
    """Most bytes held in backward: ``kept`` at its start, or a region's replay on top of what
    is still held then -- what was saved before the region, less what earlier regions freed."""
    peak = kept
    for r in regions:
        earlier = sum(a.saved_bytes for a in regions if a.end <= r.start and a is not r)
        peak = max(peak, r.before_bytes - earlier + r.saved_bytes)
    return peak


def choose(measurement: Measurement, budget: float, fixed: Sequence[str] = ()) -> RecomputePlan:
    """Pick modules to recompute until at most ``budget`` of the baseline saved bytes remain.

    Greedy, best rate first: a candidate's benefit is what it removes from the kept bytes plus
    what it removes from the estimated backward peak (:func:`estimated_peak`), per second of
    its forward; near the end the cheapest single pick that meets the budget is taken instead
    when it costs less than the best rate would need. A candidate that contains picked modules
    is judged by what it adds over them, and replaces them when picked; one that would raise
    kept + peak is not picked. Never
    picked: modules overlapping ``fixed`` (recomputed by the config), modules that changed an
    input in place, and modules freeing more than half of the baseline by themselves.
    """
    if not 0 < budget <= 1:
        raise ConfigError(f"recompute.auto.budget: {budget!r} is not a number in (0, 1]")
    costs = measurement.costs
    baseline = measurement.baseline_bytes
    fixed_costs = [costs[f] for f in fixed if f in costs]
    kept = baseline - sum(c.saved_bytes for c in fixed_costs)
    target = budget * baseline
    pool = [
        c
        for c in costs.values()
        if 0 < c.saved_bytes <= baseline // 2
        and c.fqn not in measurement.unsafe
        and not any(c.fqn == f or within(c.fqn, f) or within(f, c.fqn) for f in fixed)
    ]
    picked: dict[str, ModuleCost] = {}
    peak = estimated_peak(fixed_costs, kept)
    while kept > target:
        best: tuple[float, ModuleCost, list[str], int, int] | None = None
        closer: tuple[float, ModuleCost, list[str], int, int] | None = None
        for c in pool:
            if c.fqn in picked or any(p in picked for p in parent_fqns(c.fqn)):
                continue
            inner = [p for p in picked if within(p, c.fqn)]
            gain = c.saved_bytes - sum(picked[p].saved_bytes for p in inner)
            if gain <= 0:
                continue
            trial = [*fixed_costs, *(v for k, v in picked.items() if k not in inner), c]
            new_peak = estimated_peak(trial, kept - gain)
            benefit = gain + peak - new_peak
            if benefit <= 0:
                continue
            seconds = max(c.seconds - sum(picked[p].seconds for p in inner), 1e-9)
            if best is None or benefit / seconds > best[0]:
                best = (benefit / seconds, c, inner, gain, new_peak)
            if kept - gain <= target and (closer is None or seconds < closer[0]):
                closer = (seconds, c, inner, gain, new_peak)
        if best is None:
            break
        # Do not overshoot: one pick that meets the budget wins when it costs no more than the
        # best-rate pick (when that one meets it too), or than the best rate would need for
        # the remaining bytes (when it does not).
        best_seconds = max(best[1].seconds - sum(picked[p].seconds for p in best[2]), 1e-9)
        gap = kept - target
        needed = best_seconds if best[3] >= gap else gap * best_seconds / best[3]
        if closer is not None and closer[0] <= needed:
            best = closer
        _, c, inner, gain, peak = best
        for p in inner:
            del picked[p]
        picked[c.fqn] = c
        kept -= gain
    order = list(costs)
    return RecomputePlan(
        budget=budget,
        baseline_bytes=baseline,
        kept_bytes=kept,
        peak_bytes=peak,
        chosen=tuple(sorted(picked, key=order.index)),
        fixed=tuple(fixed),
        candidates=tuple(sorted(pool, key=lambda c: -c.bytes_per_second)),
    )


class RecomputePlanner:
    """``recompute.auto``: measure one forward, pick modules under the budget, recompute them.

    Args:
        recompute: the model's :class:`Recompute` (its wrapped modules are the fixed ones).
        budget: keep at most this fraction of the baseline saved bytes.
        on_plan: called after every change of the chosen modules.
    """

    def __init__(
        self,
        recompute: Recompute,
        budget: float,
        on_plan: Callable[[RecomputePlan | None], None] | None = None,
    ):
        self.recompute = recompute
        self.budget = budget
        self.on_plan = on_plan
        self.plan: RecomputePlan | None = None
        self.chosen: tuple[str, ...] = ()
        self._handles: list[RemovableHandle] = []
        self._recorder: _Recorder | None = None

    @property
    def fixed(self) -> tuple[str, ...]:
        return tuple(f for f in self.recompute.wrapped if f not in self.chosen)

    def install(self) -> None:
        """Measure the first training forward of the model and apply the plan after it."""
        root = self.recompute.model
        self._handles = [
            forward_pre_hook(root, self._start, prepend=True),
            forward_hook(root, self._finish, always_call=True),
        ]

    def remove(self) -> None:
        """Stop measuring (the recomputed modules stay until ``Recompute.remove``)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.stop()

    def plan_now(self, run: Callable[[], Any], budget: float | None = None) -> RecomputePlan:
        """Measure ``run()`` now (see :func:`measure`), replace the previous plan, apply it."""
        self.remove()
        self.recompute.unwrap(self.chosen)
        self.chosen, self.plan = (), None
        try:
            measurement = measure(self.recompute.model, run, self.recompute)
        except BaseException:
            if self.on_plan is not None:
                self.on_plan(None)
            raise
        budget = self.budget if budget is None else budget
        return self._apply(choose(measurement, budget, self.fixed))

    def adopt(self, fqns: Sequence[str]) -> None:
        """Recompute exactly these modules (a plan restored from a state dict), no measuring."""
        names = {f for f, _ in self.recompute.model.named_modules()}
        bad = [f for f in fqns if f not in names or f == ""]
        overlap = [
            f for f in fqns if any(f == x or within(f, x) or within(x, f) for x in self.fixed)
        ]
        if bad or overlap or len(outermost(fqns)) != len(fqns):
            raise ConfigError(
                f"state_dict recompute plan {list(fqns)[:5]} does not fit this model: "
                + (f"no module named {bad[:3]}" if bad else "its modules overlap")
            )
        self.remove()
        self.recompute.unwrap(self.chosen)
        self.chosen = tuple(self.recompute.wrap(fqns))
        self.plan = None
        log.info("memopt: recompute plan restored: %s", ", ".join(self.chosen) or "nothing")
        if self.on_plan is not None:
            self.on_plan(None)

    def _start(self, module: nn.Module, args: Any) -> None:
        if self._recorder is None and torch.is_grad_enabled() and module.training:
            self._recorder = _Recorder(module, self.recompute).start()

    def _finish(self, module: nn.Module, args: Any, output: Any) -> None:
        recorder, self._recorder = self._recorder, None
        if recorder is None:
            return
        measurement = recorder.stop()
        if sys.exc_info()[0] is not None:
            return  # the forward failed: measure the next one
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._apply(choose(measurement, self.budget, self.fixed))

    def _apply(self, plan: RecomputePlan) -> RecomputePlan:
        self.chosen = tuple(self.recompute.wrap(plan.chosen))
        self.plan = plan
        level = logging.INFO if plan.met else logging.WARNING
        log.log(level, "memopt: %s", plan)
        if self.on_plan is not None:
            self.on_plan(plan)
        return plan
