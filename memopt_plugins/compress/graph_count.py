"""What compiled graphs keep for backward, counted per call of each graph.

A compiled graph's pack hooks run once, when AOTAutograd traces the graph; the graph then runs
any number of times per forward (compiled per block, one graph serves every block). So the
bytes are noted per traced graph (:meth:`CompiledCounts.traced`, under AOTAutograd's id of the
graph) and, after each forward, multiplied by how often each graph ran in it: its autograd nodes
found walking back from the forward's outputs (:meth:`CompiledCounts.runs`).

What a graph saves as it is, uncompressed, is noted by kind (:data:`KEPT`), so that the log can
say what cannot be compressed there and what it costs.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from ..tree import tensors_in

_LOGGING_UTILS = "torch._functorch._aot_autograd.logging_utils"

#: Why a compiled graph saves a tensor as it is, for the log and the README.
KEPT = {
    "small": "tensors under quantize.min_numel",
    "integer": "integer and bool tensors (eager narrows them losslessly)",
    "gapped": "slices with gaps (not dense)",
    "input view": "views of the graph's inputs (they may alias parameters)",
}


def traced_graph() -> int | None:
    """AOTAutograd's id of the graph being compiled (private; ``None`` when unknown)."""
    module = sys.modules.get(_LOGGING_UTILS)
    context = getattr(module, "get_aot_compilation_context", None)
    if context is None:
        return None
    names = context()[0]
    head = names[0].split("_", 1)[0] if names else ""
    return int(head) if head.isdigit() else None


@dataclass(frozen=True)
class _Saved:
    """One tensor a traced graph saves: its bytes, what the graph keeps for it, why as it is."""

    original: int
    stored: int
    kept: str | None  # a KEPT kind, or None: compressed (or cast to 16 bits)


class CompiledCounts:
    """The saved tensors of every graph traced with the compression hooks, by graph id."""

    def __init__(self) -> None:
        self._graphs: dict[int, dict[str, _Saved]] = {}

    def __bool__(self) -> bool:
        return bool(self._graphs)

    def traced(self, node: str, original: int, stored: int, kept: str | None) -> None:
        """Note what the graph being traced saves for its node ``node`` (traced twice: once)."""
        graph = traced_graph()
        if graph is not None:
            self._graphs.setdefault(graph, {})[node] = _Saved(original, stored, kept)

    def runs(self, outputs: Any) -> Counter[int]:
        """How often each traced graph ran in the forward that returned ``outputs``."""
        stack = [t.grad_fn for t in tensors_in(outputs) if t.grad_fn is not None]
        seen, runs = set(), Counter()
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            stack.extend(n for n, _ in node.next_functions)
            graph = getattr(getattr(type(node), "_forward_cls", None), "_aot_id", None)
            if graph in self._graphs:
                runs[graph] += 1
        return runs

    def bytes(self, runs: Counter[int]) -> dict[int, tuple[int, int]]:
        """``{graph: (original, stored)}``, summed over the graph's ``runs``."""
        out = {}
        for graph, n in runs.items():
            saved = self._graphs[graph].values()
            out[graph] = (n * sum(s.original for s in saved), n * sum(s.stored for s in saved))
        return out

    def kept(self, runs: Counter[int]) -> dict[str, int]:
        """Bytes the graphs saved as they are in those ``runs``, per :data:`KEPT` kind."""
        out: Counter[str] = Counter()
        for graph, n in runs.items():
            for s in self._graphs[graph].values():
                if s.kept is not None:
                    out[s.kept] += n * s.stored
        return dict(out)


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
