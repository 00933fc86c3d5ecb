"""Compression inside ``torch.compile``'d graphs: the scopes' saved-tensor hooks as GraphModules.

Since PyTorch 2.8, AOTAutograd inlines the saved-tensor hooks active when it compiles a frame
into the compiled graphs, when both hooks are ``torch.fx.GraphModule``\\ s: the pack hook becomes
the epilogue of the forward graph (the graph saves codes, and the original is freed inside it) and
the unpack hook the prologue of the backward graph. Hooks that are plain Python functions run
instead on what a compiled graph returns for backward, after the whole graph has run, so the
graph's peak is not reduced.

Each compression scope therefore enters hooks that are GraphModules of one call each
(:class:`GraphHooks`). Called by autograd on a real tensor, the call is the eager path of
:class:`~.hooks.CompressionHooks` (fused codec, stochastic rounding, dedup, statistics), as
before. Traced by AOTAutograd, the call sees the graph node of the saved tensor, finds the
innermost compressed module that produced it (``nn_module_stack`` keys are module ids) and emits
the codec in PyTorch operations that inductor compiles into the graph, at that module's bits
(:mod:`.graph_codec`): the codes, bfloat16 scale and zero point of :mod:`.reference`, in the same
bytes compiled as eager. The groups' minima and maxima, codes and packing are fused into the
kernels around them; the parameters between them are one opaque operator
(``memopt::graph_params``) where the C kernels serve the tensor (:func:`.ops.native_params`):
inlined, their few dozen operations went into every kernel that saves a tensor, and compiling
took four times as long. Elsewhere (CUDA, float64, ``MEMOPT_CODEC=torch``, no C compiler) they
stay inlined: the operator would run them as a few dozen small tensor operations, eagerly, at
every call.

What the hooks see: every tensor a graph saves but the parameters and buffers (AOTAutograd's
``no_static`` filter, set while memopt is applied: :class:`_SavedFilter`). Its default,
``donated``, hid the graph's inputs and the saved tensors that are also outputs of the graph:
compiled per block, every block's input (2 MiB a block on GPT-2 4 x 256, batch 8 x 256); the whole
model compiled, the logits (16 MiB there), which the graph saves and the caller's loss discarded.

Inside a graph, compared with eager:

* stochastic rounding draws its noise from a seed drawn on the host at every run of the graph
  (``memopt::graph_seed``, from memopt's CPU generator, never the global RNG) and hashed per
  element as the C kernel hashes it: at the same seed the codes are the native codec's;
* a group the eager codec keeps exactly (NaN/Inf, a range the bfloat16 scale cannot express)
  decodes to NaN, and a constant group to its value rounded up to a bfloat16 step;
* saved as they are (:data:`.graph_count.KEPT`): integer tensors, slices with gaps and views of
  the graph's inputs (they may be views of parameters), besides tensors under ``min_numel``;
* tensors are not deduplicated across graphs (a block's output saved by the next block's graph
  as its input is coded there once, and again if its own graph saves it too);
* what the graphs save is counted from the sizes they were traced with, times the calls of each
  graph in the forward (``SavedStats.compiled``, per compiled graph; :mod:`.graph_count`).

The bits are read when a graph is compiled; a change of bits gives every scope new hook objects,
so ``torch.compile``'s guard on the hooks recompiles the graphs at their next call.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch._functorch.config as functorch_config
from torch import nn

from ..config import HALF_BITS, OFF_BITS
from .bits import BitTable
from .codec.ops import add_seed_source, remove_seed_source
from .codec.traced import CODED, HALVED, Coded, decode, encode, memory_order
from .graph_count import KEPT, CompiledCounts, nbytes

if TYPE_CHECKING:
    from .hooks import SavedStats

log = logging.getLogger("memopt")

_GRAPH_COMPILE = "torch._functorch._aot_autograd.graph_compile"


def _traced_context() -> dict[str, Any] | None:
    """AOTAutograd's context of the saved tensor being traced (private; ``None`` outside a
    trace). Not imported here: a process that never compiles never loads the compiler."""
    module = sys.modules.get(_GRAPH_COMPILE)
    context = getattr(module, "_get_saved_tensor_hook_context", None)
    return None if context is None else context()


def _one_call(fn: Callable[[Any], Any], name: str) -> torch.fx.GraphModule:
    """A GraphModule whose forward is ``fn(arg)``."""
    graph = torch.fx.Graph()
    graph.output(graph.call_function(fn, (graph.placeholder(name),)))
    return torch.fx.GraphModule(nn.Module(), graph)


class _SavedFilter:
    """AOTAutograd's ``saved_tensors_hooks_filtering_mode`` at ``no_static`` while any
    :class:`GraphHooks` is open (a process-wide setting, read when a graph is compiled; put back
    when the last one closes)."""

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


def _views_an_input(node: torch.fx.Node, graph: torch.fx.Graph) -> bool:
    """True when ``node`` (not a placeholder) shares the memory of one of ``graph``'s inputs."""
    if node.op == "placeholder":
        return False
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False
    storage = val.untyped_storage()._cdata
    for p in graph.find_nodes(op="placeholder"):
        other = p.meta.get("val")
        if isinstance(other, torch.Tensor) and other.untyped_storage()._cdata == storage:
            return True
    return False


class GraphHooks:
    """The GraphModule hook pairs of the compression scopes, one per (scope, bits, table state).

    Args:
        root: the patched model (its modules' ids name them in compiled graphs).
        bits: the bit table, read when a graph is traced.
        stats: the hooks' byte counts, told per compiled graph what it saved in a forward.
        group_size, min_numel: codec settings.
        eager_pack, eager_unpack: the eager hooks, ``eager_pack(t, bits)``.
        draw_seed: draws one seed on the host for stochastic rounding inside the graphs (at every
            run of a graph, for every tensor it saves); ``None``: they round to nearest.
    """

    def __init__(
        self,
        root: nn.Module,
        bits: BitTable,
        stats: SavedStats,
        *,
        group_size: int,
        min_numel: int,
        eager_pack: Callable[[torch.Tensor, int], object],
        eager_unpack: Callable[[object], torch.Tensor],
        draw_seed: Callable[[], int] | None = None,
    ):
        self.root = root
        self.bits = bits
        self.stats = stats
        self.counts = CompiledCounts()
        self.kept: dict[str, int] = {}  # bytes saved as they are in the last forward, per kind
        self.group_size = group_size
        self.min_numel = min_numel
        self.eager_pack = eager_pack
        self.eager_unpack = eager_unpack
        self._traced_version: int | None = None  # the bits the last traced graph holds
        # Kept for the life of the patch: torch.compile guards on the hooks' ids, which must not
        # be reused by new objects while a graph compiled with the old ones may run.
        self._pairs: dict[tuple, tuple[torch.fx.GraphModule, torch.fx.GraphModule]] = {}
        self._unpack = _one_call(self._unpack_one, "saved")
        self._seeds = None if draw_seed is None else add_seed_source(draw_seed)
        self._closed = False
        _SavedFilter.open()

    def close(self) -> None:
        """Put AOTAutograd's filter back and drop the seed source (once; graphs compiled before
        still run, rounding with seed 0)."""
        if not self._closed:
            self._closed = True
            _SavedFilter.close()
            if self._seeds is not None:
                remove_seed_source(self._seeds)

    def pair(self, fqn: str) -> tuple[Any, Any]:
        """The (pack, unpack) hooks of scope ``fqn`` at the bit table's current state."""
        bits = self.bits.bits_of(fqn)
        key = (fqn, bits, self.bits.version)
        pair = self._pairs.get(key)
        if pair is None:

            def pack(t: torch.Tensor) -> object:
                context = _traced_context()
                if context is None:
                    return self.eager_pack(t, bits)
                node = context["_node"]
                saved, kept = self._pack_traced(t, node, context["_fw_graph"], fqn)
                original, stored = nbytes(t), nbytes(saved)
                if t.numel() >= self.min_numel and None not in (original, stored):
                    self.counts.traced(node.name, original, stored, kept)  # as eager counts
                return saved

            pair = self._pairs[key] = (_one_call(pack, "t"), self._unpack)
        return pair

    def forward_done(self, outputs: Any) -> None:
        """The outermost scope closed on ``outputs``: add what the compiled graphs that ran in
        this forward saved to the stats (per graph, times its calls), and note the kinds they
        saved as they are (:attr:`kept`)."""
        if not self.counts:
            return
        runs = self.counts.runs(outputs)
        compiled = dict(self.stats.compiled)  # a new dict: a snapshot may hold the old one
        for graph, (original, stored) in self.counts.bytes(runs).items():
            before = compiled.get(graph, (0, 0))
            compiled[graph] = (before[0] + original, before[1] + stored)
        self.stats.compiled = compiled
        self.kept = self.counts.kept(runs)

    def kept_text(self) -> str:
        """What the graphs saved as it is in the last forward, per kind, for the log."""
        if not self.kept:
            return "nothing else saved as it is"
        return "saved as they are: " + ", ".join(
            f"{KEPT[kind]} ({n / 2**20:.2f} MiB)"
            for kind, n in sorted(self.kept.items(), key=lambda kv: -kv[1])
        )

    def _unpack_one(self, saved: object) -> torch.Tensor:
        tag = saved[0] if isinstance(saved, tuple) else None
        if tag == CODED:
            coded = Coded(*saved[1:])
            out = decode(coded)
            if coded.stride is None:
                return out
            return torch.empty_strided(
                coded.shape, coded.stride, dtype=out.dtype, device=out.device
            ).copy_(out)
        if tag == HALVED:
            return saved[1].to(saved[2])
        return self.eager_unpack(saved)

    def _note_version(self) -> None:
        version = self.bits.version
        if self._traced_version not in (None, version):
            log.info(
                "memopt: bits changed since the last compiled graph was traced: torch.compile "
                "recompiles each compiled graph at its next call (its recompile_limit, %d, "
                "bounds how often; past it the graph runs eagerly)",
                torch._dynamo.config.recompile_limit,
            )
        self._traced_version = version

    def _scope_of(self, node: torch.fx.Node, default: str) -> str:
        """The innermost scope among the modules that produced ``node``; ``default`` (the scope
        active when the graph was compiled) when none of them has one."""
        stack = node.meta.get("nn_module_stack") or {}
        scopes = self.bits.scopes
        ids = {str(id(m)): f for f, m in self.root.named_modules() if f in scopes}
        for key in reversed(list(stack)):
            if key in ids:
                return ids[key]
        return default

    def _pack_traced(
        self, t: torch.Tensor, node: torch.fx.Node, graph: torch.fx.Graph, default: str
    ) -> tuple[object, str | None]:
        """What the graph saves for ``t`` (node ``node``), and why it is ``t`` itself when it
        is (a :data:`.graph_count.KEPT` kind; ``None`` for the configured bits)."""
        if t.numel() < max(self.min_numel, 1):
            return t, "small"
        if not t.is_floating_point():
            return t, "integer"
        fqn = self._scope_of(node, default)
        bits = self.bits.scopes.get(fqn, OFF_BITS)
        if bits >= OFF_BITS:
            return t, None
        if _views_an_input(node, graph):
            return t, "input view"
        self._note_version()
        if bits == HALF_BITS:
            return (t if t.element_size() <= 2 else (HALVED, t.to(torch.bfloat16), t.dtype)), None
        if t.is_contiguous():
            # Its memory as one flat run: inductor indexes that directly, where a reshape of
            # ``t`` into groups that straddle its dims gave index expressions (divisions and
            # remainders) it could not simplify, and gathers element by element.
            flat, stride = t.as_strided((t.numel(),), (1,), t.storage_offset()), None
        elif memory_order(t) is not None:
            # A transposed or permuted dense tensor: grouped in its index order, as in eager
            # (:meth:`.hooks.CompressionHooks._compress`), and decoded back to its strides.
            flat, stride = t.reshape(-1), t.stride()
        else:
            return t, "gapped"
        codes, scale, zero_point = encode(flat, bits, self.group_size, seed_source=self._seeds)
        coded = Coded(
            codes, scale, zero_point, bits, self.group_size, t.numel(), t.dtype,
            tuple(t.shape), stride,
        )  # fmt: skip
        return coded.saved(), None
