"""One forward pre-hook and one forward hook per module, shared by everything that needs scopes.

Compression, dropout routing, the drift check's recorders, the recompute planner and the profiler
all need to know when a module's forward starts and ends. Each is a :class:`ScopeObserver` that
:meth:`ScopeTracker.watch`-es the modules it needs; a model's tracker (:meth:`ScopeTracker.of`)
keeps at most one hook pair on a module, installed for its first watcher and removed after its
last. Observers are told in watch order on entry and in reverse on exit (``always_call``: also
when the forward raised), so the contexts they open nest.

torch runs ``always_call`` hooks only for an ``Exception``: after a ``KeyboardInterrupt`` or
``SystemExit`` in a forward, the observers' contexts (saved-tensor hooks, torch-function modes)
would stay on the thread. So each thread keeps the scopes entered and not yet left, and every way
out leaves them: an :class:`InterruptGuard` around the model's forward (it enters the model's own
scope, so no user hook runs before its ``try``), the thread's next outermost call, and
:meth:`ScopeTracker.leave_abandoned` (``MemoryOptimizer.remove``).
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
import weakref
from collections.abc import Iterable
from types import FrameType
from typing import Any, Protocol

import torch
from torch import nn

from ..patching import InstanceForward, forward_hook, forward_pre_hook

log = logging.getLogger("memopt")


def eagerly() -> Any:
    """A context in which ``torch.compile``'d code runs eagerly
    (``torch.compiler.set_stance("force_eager")``): every module's hooks fire, so passes that
    observe modules one by one (the drift check, the recompute planner's measurement) see them
    all, and nothing is compiled for those passes."""
    return torch.compiler.set_stance("force_eager")


class UntracedRegions:
    """How deep the code being traced is inside recomputed regions (``depth``, raised by the
    recompute wrapper): torch.compile traces those into its checkpoint operator, and scopes there
    do not read their compile keys (nothing in a recomputed region is compressed)."""

    depth = 0


class ScopeObserver(Protocol):
    """Told when a watched module's forward starts and ends."""

    def enter(self, fqn: str, module: nn.Module, args: tuple, kwargs: dict) -> None: ...

    def exit(self, fqn: str, module: nn.Module, args: tuple, output: Any) -> None: ...


class _Hooked:
    """A module with memopt's hook pair and the observers watching it."""

    __slots__ = ("fqn", "observers", "handles", "key", "tracker")

    def __init__(self, fqn: str, module: nn.Module, tracker: ScopeTracker):
        self.fqn = fqn
        self.observers: list[ScopeObserver] = []
        self.key = ""  # what graphs this module is traced into depend on (ScopeTracker.set_key)
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
            # Traced into a compiled graph: scopes act around it only. The graph is guarded on
            # the module's key, so a new key recompiles the graphs this module runs in, no others.
            if not UntracedRegions.depth:
                _guard_on(self.key)
            return
        if self.fqn == "" and _guard_of(module) is not None:
            return  # the model's guard enters its scope, where an interrupt cannot leave it
        self.open(module, args, kwargs, _call_frame())

    def open(
        self,
        module: nn.Module,
        args: tuple,
        kwargs: dict,
        frame: FrameType | None,
        guarded: bool = False,
    ) -> None:
        """Enter the module's scope (``frame``: the call that keeps it alive; ``guarded``: the
        model's guard leaves it, not the hook)."""
        entered = _ENTERED.scopes
        if entered and not _within(self, entered[-1].hooked):  # not nested as modules nest:
            _leave(_abandoned(entered, len(entered)))  # is the scope it runs in still alive?
        entry = _Entry(self, module, args, frame)
        entry.guarded = guarded
        entered.append(entry)
        for observer in tuple(self.observers):
            entry.told.append(observer)  # one whose enter raised part-way leaves it too
            observer.enter(self.fqn, module, args, kwargs)
        entry.top = _contexts_top()

    def _exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        entered = _ENTERED.scopes
        # Innermost, but for hooks another tracker put on the same module, whose exits torch
        # runs in the order of their entries.
        for i in range(len(entered) - 1, -1, -1):
            if entered[i].hooked is self:
                if entered[i].guarded:
                    return  # its guard leaves it (this is a call of the model inside its own)
                break
            if entered[i].module is not module:
                return  # its entry never ran (a pre-hook before it raised), or was left already
        else:
            return
        self.close(entered.pop(i), output)

    def close(self, entry: _Entry, output: Any) -> None:
        """Tell the observers of ``entry`` (taken off the thread's scopes) that it is left."""
        for observer in reversed(entry.told):
            observer.exit(self.fqn, entry.module, entry.args, output)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class _Entry:
    """A scope entered on this thread and not left yet: the observers told of it, the frame of
    its module call (while that frame runs, the scope is alive), and the innermost saved-tensor
    hooks and number of ``TorchFunctionMode``'s before and once they entered (one that entered
    contexts can be left only while those are still innermost)."""

    __slots__ = ("hooked", "module", "args", "told", "frame", "guarded", "below", "top")

    def __init__(self, hooked: _Hooked, module: nn.Module, args: tuple, frame: FrameType | None):
        self.hooked = hooked
        self.module = module
        self.args = args
        self.told: list[ScopeObserver] = []
        self.frame = frame
        self.guarded = False  # entered by the model's InterruptGuard, which leaves it
        self.below = _contexts_top()
        self.top: tuple = ()

    def entered_contexts(self) -> bool:
        """Whether its observers' enter finished and left saved-tensor hooks or modes on the
        thread: those must still be innermost when it is left. A scope inside someone else's
        region (a recompute checkpoint) enters none of its own (what the region pushed is gone
        once it unwound), and is left whatever is innermost then."""
        return bool(self.top) and self.top != self.below


class _Entered(threading.local):
    """Each thread's entered scopes, innermost last, across every model's tracker."""

    def __init__(self) -> None:
        self.scopes: list[_Entry] = []


_ENTERED = _Entered()

#: The code of ``nn.Module._call_impl``, whose frame runs for as long as a module call does.
_CALL_CODE = nn.Module._call_impl.__code__


def _call_frame() -> FrameType | None:
    """The frame of the module call whose hook runs now (``None`` where it is not found: a call
    from compiled code, where the scope counts as alive)."""
    frame = sys._getframe(1)
    for _ in range(6):  # past the hook's own wrappers (EngineHook, dynamo's disable, torch's inner)
        if frame is None or frame.f_code is _CALL_CODE:
            return frame
        frame = frame.f_back
    return None


def _within(inner: _Hooked, outer: _Hooked) -> bool:
    """Whether ``inner``'s module lies inside ``outer``'s in the same model: how scopes nest in
    a forward; anything else (a model's own call, a module again, another model) may find the
    scopes an interrupt abandoned."""
    if inner.tracker is not outer.tracker or inner.fqn == "":
        return False
    return outer.fqn == "" or inner.fqn.startswith(outer.fqn + ".")


def _contexts_top() -> tuple:
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return (None if hooks is None else hooks[0], torch._C._len_torch_function_stack())


def _abandoned(entered: list[_Entry], depth: int) -> list[_Entry]:
    """The innermost of the thread's first ``depth`` scopes whose module calls no longer run
    (an interrupt left them), innermost first, up to the first that still runs."""
    running = set()
    frame: FrameType | None = sys._getframe()
    while frame is not None:
        running.add(id(frame))
        frame = frame.f_back
    out = []
    for entry in reversed(entered[:depth]):
        if entry.frame is None or id(entry.frame) in running:
            break
        out.append(entry)
    return out


class ScopeAbandoned(Exception):
    """What observers leaving an abandoned scope see as the exception in flight
    (``sys.exc_info()``): its forward did not finish."""


def _leave(entries: list[_Entry]) -> None:
    """Leave ``entries`` (innermost first, each innermost on the thread) as torch leaves a scope
    whose forward raised: its observers' ``exit``, in the reverse order of their ``enter``, with
    no output. One whose contexts are no longer innermost (something entered since and did not
    leave) is not left: its observers' contexts are beneath that, and leaving would close it."""
    entered = _ENTERED.scopes
    for entry in entries:
        if not entered or entered[-1] is not entry:
            continue
        if entry.entered_contexts() and entry.top != _contexts_top():
            log.warning(
                "memopt: the scope of %s was left by an interrupt, but saved-tensor hooks or "
                "torch function modes entered after it are still active; it stays entered",
                entry.hooked.fqn or "<root>",
            )
            return
        entered.pop()
        try:
            raise ScopeAbandoned(entry.hooked.fqn)
        except ScopeAbandoned:
            for observer in reversed(entry.told):
                try:
                    observer.exit(entry.hooked.fqn, entry.module, entry.args, None)
                except Exception as error:  # the others still leave theirs
                    log.warning(
                        "memopt: leaving the scope of %s raised %r", entry.hooked.fqn, error
                    )


class InterruptGuard(InstanceForward):
    """The ``forward`` instance attribute memopt sets on the model it patches. The model's own
    scope is entered and left here, around its forward, not by its hooks: a user's forward
    pre-hook or hook on the model runs between those and the forward, and an interrupt there
    would leave the scope's contexts on the thread with nothing of memopt's left to run. A
    ``BaseException`` other than an ``Exception`` (for which torch runs the scopes' exits itself)
    leaves every scope entered since the model's call began, the model's own included, before it
    propagates.

    Its frame is never traced (the forward it calls is): with the whole model compiled, the
    scope is still entered eagerly around the compiled graph, as the model's hooks were."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.previous = module.__dict__.get("forward")
        self.original = module.forward
        try:  # what inspects the forward (the Trainer's unused-column filter) sees the model's own
            self.__signature__ = inspect.signature(self.original)
        except (TypeError, ValueError):
            pass
        module.forward = self

    @torch.compiler.disable(recursive=False)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Its own frame is what keeps the model's scope alive; never a local of its own (the
        # frame would hold itself, and with it the forward's output, until a garbage collection).
        depth = len(_ENTERED.scopes)
        try:
            _open_guarded(self, args, kwargs, sys._getframe())
            output = self.original(*args, **kwargs)
        except BaseException as error:
            _interrupted(self.module, sys._getframe(), depth, error)
            raise
        _close_guarded(sys._getframe(), output)
        return output

    def remove(self) -> None:
        """Take the guard off; one wrapped since stays in place, as a plain pass-through (it
        leaves only scopes entered inside it, which would be left anyway)."""
        slots = self.module.__dict__
        if slots.get("forward") is self:
            if self.previous is None:
                del slots["forward"]
            else:
                slots["forward"] = self.previous


def _guard_of(module: nn.Module) -> InterruptGuard | None:
    """The guard that is ``module``'s forward now, if any: it enters the model's scope."""
    forward = module.__dict__.get("forward")
    return forward if type(forward) is InterruptGuard else None


@torch.compiler.disable
def _open_guarded(guard: InterruptGuard, args: tuple, kwargs: dict, frame: FrameType) -> None:
    """Enter the scope of the guard's model, if it is watched and the guard is the model's
    forward (else its pre-hook entered it, or the guard is called past its hooks)."""
    module = guard.module
    ref = ScopeTracker._of.get(module)
    tracker = ref() if ref is not None else None
    hooked = tracker._hooked.get(module) if tracker is not None else None
    if hooked is not None and _guard_of(module) is guard:
        hooked.open(module, args, kwargs, frame, guarded=True)


@torch.compiler.disable
def _close_guarded(frame: FrameType, output: Any) -> None:
    """Leave the model's scope the guard called from ``frame`` entered, as the model's forward
    hook would have."""
    entered = _ENTERED.scopes
    for i in range(len(entered) - 1, -1, -1):
        entry = entered[i]
        if entry.guarded and entry.frame is frame:
            entry.hooked.close(entered.pop(i), output)
            return


@torch.compiler.disable
def _interrupted(module: nn.Module, frame: FrameType, depth: int, error: BaseException) -> None:
    """The forward of ``module`` called by the guard in ``frame`` raised ``error``: an
    ``Exception`` leaves the model's scope (torch left those inside it), anything else every
    scope entered since the model's call began: from the guard's own (``depth``, the thread's
    scopes at the guard's start, where it entered none), and the model's scopes beneath it that
    hooks entered (of other trackers, or its own where the guard was wrapped since)."""
    if isinstance(error, Exception):
        _close_guarded(frame, None)
        return
    entered = _ENTERED.scopes
    # Entering the guard's scope may have left abandoned scopes beneath, never more.
    depth = min(depth, len(entered))
    for i in range(len(entered) - 1, -1, -1):
        if entered[i].guarded and entered[i].frame is frame:
            depth = i
            break
    while depth and entered[depth - 1].module is module:
        depth -= 1
    _leave(entered[depth:][::-1])


#: Models whose TorchScript modules were named in the log already (held weakly).
_SCRIPTED_NOTED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def scripted_modules(root: nn.Module) -> set[str]:
    """The fqns of ``root``'s TorchScript modules and of everything inside them: they take no
    hooks (``register_forward_hook`` refuses a ScriptModule, and a scripted forward calls its
    children without hooks), so they run opaque, inside the scopes of the modules around them."""
    return _scripted(dict(root.named_modules()))


def _scripted(named: dict[str, nn.Module]) -> set[str]:
    tops = [f for f, m in named.items() if isinstance(m, torch.jit.ScriptModule)]
    return {f for f in named for top in tops if not top or f == top or f.startswith(f"{top}.")}


def _note_scripted(root: nn.Module, scripted: set[str]) -> None:
    """Say once per model which TorchScript modules run without scopes of their own."""
    if not scripted or root in _SCRIPTED_NOTED:
        return
    _SCRIPTED_NOTED.add(root)
    outer = sorted(f for f in scripted if f.rpartition(".")[0] not in scripted or not f)
    log.info(
        "memopt: %d TorchScript modules (%s%s) run as they are, without scopes of their own: "
        "what they save for backward belongs to the scope of the module that calls them",
        len(outer),
        ", ".join(f or "<root>" for f in outer[:3]),
        ", ..." if len(outer) > 3 else "",
    )


def _guard_on(key: str) -> bool:
    """Compares ``key``: read while torch.compile traces, the graph is guarded on its value."""
    return key == "\0"


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
        A TorchScript module takes no hooks: it and what lies inside it run opaque, inside the
        scopes of the modules around them. All or nothing: a failure part-way takes off what
        this call added.
        """
        named = dict(self.root.named_modules())
        names = list(named) if fqns is None else list(dict.fromkeys(fqns))
        scripted = _scripted(named)
        _note_scripted(self.root, scripted)
        modules: list[nn.Module] = []
        try:
            for fqn in names:
                module = named[fqn]
                if fqn in scripted:
                    continue
                hooked = self._hooked.get(module)
                if hooked is None:
                    hooked = self._hooked[module] = _Hooked(fqn, module, self)
                if first:
                    hooked.observers.insert(0, observer)
                else:
                    hooked.observers.append(observer)
                modules.append(module)
        except BaseException:
            self._unwatch(observer, modules)
            raise
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

    def set_key(self, keys: dict[str, str]) -> None:
        """Give watched modules (by fqn) the keys that ``torch.compile``'d graphs they run in
        are guarded on: a module's graphs recompile when its key changes (what was traced into
        them, its bits, changed), the others run on."""
        for hooked in self._hooked.values():
            if hooked.fqn in keys:
                hooked.key = keys[hooked.fqn]

    def hooked(self, module: nn.Module) -> bool:
        """True while ``module`` carries the tracker's hooks."""
        return module in self._hooked

    @classmethod
    def leave_abandoned(cls, root: nn.Module) -> None:
        """Leave the scopes of ``root``'s modules the calling thread still holds whose module
        calls no longer run (an interrupt left them), with those entered after them; called
        before observers stop watching, so that each leaves what it entered."""
        entered = _ENTERED.scopes
        mine = [i for i, e in enumerate(entered) if e.hooked.tracker._root() is root]
        if mine:
            _leave(_abandoned(entered, len(entered))[: len(entered) - mine[0]])

    @staticmethod
    def depth() -> int:
        """How many scopes the calling thread has entered and not left."""
        return len(_ENTERED.scopes)

    @staticmethod
    def leave_from(depth: int) -> None:
        """Leave the calling thread's scopes beyond the first ``depth`` (after an interrupt in
        code that entered them)."""
        _leave(_ENTERED.scopes[depth:][::-1])
