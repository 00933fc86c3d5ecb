"""Compression inside ``torch.compile``'d graphs: how the hooks get in, and what the graphs save.

AOTAutograd (PyTorch >= 2.8) inlines saved-tensor hooks that are ``torch.fx.GraphModule`` objects
into the graphs it compiles: the pack hook ends the forward graph (which then saves codes and frees
the original inside it), the unpack hook starts the backward graph; plain Python hooks would see
only what the whole graph returns, its peak unchanged. So each scope enters one-call GraphModules
(:func:`hook_module`); traced (:func:`traced_context`), the call finds the innermost compressed
module that produced a saved tensor (:meth:`CompiledGraphs.scope_of`) and emits the traced codec
(:mod:`.codec.traced`) at its bits. While memopt is applied, AOTAutograd's ``no_static`` filter
(:class:`SavedFilter`) lets the hooks see all a graph saves but parameters and buffers. Pack hooks
run once, at tracing, so bytes are noted per traced graph and multiplied by its runs in each
forward (:meth:`CompiledGraphs.forward_done`). Each scope's module carries its bits as a key its
pre-hook compares while traced (:meth:`.ScopeTracker.set_key`): dynamo guards every graph on the
bits of the modules inside it, so a change of bits recompiles those graphs only (docs/compile.md).
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch._functorch.config as functorch_config
from torch import nn

from ..policy import KEPT
from ..tree import tensors_in
from .bits import BitTable

log = logging.getLogger("memopt")

_GRAPH_COMPILE = "torch._functorch._aot_autograd.graph_compile"
_LOGGING_UTILS = "torch._functorch._aot_autograd.logging_utils"


def backward_nodes(roots: Iterable[Any]) -> Iterator[Any]:
    """Every autograd node reachable from ``roots`` (``grad_fn`` nodes, ``None`` skipped), once
    each, depth first."""
    stack, seen = list(roots), set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions)
        yield node


def compiled_nodes(loss: torch.Tensor) -> Iterator[Any]:
    """The autograd nodes of ``loss``'s graph that run a compiled region's backward (AOTAutograd's
    ``CompiledFunction``): what they saved is what the compiled graphs keep for backward."""
    for node in backward_nodes([loss.grad_fn]):
        if "CompiledFunction" in type(node).__name__:
            yield node


def traced_context() -> dict[str, Any] | None:
    """AOTAutograd's context of the saved tensor being traced (private; ``None`` outside a
    trace). Not imported here: a process that never compiles never loads the compiler."""
    module = sys.modules.get(_GRAPH_COMPILE)
    context = getattr(module, "_get_saved_tensor_hook_context", None)
    return None if context is None else context()


def hook_module(
    fn: Callable[[Any], Any], name: str, eager: Callable[[Any], Any] | None = None
) -> torch.fx.GraphModule:
    """A GraphModule whose forward is ``fn(arg)``: a saved-tensor hook AOTAutograd inlines.

    ``eager``: what a call of the module runs instead of its forward (``fn`` itself, or a
    ``functools.partial`` of it): autograd calls it at every save, where the module call's own
    frames (``nn.Module.__call__``, the generated forward) would cost more than most packs.
    Set on the class torch makes for each GraphModule, so no other module is touched."""
    graph = torch.fx.Graph()
    graph.output(graph.call_function(fn, (graph.placeholder(name),)))
    module = torch.fx.GraphModule(nn.Module(), graph)
    if eager is not None:
        type(module).__call__ = staticmethod(eager)  # called without the module: eager(arg)
    return module


class SavedFilter:
    """AOTAutograd's ``saved_tensors_hooks_filtering_mode`` at ``no_static`` while any
    compression hooks are installed (a process-wide setting, read when a graph is compiled; put
    back when the last of them is removed)."""

    MODE = "no_static"
    _open = 0
    _previous: str | None = None

    @classmethod
    def open(cls) -> None:
        if cls._open == 0:
            cls._previous = functorch_config.saved_tensors_hooks_filtering_mode
            functorch_config.saved_tensors_hooks_filtering_mode = cls.MODE
        cls._open += 1

    @classmethod
    def close(cls) -> None:
        cls._open -= 1
        if cls._open == 0:
            functorch_config.saved_tensors_hooks_filtering_mode = cls._previous


def traced_graph() -> int | None:
    """AOTAutograd's id of the graph being compiled (private; ``None`` when unknown)."""
    module = sys.modules.get(_LOGGING_UTILS)
    context = getattr(module, "get_aot_compilation_context", None)
    if context is None:
        return None
    names = context()[0]
    head = names[0].split("_", 1)[0] if names else ""
    return int(head) if head.isdigit() else None


def nbytes(x: object) -> int | None:
    """Bytes of a tensor or a tuple of tensors (others count 0); ``None`` when symbolic."""
    items = x if isinstance(x, tuple) else (x,)
    total = 0
    for t in items:
        if isinstance(t, torch.Tensor):
            n = t.numel() * t.element_size()
            if not isinstance(n, int):
                return None
            total += n
    return total


@dataclass(frozen=True)
class _GraphSave:
    """One tensor a traced graph saves: its bytes, what the graph keeps for it, why as it is."""

    original: int
    stored: int
    kept: str | None  # a KEPT kind, or None: saved at its scope's bits


class CompiledGraphs:
    """The bookkeeping of the graphs compiled with the compression hooks of one model.

    Args:
        root: the patched model (its modules' ids name them in compiled graphs).
        bits: the bit table, read when a graph is traced.

    Attributes:
        kept: bytes the graphs saved as they are in the last forward, per
            :data:`~memopt_plugins.policy.KEPT` kind.
    """

    def __init__(self, root: nn.Module, bits: BitTable):
        self.root = root
        self.bits = bits
        self.kept: dict[str, int] = {}
        #: The compressed scopes whose tensors compiled graphs saved, at the bits last traced.
        self.traced_bits: dict[str, int] = {}
        self._graphs: dict[int, dict[str, _GraphSave]] = {}
        self._said: int | None = None  # the bit table's version a recompile was said at

    def scope_of(self, node: torch.fx.Node, default: str) -> str:
        """The innermost scope among the modules that produced ``node`` (``nn_module_stack``
        keys are module ids); ``default`` (the scope active when the graph was compiled) when
        none of them has one."""
        stack = node.meta.get("nn_module_stack") or {}
        scopes = self.bits.scopes
        ids = {str(id(m)): f for f, m in self.root.named_modules() if f in scopes}
        for key in reversed(list(stack)):
            if key in ids:
                return ids[key]
        return default

    def note_bits(self, fqn: str, bits: int) -> None:
        """A graph is traced saving tensors of scope ``fqn`` at ``bits``: say once per change of
        the bit table when this recompiles a graph for new bits."""
        before = self.traced_bits.get(fqn, bits)
        self.traced_bits[fqn] = bits
        if before != bits and self._said != self.bits.version:
            self._said = self.bits.version
            log.info(
                "memopt: bits changed inside compiled graphs (%s: %d -> %d bits, ...): "
                "torch.compile recompiles the graphs those modules run in at their next call "
                "(recompile_limit, %d, bounds how often; past it a graph runs eagerly)",
                fqn or "<root>", before, bits, torch._dynamo.config.recompile_limit,
            )  # fmt: skip

    def traced(self, node: str, original: int, stored: int, kept: str | None) -> None:
        """Note what the graph being traced saves for its node ``node`` (traced twice: once)."""
        graph = traced_graph()
        if graph is not None:
            self._graphs.setdefault(graph, {})[node] = _GraphSave(original, stored, kept)

    def forward_done(self, outputs: Any) -> dict[int, tuple[int, int]]:
        """A forward returned ``outputs``: ``{graph: (original, stored)}``, the bytes each traced
        graph saved in it (per run, times its runs); the kinds saved as they are go to
        :attr:`kept`."""
        if not self._graphs:
            return {}
        runs = self._runs(outputs)
        out: dict[int, tuple[int, int]] = {}
        kept: Counter[str] = Counter()
        for graph, n in runs.items():
            saved = self._graphs[graph].values()
            out[graph] = (n * sum(s.original for s in saved), n * sum(s.stored for s in saved))
            for s in saved:
                if s.kept is not None:
                    kept[s.kept] += n * s.stored
        self.kept = dict(kept)
        return out

    def _runs(self, outputs: Any) -> Counter[int]:
        """How often each traced graph ran in the forward that returned ``outputs``."""
        runs: Counter[int] = Counter()
        for node in backward_nodes(t.grad_fn for t in tensors_in(outputs)):
            graph = getattr(getattr(type(node), "_forward_cls", None), "_aot_id", None)
            if graph in self._graphs:
                runs[graph] += 1
        return runs

    def kept_text(self) -> str:
        """What the graphs saved as it is in the last forward, per kind, for the log."""
        return "saved uncompressed in this forward: " + ", ".join(
            f"{KEPT[kind]} ({n / 2**20:.2f} MiB)"
            for kind, n in sorted(self.kept.items(), key=lambda kv: -kv[1])
        )
