"""One forward pre-hook and one forward hook per module, shared by everything that needs scopes.

Compression (the innermost selected module decides the bits), dropout routing, the drift check's
recorders, the recompute planner and the profiler all need to know when a module's forward starts
and ends. Each is a :class:`ScopeObserver` that :meth:`ScopeTracker.watch`-es the modules it needs;
the tracker of a model (:meth:`ScopeTracker.of`) installs a hook pair on a module the first time it
is watched and removes it when nobody watches it any more, so a module carries at most one pair of
memopt's hooks, whoever is listening. Observers are told in the order they started watching when a
module is entered and in the reverse order when it is left (``always_call``: also when the forward
raised), so contexts they open nest properly.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn

from ..patching import forward_hook, forward_pre_hook


def eagerly() -> Any:
    """A context in which ``torch.compile``'d code runs eagerly
    (``torch.compiler.set_stance("force_eager")``): every module's hooks fire, so passes that
    observe modules one by one (the drift check, the recompute planner's measurement) see them
    all, and nothing is compiled for those passes."""
    return torch.compiler.set_stance("force_eager")


class UntracedRegions:
    """How deep the code being traced is inside recomputed regions (``depth``, raised by the
    recompute wrapper): torch.compile traces those into its checkpoint operator, inside which
    nothing from outside may be mutated, so scopes there do not note that they were traced
    (nothing in a recomputed region is compressed: the note has nothing to say of them)."""

    depth = 0


class ScopeObserver(Protocol):
    """Told when a watched module's forward starts and ends."""

    def enter(self, fqn: str, module: nn.Module, args: tuple, kwargs: dict) -> None: ...

    def exit(self, fqn: str, module: nn.Module, args: tuple, output: Any) -> None: ...


def _note_traced(hooked: _Hooked) -> None:
    """Note that ``hooked``'s module was traced into a compiled graph, once, while it is traced.

    Marked as a constant result for dynamo (what ``torch.compiler.assume_constant_result`` sets,
    without importing the compiler where nothing compiles): dynamo runs it when it traces the
    hook and leaves it out of the graph. Traced as a ``set.add``, it made the graph guard on the
    set's contents, so each scope noted afterwards recompiled every graph noted before (the whole
    model at its second step; compiled per block, each block again after the next one's note).
    """
    hooked.traced.add(hooked.fqn)


_note_traced._dynamo_marked_constant = True  # type: ignore[attr-defined]


class _Hooked:
    """A module with memopt's hook pair and the observers watching it."""

    __slots__ = ("fqn", "observers", "handles", "traced", "tracker")

    def __init__(self, fqn: str, module: nn.Module, tracker: ScopeTracker):
        self.fqn = fqn
        self.observers: list[ScopeObserver] = []
        self.traced = tracker._traced  # fqns called inside a torch.compile'd graph
        self.tracker = tracker  # the module's hooks keep its tracker alive (the registry is weak)
        enter, exit_ = self._enter, self._exit
        if fqn == "":
            # The root's scope runs eagerly even when the whole model is compiled (one graph
            # break before and after the model's forward), so that what it enters -- compression
            # above all -- holds for the compiled graph's saved tensors.
            enter, exit_ = torch._dynamo.disable(enter), torch._dynamo.disable(exit_)
        self.handles = (
            forward_pre_hook(module, enter, with_kwargs=True),
            forward_hook(module, exit_, always_call=True),
        )

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():
            if not UntracedRegions.depth:  # traced into a compiled graph: scopes act around it only
                _note_traced(self)
            return
        for observer in tuple(self.observers):
            observer.enter(self.fqn, module, args, kwargs)

    def _exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        for observer in tuple(reversed(self.observers)):
            observer.exit(self.fqn, module, args, output)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class Watch:
    """What :meth:`ScopeTracker.watch` returns: :meth:`remove` stops the observer's watch."""

    def __init__(self, tracker: ScopeTracker, observer: ScopeObserver, modules: list[nn.Module]):
        self.tracker = tracker
        self._observer = observer
        self._modules = modules

    def remove(self) -> None:
        modules, self._modules = self._modules, []
        self.tracker._unwatch(self._observer, modules)


class ScopeTracker:
    """The shared module hooks of one model (see the module docstring)."""

    #: root -> its tracker, both weakly: the tracker lives as long as hooks of its are on the
    #: model (they hold it), so a model dropped unremoved is collected with everything it holds.
    _of: weakref.WeakKeyDictionary[nn.Module, weakref.ref[ScopeTracker]] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, root: nn.Module):
        self._root = weakref.ref(root)  # the registry's key: a strong reference would pin it
        self._hooked: dict[nn.Module, _Hooked] = {}
        self._traced: set[str] = set()

    @property
    def root(self) -> nn.Module:
        root = self._root()
        if root is None:
            raise RuntimeError("the model of this ScopeTracker no longer exists")
        return root

    @classmethod
    def of(cls, root: nn.Module) -> ScopeTracker:
        """The tracker of ``root`` (created on first use; fqns are names within ``root``)."""
        ref = cls._of.get(root)
        tracker = ref() if ref is not None else None
        if tracker is None:
            tracker = cls(root)
            cls._of[root] = weakref.ref(tracker)
        return tracker

    def watch(
        self, observer: ScopeObserver, fqns: Iterable[str] | None = None, *, first: bool = False
    ) -> Watch:
        """Tell ``observer`` about the modules named ``fqns`` (default: every module).

        ``first``: the observer is told before those already watching (and left after them).
        """
        named = dict(self.root.named_modules())
        names = list(named) if fqns is None else list(dict.fromkeys(fqns))
        modules = []
        for fqn in names:
            module = named[fqn]
            hooked = self._hooked.get(module)
            if hooked is None:
                hooked = self._hooked[module] = _Hooked(fqn, module, self)
            if first:
                hooked.observers.insert(0, observer)
            else:
                hooked.observers.append(observer)
            modules.append(module)
        return Watch(self, observer, modules)

    def _unwatch(self, observer: ScopeObserver, modules: list[nn.Module]) -> None:
        for module in modules:
            hooked = self._hooked.get(module)
            if hooked is None:
                continue
            hooked.observers = [o for o in hooked.observers if o is not observer]
            if not hooked.observers:
                hooked.remove()
                del self._hooked[module]
        root = self._root()
        ref = type(self)._of.get(root) if root is not None else None
        if not self._hooked and ref is not None and ref() is self:
            del type(self)._of[root]

    def traced(self) -> list[str]:
        """Fqns of the watched modules that ran inside a ``torch.compile``'d graph, outside
        recomputed regions (:class:`UntracedRegions`): their scopes cannot act there (what the
        graph saves meets the scope active around it)."""
        return sorted(self._traced)

    def hooked(self, module: nn.Module) -> bool:
        """True while ``module`` carries the tracker's hooks."""
        return module in self._hooked
