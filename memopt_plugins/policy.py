"""The compression policy: which modules get which bits, and which saved tensors are kept as they
are. The one place these rules are spelled: the hooks (eager and compiled), the step recorder, the
drift passes and the planner's estimate all ask here.

Kept as it is (:func:`kept_as_is`): a parameter or buffer or a view of one (a compressed copy would
keep the weight and feed backward a compressed weight), or one a DTensor redistributes
(:func:`redistributed_parameter`); what the codec cannot take (:func:`encodable`: subclasses,
non-strided layouts, meta, nested, quantized; the hooks code a DTensor's local shard); fewer than
``quantize.min_numel`` elements; a broadcast view; autocast's cached cast copy of a parameter. A
weight the forward computes from parameters alone (:func:`computed_weight`; a frozen weight's
cast copy, with no autograd history, too) is kept at full width, and counted as saved (the
step's memory). Of the rest, floating tensors are what the bits act on (:func:`compressible`);
the hooks narrow integer tensors losslessly and keep bool and complex ones. Compiled graphs have
reasons of their own (:func:`kept_in_graph`). This module imports nothing of memopt's but the
config and module selection, so both compression and measurement can ask it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Container, Iterable
from typing import Protocol

import torch
from torch import nn

from .config import OFF_BITS, QuantizeConfig
from .select import check_globs, fqn_matches, parent_fqns

#: Why a compiled graph saves a tensor as it is, for the log and docs/compile.md.
KEPT = {
    "small": "tensors under quantize.min_numel",
    "integer": "integer tensors (eager narrows them losslessly)",
    "input view": "views of the graph's inputs (they may alias parameters)",
    "masking": "masks of -inf or near-overflow values (the in-graph codec cannot keep them)",
}


def resolve_bits(model: nn.Module, quantize: QuantizeConfig) -> dict[str, int]:
    """Bits of every module of ``model`` that needs a compression scope (innermost scope decides).

    A module excluded by ``quantize.exclude`` (or inside one) is never compressed; otherwise the
    nearest ``overrides`` glob on the module or an ancestor wins, then the default ``bits`` when
    the module or an ancestor is in ``quantize.modules``. A scope at 32 bits is installed only
    where it shields a module from a compressing ancestor. Bits loaded from a checkpoint are laid
    on top by the engine's bit table.

    Raises:
        ConfigError: a glob of ``quantize`` matches no module (with ``quantize.optional``
            it is logged and skipped instead).
    """
    q = quantize
    names = [fqn for fqn, _ in model.named_modules()]
    for key, globs in (
        ("quantize.modules", q.modules),
        ("quantize.exclude", q.exclude),
        ("quantize.overrides", list(q.overrides)),
    ):
        check_globs(key, globs, names, q.optional)

    def override_of(fqn: str) -> int | None:
        for glob, bits in reversed(list(q.overrides.items())):
            if fqn_matches(fqn, [glob]):
                return bits
        return None

    scoped: dict[str, int] = {}
    # fqn -> (effective bits, set by an override?) for modules under some rule
    effective: dict[str, tuple[int, bool]] = {}
    for fqn in names:
        parents = parent_fqns(fqn)
        inherited = effective.get(parents[0]) if parents else None
        compressing_parent = inherited is not None and inherited[0] < OFF_BITS
        if fqn_matches(fqn, q.exclude):
            if compressing_parent:
                scoped[fqn] = OFF_BITS  # shield the subtree from a compressing ancestor
            effective[fqn] = (OFF_BITS, True)  # nothing below may compress again
            continue
        override = override_of(fqn)
        if override is not None:
            mine = (override, True)
        elif inherited is not None and inherited[1]:
            effective[fqn] = inherited  # inside an override or exclusion: its scope decides
            continue
        elif fqn_matches(fqn, q.modules):
            mine = (q.bits, False)
        else:
            if inherited is not None:
                effective[fqn] = inherited
            continue
        effective[fqn] = mine
        if mine[0] < OFF_BITS or compressing_parent:
            scoped[fqn] = mine[0]
    return scoped


def encodable(t: torch.Tensor) -> bool:
    """Whether the codec can take ``t`` at all: dense memory of its own (strided layout, not
    meta, nested or quantized) and no ``__torch_dispatch__`` subclass (a DTensor's
    ``data_ptr()`` is its wrapper's, not its data's: the hooks code its local shard instead).
    Anything else is kept as it is."""
    return (
        type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__
        and t.layout is torch.strided
        and not (t.is_meta or t.is_nested or t.is_quantized)
    )


def kept_as_is(
    t: torch.Tensor, min_numel: int = 0, model: Iterable[Container[object]] = ()
) -> bool:
    """Whether compression keeps saved tensor ``t`` as it is, whatever its scope's bits.

    ``model``: the model's memory, ``t in memory`` for each: the storages of its parameters and
    buffers (:class:`~memopt_plugins.measure.ModelStorages`) and of the parameters a sharded
    model's modules hold while they run (:class:`~.measure.storage.RunningParameters`). A
    DTensor is judged by its local shard, as the hooks code it.
    """
    if _is_dtensor(t):
        if redistributed_parameter(t):
            return True
        t = t._local_tensor
    if not encodable(t):
        return True  # a subclass, another layout, meta: nothing the codec can take
    if t.numel() < min_numel:
        return True  # small
    for memory in model:  # a parameter, a buffer, or a view of one (a loop: it runs per save)
        if t in memory:
            return True
    if t.untyped_storage().nbytes() < t.numel() * t.element_size():
        return True  # a broadcast (expanded) view: smaller as it is than any copy
    return is_autocast_copy(t)


def is_autocast_copy(t: torch.Tensor) -> bool:
    """Whether ``t`` is autocast's cast copy of a parameter, or a view of one (``nn.Linear``
    saves ``weight_bf16.t()``): cached and shared, so compressing it saves nothing and feeds
    backward a compressed weight. Found through the view's base, else through its chain of view
    nodes back to a ``ToCopyBackward0`` of a leaf."""
    base = t._base if t._is_view() and t._base is not None else t
    node = base.grad_fn if base.grad_fn is not None else t.grad_fn
    while node is not None and node.name() in _VIEW_NODES:
        node = node.next_functions[0][0]
    if node is None or node.name() != "ToCopyBackward0":
        return False
    source = node.next_functions[0][0]
    return source is not None and type(source).__name__ == "AccumulateGrad"


def _is_dtensor(t: torch.Tensor) -> bool:
    module = sys.modules.get("torch.distributed.tensor")  # nothing is a DTensor before its import
    return module is not None and isinstance(t, module.DTensor)


def redistributed_parameter(t: torch.Tensor) -> bool:
    """Whether DTensor ``t`` is a parameter redistributed for this op (all-gathered or resharded
    by tensor parallelism: fresh memory, yet the weight), or a view of one: found through its
    chain of view and ``Redistribute`` nodes back to a leaf. Compressed, it would feed backward a
    compressed weight."""
    node, redistributed = t.grad_fn, False
    while node is not None and (node.name() in _VIEW_NODES or node.name() == _REDISTRIBUTE):
        redistributed |= node.name() == _REDISTRIBUTE
        node = node.next_functions[0][0]
    return redistributed and node is not None and type(node).__name__ == "AccumulateGrad"


#: The autograd node of ``DTensor.redistribute``.
_REDISTRIBUTE = "RedistributeBackward"

#: Autograd nodes of view operations: what autocast's copy of a weight is seen through.
_VIEW_NODES = frozenset(
    {
        "TBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ReshapeAliasBackward0",
        "ExpandBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "UnsqueezeBackward0",
        "SliceBackward0",
        "SelectBackward0",
        "AsStridedBackward0",
        "AliasBackward0",
    }
)


def computed_weight(
    t: torch.Tensor,
    parameters: Iterable[Container[object]] = (),
    computed: Container[object] = (),
) -> bool:
    """Whether saved tensor ``t`` is a weight its forward computed from parameters alone, kept
    as it is like the parameters it is made of (a compressed copy would feed backward a
    compressed weight, as a compressed parameter would).

    ``computed``: the weights the model's parametrizations and hook-style norms made, and casts
    of its parameters made outside autograd
    (:class:`~memopt_plugins.measure.storage.ComputedWeights`). Else ``t``'s autograd history
    decides (``W = f(params)`` fed to ``F.linear``): every path from ``t.grad_fn`` ends, within
    a few nodes, at the gradient accumulator of a tensor in ``parameters``, through the
    operations of :data:`_WEIGHT_MATH` (data read by index -- an embedding's rows -- is not
    among them), where only the elementwise ones may take inputs that need no gradient (a
    constant, a buffer, a mask); and ``t`` is no larger than the largest of those parameters,
    so keeping it costs no more than one. ``x @ W`` on a batch ``x`` needing no gradient is
    data: its matmul takes an input with no gradient.
    """
    if t in computed:
        return True
    node = t.grad_fn
    if node is None:
        return False
    largest, pending, budget = 0, [node], _WEIGHT_NODES
    while pending:
        node = pending.pop()
        budget -= 1
        if budget < 0:
            return False
        if type(node) is _ACCUMULATE:
            leaf = node.variable
            if not any(leaf in memory for memory in parameters):
                return False  # an input that needs a gradient: data
            largest = max(largest, leaf.numel())
            continue
        elementwise = _WEIGHT_MATH.get(node.name())
        if elementwise is None:
            return False
        for following, _ in node.next_functions:
            if following is not None:
                pending.append(following)
            elif not elementwise:
                return False
    return t.numel() <= largest


#: The autograd node of a leaf: where a parameter's gradient goes.
_ACCUMULATE = torch._C._functions.AccumulateGrad

#: How many autograd nodes :func:`computed_weight` reads at most before it calls ``t`` data.
_WEIGHT_NODES = 12

#: The operations :func:`computed_weight` follows back to parameters, each with whether it is
#: elementwise (its inputs that need no gradient are constants, buffers or masks, no larger
#: than its output) or not (an input with no gradient may be a batch, as ``x @ W``'s).
_WEIGHT_MATH = {
    **dict.fromkeys(
        (
            "AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "RsubBackward0",
            "RsubBackward1", "MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1",
            "DivBackward2", "DivBackward3", "NegBackward0", "PowBackward0", "PowBackward1",
            "PowBackward2", "ExpBackward0", "LogBackward0", "SqrtBackward0", "RsqrtBackward0",
            "ReciprocalBackward0", "TanhBackward0", "SigmoidBackward0", "AbsBackward0",
            "ClampBackward0", "ClampBackward1", "ClampMinBackward0", "ClampMaxBackward0",
            "SoftplusBackward0", "MaximumBackward0", "MinimumBackward0", "WhereBackward0",
            "MaskedFillBackward0", "ToCopyBackward0",
        ),
        True,
    ),
    **dict.fromkeys(
        (
            *_VIEW_NODES, "CloneBackward0", "CatBackward0", "StackBackward0", "TrilBackward0",
            "TriuBackward0", "SumBackward0", "SumBackward1", "MeanBackward0", "MeanBackward1",
            "VarBackward0", "StdBackward0",
            "NormBackward0", "NormBackward1", "LinalgVectorNormBackward0", "MmBackward0",
            "MvBackward0", "DotBackward0", "VdotBackward0", "BmmBackward0", "AddmmBackward0",
            "LinalgMatrixExpBackward0", "LinalgHouseholderProductBackward0",
            "LinalgQrBackward0", "WeightNormInterfaceBackward0",
        ),
        False,
    ),
}  # fmt: skip


#: The modules whose saved-tensor hooks give a region a meaning of its own: torch's checkpoint
#: and DeepSpeed's non-reentrant one (a forward region keeps only its inputs, its recomputation
#: hands what it saves to the checkpoint) and ``save_on_cpu`` (offloads). Another pair pushed
#: inside such a region would be the innermost one and take the region's tensors from it.
REGION_OWNERS = frozenset(
    {
        "torch.utils.checkpoint",
        "torch.autograd.graph",
        "deepspeed.runtime.activation_checkpointing.checkpointing",
    }
)


def in_foreign_region() -> bool:
    """Whether memopt must not push saved-tensor hooks here (nor compress what is saved here).

    True inside a region another owner's hooks hold (:data:`REGION_OWNERS`: a checkpoint
    region memopt did not make, its recomputation, ``save_on_cpu``), inside a backward pass
    (a reentrant checkpoint replays its region there, unhooked, and hands what it saves straight
    to a nested backward) and inside a ``torch.func`` transform (``grad``, ``vjp``, ... refuse
    saved-tensor hooks: the model runs there as without memopt), and where the user disabled
    saved-tensor hooks (``torch.autograd.graph.disable_saved_tensors_hooks``, which raises at a
    push). What such a region keeps -- a checkpoint's inputs, saved before its hooks are pushed
    -- still meets the hooks around it, memopt's included.
    """
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():
        return True
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is not None and getattr(top[0], "__module__", None) in REGION_OWNERS:
        return True
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return True
    return torch._C._current_graph_task_id() != -1


def mask_candidate(t: torch.Tensor) -> bool:
    """Whether saved floating ``t`` is tried as a mask, kept exactly as a bit an element where it
    is one (:func:`~memopt_plugins.compress.codec.encode_mask` decides): it has no autograd
    history, data the forward made beside the activations (dropout's mask on the CPU)."""
    return t.grad_fn is None and not t.requires_grad


def compressible(
    t: torch.Tensor, min_numel: int = 0, model: Iterable[Container[object]] = ()
) -> bool:
    """Whether a scope's bits act on saved tensor ``t``: floating, and not kept as it is."""
    return t.is_floating_point() and not kept_as_is(t, min_numel, model)


def min_numel_at(shape: torch.Size, min_numel: int, sample: tuple[int, int] | None) -> int:
    """The ``min_numel`` a saved tensor of ``shape`` is held to when it was saved on a ``sample`` =
    ``(samples, batch)``: that many samples cut from a training batch of ``batch`` (the drift
    check's). A tensor with the samples along dim 0 (a multiple of them: a row per sample or per
    token) is ``batch / samples`` times as large in training, so it is kept as it is only where
    its training-size counterpart is: the check compresses what training does."""
    if sample is None or not shape or shape[0] % sample[0]:
        return min_numel
    samples, batch = sample
    return -(-min_numel * samples // batch)


class MeasuredStorage(Protocol):
    """What :func:`compresses_storage` reads of a storage measured without compression
    (:class:`~memopt_plugins.measure.SavedStorage`)."""

    owner: str | None
    numel: int
    compressible: bool


def compresses_storage(s: MeasuredStorage, min_numel: int) -> bool:
    """Whether compression would touch a storage a forward without it saved: :func:`compressible`
    when it was saved, of at least ``min_numel`` elements, and saved inside the model (a loss
    computed outside it is not)."""
    return s.compressible and s.owner is not None and s.numel >= min_numel


def views_an_input(node: torch.fx.Node, graph: torch.fx.Graph) -> bool:
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


def kept_in_graph(
    t: torch.Tensor, node: torch.fx.Node, graph: torch.fx.Graph, min_numel: int
) -> str | None:
    """Why a compiled graph saves ``t`` (traced as ``node`` of ``graph``) as it is, whatever the
    bits: a :data:`KEPT` kind, or ``None``. The graph's parameters and buffers never reach the
    hooks (AOTAutograd's filter, :class:`~memopt_plugins.compress.compiled.SavedFilter`); views of
    its inputs may alias them. Besides these, the traced codec decodes as NaN a group eager would
    keep exactly, on the side: masks of ``-inf`` or ``finfo.min`` (``"masking"``,
    :func:`holds_masking_constant`). Bool tensors the graph computes (dropout's masks) go in as
    bits."""
    if t.numel() < max(min_numel, 1):
        return "small"
    if not t.is_floating_point() and t.dtype != torch.bool:
        return "integer"
    if views_an_input(node, graph):
        return "input view"
    if t.dtype == torch.bool:
        return None
    if holds_masking_constant(node, t.dtype):
        return "masking"
    return None


#: Operations whose output may hold a value of their tensor inputs unchanged: selections, views,
#: copies, concatenation and the arithmetic that carries -inf through (a mask added to scores).
_PASS_THROUGH = frozenset(
    {
        "where", "masked_fill", "add", "sub", "rsub", "mul", "neg", "maximum", "minimum",
        "expand", "view", "reshape", "_unsafe_view", "permute", "transpose", "t", "unsqueeze",
        "squeeze", "slice", "select", "alias", "as_strided", "index", "gather", "repeat", "cat",
        "stack", "clone", "contiguous", "copy", "convert_element_type", "_to_copy",
    }
)  # fmt: skip


def masking_constant(value: object, dtype: torch.dtype) -> bool:
    """Whether ``value`` is a number no group of a ``dtype`` tensor holding it can be coded in a
    compiled graph: infinite, NaN, or beyond half of ``dtype``'s largest value (``finfo.min``,
    ``-1e38``: the range of a group holding it and 0 overflows the codec's scale). The eager codec
    keeps such groups exactly, on the side; the in-graph one decodes them as NaN."""
    if not isinstance(value, float):  # integers are sizes, dims and indices
        return False
    return not math.isfinite(value) or abs(value) > torch.finfo(dtype).max / 2


def holds_masking_constant(node: torch.fx.Node, dtype: torch.dtype) -> bool:
    """Whether traced tensor ``node`` may hold a :func:`masking_constant` (an attention mask of
    ``-inf`` or ``finfo.min``, however the graph builds it): one is an argument of ``node``, or of
    a node whose values reach ``node`` through :data:`_PASS_THROUGH` operations."""
    seen: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        leaves = torch.utils._pytree.tree_leaves((current.args, current.kwargs))
        if any(masking_constant(v, dtype) for v in leaves):
            return True
        if _op_name(current) in _PASS_THROUGH:
            stack.extend(v for v in leaves if isinstance(v, torch.fx.Node))
    return False


def _op_name(node: torch.fx.Node) -> str | None:
    """The name of the operation ``node`` calls without its overload (``"where"`` for
    ``aten.where.self``), or ``None`` for placeholders and other non-call nodes."""
    if node.op != "call_function":
        return None
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet if packet is not None else node.target, "__name__", None)
