"""Selective recompute: chosen modules give up their saved activations and replay in backward.

A recomputed module keeps its class, parameters, hooks and state-dict keys: only an instance
attribute ``forward`` is set, running the original under non-reentrant ``torch.utils.checkpoint``
with the RNG state preserved; :meth:`Recompute.remove` deletes it. Traps handled (tests in
tests/test_recompute.py, tests/test_replay_state.py): the replay starts from the buffers and
tensor attributes the forward started from (spectral norm's power iteration, running statistics
updated in place or reassigned) and its own updates are discarded, so state moves once per step
(pytorch#96136); compression is suspended inside (recompute wins), while the checkpoint's
inputs are packed outside it, at the more precise of the module's own bits and the
enclosing scope's (:class:`~..compress.bits.BitTable`); an input changed in place raises
:class:`RecomputeError` naming the module, as does a failed replay; a Hugging Face KV cache is not
handed to a recomputed module in training. Which modules: the config (:func:`recompute_targets`)
or the planner (:mod:`.planner`).
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ConfigError, RecomputeConfig
from ..measure.isolate import Slots, put
from ..measure.scopes import UntracedRegions
from ..measure.storage import tensor_version
from ..measure.timeline import REPLAY_RANGE, mark
from ..patching import InstanceForward
from ..select import (
    check_globs,
    check_types,
    outermost,
    parent_fqns,
    select_modules,
    within,
)
from ..tree import tensors_in

log = logging.getLogger("memopt")

#: Plan actions: the recomputed module itself, and every module inside it.
RECOMPUTE = "recompute"
IN_RECOMPUTE = "in-recompute"

Suspend = Callable[[], AbstractContextManager[Any]]
#: A slot of a module's ``_buffers`` or ``__dict__``: ``(id(table), name)``.
SlotKey = tuple[int, str]
#: A slot as a forward started: ``(table, name, value, copied)`` (``copied``: ``value`` is a copy
#: of the tensor the forward changed in place).
Start = list[tuple[dict[str, Any], str, Any, bool]]


class RecomputeError(RuntimeError):
    """A recomputed module cannot be replayed in backward; the message names the module."""


# --------------------------------------------------------------------------- selection
def recompute_targets(model: nn.Module, config: RecomputeConfig) -> list[str]:
    """The modules ``recompute.modules``/``types`` select, outermost only, after validation.

    A container that is never called (``ModuleList``, ``ModuleDict``) has nothing to replay: it
    leaves the selection where a selected module holds it or every one of its elements is
    selected too (``blocks.*`` matches every module under ``blocks``, a T5 block's ``layer`` list
    or an MoE layer's experts with them, and recomputes the blocks). Selected otherwise, the user
    meant its elements and some would be left out: an error that names the glob of all of them.

    Raises:
        ConfigError: a glob or class name that matches nothing (with ``recompute.optional``
            it is logged and skipped instead), a selection that is the whole
            model or a never-called container alone (``transformer.h``), or a model that already
            checkpoints its activations (see :func:`existing_checkpointing`).
    """
    names = [fqn for fqn, _ in model.named_modules()]
    check_globs("recompute.modules", config.modules, names, config.optional)
    check_types("recompute.types", config.types, model, config.optional)
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
    if "" in selected:
        raise ConfigError(
            f"recompute: the selection includes the whole model ({type(model).__name__}, "
            "e.g. '*' matches the root); name submodules instead, e.g. 'transformer.h.*'"
        )
    lists = [f for f in selected if type(modules[f]).forward is nn.Module.forward]
    called = [f for f in selected if f not in lists]
    chosen, picked = outermost(called), set(selected)
    for fqn in lists:
        elements = [f"{fqn}.{name}" for name, _ in modules[fqn].named_children()]
        inside = any(within(fqn, c) for c in chosen)
        if not inside and not (elements and all(e in picked for e in elements)):
            raise ConfigError(
                f"recompute: {fqn!r} is a {type(modules[fqn]).__name__}, which is never called; "
                f"select its elements instead, e.g. '{fqn}.*'"
            )
    if len(chosen) < len(selected):
        log.debug(
            "memopt: %d selected modules lie inside other selected ones or are never called",
            len(selected) - len(chosen),
        )
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
        if changed and not self._cache_noted and not torch.compiler.is_compiling():
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
        # Per train/eval modes of the subtree: the slots whose tensor a forward changes in place.
        self._in_place: dict[tuple[bool, ...], set[SlotKey]] = {}

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
        if torch.compiler.is_compiling():
            # Inside a compiled graph: torch.compile's own checkpoint, which it recomputes in the
            # compiled backward (the eager wrapper's bookkeeping cannot be traced).
            UntracedRegions.depth += 1
            try:
                return checkpoint(self.original, *args, use_reentrant=False, **kwargs)
            finally:
                UntracedRegions.depth -= 1
        inputs = list(tensors_in((args, kwargs)))
        versions = [tensor_version(t) for t in inputs]
        # kwargs go through a closure: checkpoint() reserves some keyword names for itself.
        output = checkpoint(
            self._region(kwargs), *args, use_reentrant=False, preserve_rng_state=True
        )
        for t, v in zip(inputs, versions, strict=True):
            if v is not None and tensor_version(t) != v:
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
        start: Start = []

        def region(*args: Any) -> Any:
            nonlocal calls
            calls += 1
            with ExitStack() as stack:
                if self.owner.suspend is not None:
                    stack.enter_context(self.owner.suspend())
                if calls == 1:
                    return self._forward(args, kwargs, start)
                stack.enter_context(_replayed_from(self.module, start))
                stack.enter_context(mark(REPLAY_RANGE))
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

    def _forward(self, args: tuple[Any, ...], kwargs: dict[str, Any], start: Start) -> Any:
        """The original forward; fills ``start`` with every slot it changed, as it was before.

        Copied are the slots earlier forwards in the same train/eval modes changed in place (the
        first such forward copies every tensor that needs no gradient and learns which by
        version and value: some kernels, BatchNorm's, update without bumping the version). A
        tensor changed in place that was not copied cannot be replayed from its old value, so it
        raises :class:`RecomputeError` rather than replay wrong.
        """
        modes = tuple(m.training for m in self.module.modules())
        known = self._in_place.get(modes)
        before = Slots(self.module)
        state = before.state()
        versions = {id(t): tensor_version(t) for _, _, t in state}
        copies: dict[int, torch.Tensor] = {}
        for table, name, t in state:
            if not t.requires_grad and (known is None or (id(table), name) in known):
                copies.setdefault(id(t), t.detach().clone())
        output = self.original(*args, **kwargs)
        in_place, lost = set(), []
        for table, name, t in state:
            key = (id(table), name)
            copy = copies.get(id(t))
            changed = tensor_version(t) != versions[id(t)] or (known is not None and key in known)
            if known is None and copy is not None and not changed:
                changed = not torch.equal(copy, t)
            if not changed:
                continue
            in_place.add(key)
            if copy is None:
                lost.append((table, name))
            else:
                start.append((table, name, copy, True))
        moved = {(id(table), name) for table, name, _, _ in start}
        start += [(t, n, v, False) for t, n, v in before.changes() if (id(t), n) not in moved]
        if known is None:
            self._in_place[modes] = in_place
        else:
            known |= in_place
        if lost:
            raise RecomputeError(
                f"memopt recompute: {self._name} changed {_slot_names(self.module, lost)} in "
                "place during forward, and no copy of the old value was kept (copied are the "
                "tensors without grad that the first forward in these train/eval modes changed "
                "in place): the backward replay would start from the changed value. Later "
                "forwards copy it; for an exact step now, stop recomputing "
                f"{self.fqn!r} (recompute.modules / recompute.types)."
            )
        return output


@contextmanager
def _replayed_from(module: nn.Module, start: Start) -> Iterator[None]:
    """The replay runs on the slots as the forward started (a fresh copy of each tensor the
    forward changed in place, as the replay changes it again); on exit every buffer and tensor
    attribute of ``module`` holds what it held before the replay."""
    now = Slots(module)
    fresh: dict[int, torch.Tensor] = {}
    for table, name, value, copied in start:
        if copied:
            if id(value) not in fresh:
                fresh[id(value)] = value.clone()
            value = fresh[id(value)]
        put(table, name, value)
    try:
        yield
    finally:
        now.put_back()


def _slot_names(module: nn.Module, slots: Iterable[tuple[dict[str, Any], str]]) -> str:
    owners = {}
    for fqn, m in module.named_modules():
        owners.setdefault(id(m._buffers), fqn)
        owners.setdefault(id(vars(m)), fqn)
    names = [".".join(filter(None, (owners[id(table)], name))) for table, name in slots]
    return ", ".join(repr(n) for n in names)


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
