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
the codec in PyTorch operations that inductor compiles into the graph, at that module's bits:
the codes, bfloat16 scale and zero point of :mod:`.reference`, at round-to-nearest (below 8
bits packed in planes, see :func:`_pack_planes`), in the same bytes compiled as eager. The
groups' minima and maxima, codes and packing are fused into the kernels around them; the
parameters between them are one opaque operator (``memopt::graph_params``) where the C kernels
serve the tensor (:func:`.ops.native_params`): inlined, their few dozen operations went into every
kernel that saves a tensor, and compiling took four times as long. Elsewhere (CUDA, float64,
``MEMOPT_CODEC=torch``, no C compiler) they stay inlined: the operator would run them as a few
dozen small tensor operations, eagerly, at every call.

Inside a graph, compared with eager:

* rounding is to nearest (noise drawn inside a compiled graph would come from the global RNG);
* a group the eager codec keeps exactly (NaN/Inf, a range the bfloat16 scale cannot express)
  decodes to NaN, and a constant group to its value rounded up to a bfloat16 step;
* only what the graph computes itself is compressed (AOTAutograd's ``donated`` filter): the
  parameters never, and neither the inputs of the graph it saves (with one compiled graph per
  block, each block's input);
* the bytes held (``SavedStats.held_bytes``) do not see what the graph packs; what it saves
  is counted from the sizes it was traced with (``SavedStats.compiled``, per compiled frame).

The bits are read when a graph is compiled; a change of bits gives every scope new hook objects,
so ``torch.compile``'s guard on the hooks recompiles the graphs at their next call.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from ..config import HALF_BITS, OFF_BITS
from .bits import BitTable

if TYPE_CHECKING:
    from .hooks import SavedStats
from .ops import graph_params_op, native_params
from .reference import FIRST_LEVEL, graph_params, work_dtype

log = logging.getLogger("memopt")

_GRAPH_COMPILE = "torch._functorch._aot_autograd.graph_compile"


def _traced_context() -> dict[str, Any] | None:
    """AOTAutograd's context of the saved tensor being traced (private; ``None`` outside a
    trace). Not imported here: a process that never compiles never loads the compiler."""
    module = sys.modules.get(_GRAPH_COMPILE)
    context = getattr(module, "_get_saved_tensor_hook_context", None)
    return None if context is None else context()


class _Coded(NamedTuple):
    """A quantized tensor inside a compiled graph: three tensors and constants.

    The graph saves it as a plain tuple (:meth:`saved`): an ``fx`` graph would build a
    NamedTuple with a call of its own, which AOTAutograd cannot place among the saved values.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    bits: int
    group_size: int
    numel: int
    dtype: torch.dtype
    shape: tuple
    stride: tuple | None  # the saved tensor's strides, when it was not contiguous

    def saved(self) -> tuple:
        return (_CODED, *self)


_CODED, _HALVED = "memopt-coded", "memopt-bfloat16"


def _one_call(fn: Callable[[Any], Any], name: str) -> torch.fx.GraphModule:
    """A GraphModule whose forward is ``fn(arg)``."""
    graph = torch.fx.Graph()
    graph.output(graph.call_function(fn, (graph.placeholder(name),)))
    return torch.fx.GraphModule(nn.Module(), graph)


def encode(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, ...]:
    """Codes, scale and zero point of contiguous ``x`` at round-to-nearest, in traceable ops.

    The scale and zero point of :func:`.reference.quantize` with ``seed=None``, and its codes,
    for every group it encodes; the groups it keeps exactly get scale 0 and the top code as zero
    point (decoded as NaN, whatever their codes), and a constant group its value rounded up to
    one first level of a bfloat16 step. Below 8 bits a group's codes are packed by
    :func:`_pack_planes`, not in the reference's order.

    Written for inductor's vectorizer: the codes depend on the group only through the stored
    scale and zero point (once per group), rounding picks the sign with ``where`` and the codes
    go to ``uint8`` in one conversion.
    """
    top, first = 2**bits - 1, FIRST_LEVEL[bits]
    work = work_dtype(x.dtype)
    flat = x.reshape(-1)
    pad = -flat.numel() % group_size
    if pad:  # the last element repeated, as Groups.of pads
        flat = torch.cat((flat, flat[-1:].expand(pad)))
    groups = flat.view(-1, group_size).to(work)
    params = graph_params_op if native_params(x.device, x.dtype) else graph_params
    scale, zero_point = params(groups.amin(1), groups.amax(1), bits, x.dtype)
    # The reference's inverse is 1 / step for every group it encodes; a step of 0 (a lost or an
    # all-zero group) gives NaN or +-inf here, which the comparisons send to the zero point or
    # the clamp's ends, and whose codes decode to NaN (lost) or 0 (step 0) regardless.
    scaled = groups * (1 / scale.to(work))[:, None]
    zp = zero_point.to(work)[:, None]
    away = (scaled.abs() - first).clamp_min(0).add(0.5).floor().add(1)
    codes = torch.where(scaled > 0, zp + away, torch.where(scaled < 0, zp - away, zp))
    codes = codes.clamp(0, top).to(torch.uint8)
    if bits < 8:
        codes = _pack_planes(codes, bits)
    return codes.view(-1), scale, zero_point


def _pack_planes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Each group's ``(n_groups, group_size)`` codes in ``group_size * bits / 8`` bytes: byte
    ``j`` holds codes ``j, j + m, j + 2m, ...`` (``m``: bytes per group), lowest bits first.

    Planes of a group, not neighbours (the reference's order): every lane is read and written
    contiguously, so inductor vectorizes packing and unpacking (neighbour lanes made it fall
    back to scalar loops, ten times slower).
    """
    per_byte = 8 // bits
    planes = codes.view(codes.shape[0], per_byte, -1)
    packed = planes[:, 0]
    for lane in range(1, per_byte):
        packed = packed | (planes[:, lane] << lane * bits)
    return packed


def _unpack_planes(packed: torch.Tensor, bits: int, n_groups: int) -> torch.Tensor:
    """The ``(n_groups, group_size)`` codes :func:`_pack_planes` packed."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.uint8)[:, None] * bits
    planes = (packed.view(n_groups, 1, -1) >> shifts) & (2**bits - 1)
    return planes.view(n_groups, -1)


def decode(c: _Coded) -> torch.Tensor:
    """The tensor :func:`encode` coded, of its shape (contiguous) and dtype, in traceable ops."""
    top, pull = 2**c.bits - 1, 1 - FIRST_LEVEL[c.bits]
    work = work_dtype(c.dtype)
    n_groups = c.scale.numel()
    if c.bits < 8:
        codes = _unpack_planes(c.codes, c.bits, n_groups)
    else:
        codes = c.codes.view(n_groups, c.group_size)
    offset = codes.to(work) - c.zero_point.to(work)[:, None]
    levels = (offset - torch.sign(offset) * pull) * c.scale.to(work)[:, None]
    lost = (c.scale == 0) & (c.zero_point == top)
    levels = torch.where(lost[:, None], float("nan"), levels)
    return levels.reshape(-1)[: c.numel].to(c.dtype).view(c.shape)


def memory_order(t: torch.Tensor) -> list[int] | None:
    """``t``'s dims from outermost to innermost in memory, when its elements are dense in that
    order (``t.permute(order)`` is contiguous: a transposed or permuted dense tensor); else
    ``None``."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return order if t.permute(order).is_contiguous() else None


class GraphHooks:
    """The GraphModule hook pairs of the compression scopes, one per (scope, bits, table state).

    Args:
        root: the patched model (its modules' ids name them in compiled graphs).
        bits: the bit table, read when a graph is traced.
        stats: the hooks' byte counts, told per compiled frame what its graph saves.
        group_size, min_numel: codec settings.
        eager_pack, eager_unpack: the eager hooks, ``eager_pack(t, bits)``.
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
    ):
        self.root = root
        self.bits = bits
        self.stats = stats
        # Per compiled frame: its compile id, the graphs traced then (kept, so that their ids
        # stay theirs) and the counts of their saved nodes.
        self._frames: dict[object, tuple[object, list, dict[tuple, tuple[int, int]]]] = {}
        self.group_size = group_size
        self.min_numel = min_numel
        self.eager_pack = eager_pack
        self.eager_unpack = eager_unpack
        self._traced_version: int | None = None  # the bits the last traced graph holds
        # Kept for the life of the patch: torch.compile guards on the hooks' ids, which must not
        # be reused by new objects while a graph compiled with the old ones may run.
        self._pairs: dict[tuple, tuple[torch.fx.GraphModule, torch.fx.GraphModule]] = {}
        self._unpack = _one_call(self._unpack_one, "saved")

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
                saved = self._pack_traced(t, context["_node"], fqn)
                if t.numel() >= self.min_numel:  # what the eager hooks count, too
                    self._count(t, saved, context)
                return saved

            pair = self._pairs[key] = (_one_call(pack, "t"), self._unpack)
        return pair

    def _unpack_one(self, saved: object) -> torch.Tensor:
        tag = saved[0] if isinstance(saved, tuple) else None
        if tag == _CODED:
            coded = _Coded(*saved[1:])
            out = decode(coded)
            if coded.stride is None:
                return out
            return torch.empty_strided(
                coded.shape, coded.stride, dtype=out.dtype, device=out.device
            ).copy_(out)
        if tag == _HALVED:
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

    def _count(self, t: torch.Tensor, saved: object, context: dict[str, Any]) -> None:
        """Note the bytes a compiled graph saves for ``t`` in the stats, under its frame."""
        compile_id = torch._guards.CompileContext.current_compile_id()
        stored = saved if isinstance(saved, tuple) else (saved,)
        stored = [x.numel() * x.element_size() for x in stored if isinstance(x, torch.Tensor)]
        original = t.numel() * t.element_size()
        if compile_id is None or not all(isinstance(n, int) for n in (original, *stored)):
            return  # symbolic sizes (a dynamic-shape graph): not counted
        frame = compile_id.frame_id
        known, graphs, nodes = self._frames.get(frame, (None, [], {}))
        if known != compile_id:  # the frame recompiled: its new graphs replace the old ones
            graphs, nodes = [], {}
            self._frames[frame] = (compile_id, graphs, nodes)
        graph = context["_fw_graph"]
        if not any(g is graph for g in graphs):
            graphs.append(graph)
        nodes[id(graph), context["_node"].name] = (original, sum(stored))
        counts = nodes.values()
        self.stats.compiled[frame] = (sum(o for o, _ in counts), sum(s for _, s in counts))

    def _pack_traced(self, t: torch.Tensor, node: torch.fx.Node, default: str) -> object:
        if not t.is_floating_point() or t.numel() < max(self.min_numel, 1):
            return t
        fqn = self._scope_of(node, default)
        bits = self.bits.scopes.get(fqn, OFF_BITS)
        if bits >= OFF_BITS:
            return t
        self._note_version()
        if bits == HALF_BITS:
            return t if t.element_size() <= 2 else (_HALVED, t.to(torch.bfloat16), t.dtype)
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
            return t  # not dense (a slice with gaps): kept as it is
        codes, scale, zero_point = encode(flat, bits, self.group_size)
        return _Coded(
            codes, scale, zero_point, bits, self.group_size, t.numel(), t.dtype,
            tuple(t.shape), stride,
        ).saved()  # fmt: skip
