"""The ``ops`` section: swap a model's chains and loss head for the memory-lean operations.

:class:`LeanOps` applies what the config turns on, only where the swap is exact; what it cannot
do as asked is a :class:`~memopt_plugins.config.ConfigError` before anything is patched (a
``loss: chunked`` that a preset wrote, or that ``cross_entropy: lean`` stands in for, on a model
whose head it cannot reach is left out in one logged line instead):

* ``fuse``: chains patched by what they are (GELU, gated MLPs, RMSNorm, a Hugging Face model's
  eager attention as SDPA, a CNN's batch norms, convolutions, ReLUs and max-pools: :mod:`.conv`),
  each run beside its own forward and backward on a probe and a twin with random parameters;
* ``loss: chunked``: a Hugging Face causal LM's loss through :func:`~.loss.linear_cross_entropy`;
* ``cross_entropy: lean``: ``F.cross_entropy`` inside the model, routed (:mod:`.entropy`);
* ``no_cache``: a Hugging Face model's ``use_cache`` off while any of these acts.

:meth:`LeanOps.remove` undoes it all. The rules in full: docs/lean-ops.md.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, OpsConfig
from ..patching import InstanceForward
from ..routing import ModelRouting, RoutingMode
from .chains import (
    batch_norm,
    gated_mlp,
    geglu,
    gelu,
    gelu_mlp,
    layer_norm,
    rms_norm,
    swiglu,
    tiled_gated_mlp,
    tiled_gelu_mlp,
)
from .conv import conv, max_pool, relu
from .entropy import CrossEntropyMode
from .loss import linear_cross_entropy
from .tiled import tiled

log = logging.getLogger("memopt")

_TANH_GELU = {"NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh"}
_EXACT_GELU = {"GELUActivation"}
_SILU = {"SiLU", "SiLUActivation"}
#: Config attributes of attention dropout (GPT-2, Llama and most decoders, BERT).
_ATTENTION_DROPOUT = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob")
#: Config attributes of causal LMs whose logits are scaled in ways the chunked loss does not do.
_SCALED_LOGITS = ("logit_scale", "logits_scaling", "output_multiplier_scale")


class _LeanForward(InstanceForward):
    """A ``forward`` instance attribute set by :class:`LeanOps`."""

    def __init__(self, module: nn.Module, forward: Callable[..., Any], action: str):
        self.module = module
        self.previous = module.__dict__.get("forward")
        self.original = module.forward
        self.forward = forward
        self.action = action
        try:  # what inspects the forward (the Trainer's unused-column filter) sees the module's own
            self.__signature__ = inspect.signature(self.original)
        except (TypeError, ValueError):
            pass
        module.forward = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def restore(self) -> None:
        slots = self.module.__dict__
        if slots.get("forward") is not self:
            log.warning("memopt: a forward patched by ops was replaced since; left as is")
        elif self.previous is None:
            del slots["forward"]
        else:
            slots["forward"] = self.previous


def _gelu_kind(module: nn.Module) -> str | None:
    """``"tanh"`` / ``"none"``: the approximation of a GELU module, else ``None``."""
    if isinstance(module, nn.GELU):
        return module.approximate
    name = type(module).__name__
    if name in _TANH_GELU:
        return "tanh"
    return "none" if name in _EXACT_GELU else None


def _gated_mlp(module: nn.Module) -> str | None:
    """``swiglu`` / ``geglu`` for a Llama-style gated MLP, else ``None``."""
    parts = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    act = getattr(module, "act_fn", None)
    if not all(isinstance(p, nn.Linear) for p in parts) or act is None:
        return None
    if type(act).__name__ in _SILU:
        return "swiglu"
    return "geglu" if _gelu_kind(act) == "tanh" else None


#: What a GPT-2-style MLP names its activation: transformers' GPT-2, karpathy's nanoGPT.
_PLAIN_MLP_ACTIVATIONS = ("act", "gelu")


def _plain_mlp(module: nn.Module) -> nn.Module | None:
    """The activation of a GPT-2-style MLP (``c_fc``, an activation, ``c_proj`` and an
    ``nn.Dropout`` after them), else ``None``."""
    act = next((getattr(module, n) for n in _PLAIN_MLP_ACTIVATIONS if hasattr(module, n)), None)
    parts = [getattr(module, n, None) for n in ("c_fc", "c_proj")] + [act]
    dropout = getattr(module, "dropout", None)
    plain = all(isinstance(p, nn.Module) for p in parts) and isinstance(dropout, nn.Dropout)
    return act if plain else None


def _mlp_forward(module: nn.Module) -> Callable[..., Any] | None:
    """An MLP block's forward over chunks of tokens (:func:`~.tiled.tiled`); a gated MLP's
    product is the lean one."""
    m: Any = module
    gated = _gated_mlp(module)
    if gated is not None:
        product = swiglu if gated == "swiglu" else geglu
        projections = [_linear_of(p) for p in (m.gate_proj, m.up_proj, m.down_proj)]
        bias_free = all(p is not None for p in projections) and all(
            p.bias is None for p in (m.gate_proj, m.up_proj, m.down_proj)
        )

        def gated_forward(x: torch.Tensor) -> torch.Tensor:
            # bias-free, eager: one node saving x alone (the norm's output before it, a recipe
            # over the norm's compressed input); compiled (autocast off): one operator each way
            # over every chunk, as for the GELU MLP below, so the graph saves the block's input,
            # never a chunk's gate and up projections
            tanh_gelu = gated == "geglu"
            if bias_free and not torch.compiler.is_compiling():
                w_gate, w_up, w_down = (p()[0] for p in projections)
                return gated_mlp(x, w_gate, w_up, w_down, tanh_gelu)
            if bias_free and not torch.is_autocast_enabled(x.device.type):
                w_gate, w_up, w_down = (p()[0] for p in projections)
                return tiled_gated_mlp(x, w_gate, w_up, w_down, tanh_gelu, x.shape[-1])
            return tiled(x, lambda t: m.down_proj(product(m.gate_proj(t), m.up_proj(t))))

        return gated_forward
    act = _plain_mlp(module)
    if act is None:
        return None
    approximate, up, down = _gelu_kind(act), _linear_of(m.c_fc), _linear_of(m.c_proj)
    if approximate is not None and up is not None and down is not None:
        # eager: one node per chunk saving the chunk only (gelu_mlp); compiled: one operator
        # each way over every chunk, or under autocast, whose casts the operator would not see,
        # the modules' own chain. gelu_mlp is never traced: its saves go through the eager
        # hooks, which must not run inside a graph.
        def block(t: torch.Tensor) -> torch.Tensor:
            if torch.compiler.is_compiling():
                return m.c_proj(act(m.c_fc(t)))
            return gelu_mlp(t, *up(), *down(), approximate)

        def forward(x: torch.Tensor) -> torch.Tensor:
            if torch.compiler.is_compiling() and not torch.is_autocast_enabled(x.device.type):
                (w_in, b_in), (w_out, b_out) = up(), down()
                y = tiled_gelu_mlp(x, w_in, b_in, w_out, b_out, approximate, x.shape[-1])
                return m.dropout(y)
            return m.dropout(tiled(x, block))

        return forward
    return lambda x: m.dropout(tiled(x, lambda t: m.c_proj(act(m.c_fc(t)))))


def _linear_of(module: nn.Module) -> Callable[[], tuple[torch.Tensor, Any]] | None:
    """For an ``nn.Linear`` or transformers' ``Conv1D`` (GPT-2's, its weight transposed) that
    runs its class's own forward: a function giving its ``F.linear`` weight and bias, read at
    each call (a sharded model swaps its parameters in and out)."""
    m: Any = module
    if "forward" in m.__dict__:  # patched by someone: its own forward is not what runs
        return None
    if _plain(module, (nn.Linear,)):
        return lambda: (m.weight, m.bias)
    if type(module).__name__ == "Conv1D" and isinstance(getattr(m, "nf", None), int):
        return lambda: (m.weight.t(), m.bias)
    return None


def _lean_forward(chain: str, module: nn.Module) -> Callable[..., Any] | None:
    """The lean ``forward`` of ``module`` for ``chain``, or ``None`` when it is not one."""
    approximate = _gelu_kind(module) if chain == "gelu" else None
    if approximate is not None:
        return lambda x: gelu(x, approximate)
    if chain == "mlp":
        return _mlp_forward(module)
    if chain in ("swiglu", "geglu") and _gated_mlp(module) == chain:
        product = swiglu if chain == "swiglu" else geglu
        m: Any = module
        return lambda x: m.down_proj(product(m.gate_proj(x), m.up_proj(x)))
    if chain == "batchnorm" and _plain_batch_norm(module):
        return _BatchNormForward(module)
    if chain in _CNN_OPS:
        return _CNN_OPS[chain](module)
    if chain == "rmsnorm" and type(module).__name__.endswith("RMSNorm"):
        weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
        if isinstance(weight, torch.Tensor) and isinstance(eps, float):
            return lambda x: rms_norm(x, module.weight, module.variance_epsilon)
    return None


def _plain_batch_norm(module: nn.Module) -> bool:
    """A ``BatchNorm1d/2d/3d`` (not ``SyncBatchNorm``, whose statistics span processes)."""
    return _plain(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d))


class _BatchNormForward:
    """``nn.BatchNorm*d.forward`` with :func:`~.chains.batch_norm` where it normalizes with batch
    statistics (training, or no running statistics), the module's own forward elsewhere."""

    def __init__(self, module: nn.modules.batchnorm._BatchNorm):
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.module
        batch_stats = bn.training or (bn.running_mean is None and bn.running_var is None)
        if not batch_stats or not torch.is_grad_enabled():
            return type(bn).forward(bn, x)
        bn._check_input_dim(x)
        momentum = 0.0 if bn.momentum is None else bn.momentum
        if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
            bn.num_batches_tracked.add_(1)
            if bn.momentum is None:
                momentum = 1.0 / float(bn.num_batches_tracked)
        keep = not bn.training or bn.track_running_stats
        mean, var = (bn.running_mean, bn.running_var) if keep else (None, None)
        return batch_norm(x, bn.weight, bn.bias, mean, var, momentum, bn.eps)


def _plain(module: nn.Module, kinds: tuple[type[nn.Module], ...]) -> bool:
    """``module`` is one of ``kinds`` and runs that class's own ``forward``."""
    return isinstance(module, kinds) and type(module).forward in {k.forward for k in kinds}


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)


def _conv_forward(module: nn.Module) -> Callable[..., Any] | None:
    """A zero-padded ``nn.Conv1d/2d/3d`` as :func:`~.conv.conv` (batched inputs)."""
    if not _plain(module, _CONVS) or module.padding_mode != "zeros":
        return None
    m: Any = module
    if m.padding == "valid":
        padding: Any = (0,) * len(m.kernel_size)
    elif isinstance(m.padding, str):  # "same": torch pads unevenly where it must
        return None
    else:
        padding = m.padding
    batched = len(m.kernel_size) + 2

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != batched:
            return type(m).forward(m, x)
        return conv(x, m.weight, m.bias, m.stride, padding, m.dilation, m.groups)

    return forward


def _relu_forward(module: nn.Module) -> Callable[..., Any] | None:
    if not _plain(module, (nn.ReLU,)):
        return None
    inplace = module.inplace
    return lambda x: relu(x, inplace)


def _max_pool_forward(module: nn.Module) -> Callable[..., Any] | None:
    """An ``nn.MaxPool1d/2d/3d`` as :func:`~.conv.max_pool` (batched inputs)."""
    if not _plain(module, _POOLS):
        return None
    m: Any = module
    batched = _POOLS.index(type(m)) + 3

    def forward(x: torch.Tensor) -> Any:
        if x.dim() != batched:
            return type(m).forward(m, x)
        return max_pool(
            x, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode, m.return_indices
        )

    return forward


_CNN_OPS: dict[str, Callable[[nn.Module], Callable[..., Any] | None]] = {
    "conv": _conv_forward,
    "relu": _relu_forward,
    "maxpool": _max_pool_forward,
}


def _probe_shape(module: nn.Module) -> tuple[int, ...]:
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        spatial = {nn.BatchNorm1d: 1, nn.BatchNorm3d: 3}.get(type(module), 2)
        return (3, module.num_features, *[5] * spatial)
    if isinstance(module, _CONVS + _POOLS):
        m: Any = module
        dims = len(m.weight.shape) - 2 if isinstance(module, _CONVS) else _POOLS.index(type(m)) + 1
        kernel = _pair(m.kernel_size, dims)
        dilation = _pair(m.dilation, dims)
        size = [max(7, d * (k - 1) + 3) for k, d in zip(kernel, dilation, strict=True)]
        return (3, m.in_channels if isinstance(module, _CONVS) else 4, *size)
    return (3, 5, _width(module))


def _pair(value: Any, dims: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, tuple | list) else (value,) * dims


def _width(module: nn.Module) -> int:
    first = getattr(module, "gate_proj", None) or getattr(module, "c_fc", None)
    if isinstance(first, nn.Linear):
        return first.in_features
    if isinstance(getattr(first, "nx", None), int):  # transformers' Conv1D (GPT-2's)
        return first.nx
    weight = getattr(module, "weight", None)
    return weight.shape[-1] if isinstance(weight, torch.Tensor) else 64


def _exact(module: nn.Module, chain: str) -> bool:
    """The lean op of ``chain`` is the module's own: on a twin of the module with random
    parameters (not the user's: an output projection initialised to zero would hide whatever
    precedes it), its forward's outputs and buffer updates, and its backward's input and
    parameter gradients, equal the module's own, in float32 (or float64) at least; a module in
    a lower precision is also compared forward in its own. A module on the meta device (to be
    materialized later, after sharding) is probed on the CPU. Randomness is left as it was."""
    first = next(module.parameters(), None)
    dtype = first.dtype if first is not None else torch.float32
    work = torch.promote_types(dtype, torch.float32)
    if not _agree(module, chain, work, backward=True):
        return False
    return work == dtype or _agree(module, chain, dtype, backward=False)


def _agree(module: nn.Module, chain: str, dtype: torch.dtype, backward: bool) -> bool:
    """:func:`_exact` in ``dtype``: outputs, buffers and (``backward``) gradients."""
    twin = _twin(module, dtype)
    forward = _lean_forward(chain, twin)
    if forward is None:
        return False
    params = list(twin.parameters())
    device = params[0].device if params else torch.device("cpu")
    generator = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(*_probe_shape(twin), generator=generator).to(device, dtype)
    buffers = {n: b.clone() for n, b in twin.named_buffers()}  # batch norm's running statistics
    twin.train()  # the lean ops act in training, where gradients are on
    runs = []
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices), torch.enable_grad():
        for run in (forward, twin):
            torch.manual_seed(0)  # both forwards draw the same dropout masks
            for name, b in twin.named_buffers():
                b.copy_(buffers[name])
            x = probe.clone().requires_grad_(backward)
            out = _first(run(x.clone()))  # a clone: an in-place ReLU writes
            grads: list[torch.Tensor | None] = []
            if backward:
                draw = torch.Generator().manual_seed(1)  # the same upstream gradient twice
                upstream = torch.randn(out.shape, generator=draw).to(out)
                wanted = [x, *params]
                grads = list(torch.autograd.grad(out, wanted, upstream, allow_unused=True))
            runs.append((out.detach(), [b.clone() for b in twin.buffers()], grads))
    tolerance = 1e-5 if dtype in (torch.float32, torch.float64) else 1e-2
    (out, buffers_after, grads), (ref, ref_buffers, ref_grads) = runs
    same_buffers = all(torch.equal(a, b) for a, b in zip(buffers_after, ref_buffers, strict=True))
    return (
        same_buffers
        and _close(out, ref, tolerance)
        and all(_close(a, b, tolerance) for a, b in zip(grads, ref_grads, strict=True))
    )


def _close(a: torch.Tensor | None, b: torch.Tensor | None, tolerance: float) -> bool:
    """Equal shapes and values within ``tolerance`` of ``b``'s largest magnitude (a gradient
    that is ``None`` is zeros)."""
    if a is None or b is None:
        other = b if a is None else a
        return other is None or not bool(other.any())
    scale = max(1.0, float(b.abs().max()) if b.numel() else 0.0)
    return a.shape == b.shape and bool(((a - b).abs() <= tolerance * scale).all())


def _twin(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``module`` in ``dtype`` with random parameters (matrices normal, vectors in
    [0.5, 1.5): norms' weights stay meaningful), drawn without the global generator, and its
    buffers; a meta-device module's on the CPU, its buffers made up (floats in [0.5, 1.5),
    integers zero). The user's parameters are never copied."""
    meta = any(t.is_meta for t in (*module.parameters(), *module.buffers()))
    first = next(module.parameters(), None)
    device = torch.device("cpu") if meta or first is None else first.device
    generator = torch.Generator(device).manual_seed(0)  # drawn where the parameters live
    memo: dict[int, Any] = {}
    for p in module.parameters():
        draw = {"generator": generator, "device": device, "dtype": dtype}
        if p.dim() > 1:
            values = torch.randn(p.shape, **draw)
        else:
            values = torch.rand(p.shape, **draw) + 0.5
        memo[id(p)] = nn.Parameter(values)
    if meta:
        for b in module.buffers():
            if b.is_floating_point():
                memo[id(b)] = (torch.rand(b.shape, generator=generator) + 0.5).to(dtype)
            else:
                memo[id(b)] = torch.zeros(b.shape, dtype=b.dtype)
    return copy.deepcopy(module, memo).to(dtype=dtype)


def _refuse_probes_on_partitioned(model: nn.Module, fuse: list[str]) -> None:
    """Refuse fused chains on a model whose parameters DeepSpeed ZeRO-3 has partitioned.

    The exactness probe runs a copy of each module (:func:`_twin`), which carries ZeRO-3's
    hooks but not its partitioned parameters' bookkeeping: it fails inside DeepSpeed, or runs on
    the empty tensors a released parameter holds. Attention swaps no module and is not probed.
    """
    probed = [c for c in fuse if c != "attention"]
    if not probed or not partitioned_by_zero3(model):
        return
    raise ConfigError(
        f"ops.fuse {probed}: the model's parameters are already partitioned by DeepSpeed ZeRO-3 "
        "(deepspeed.initialize, accelerator.prepare, a Lightning DeepSpeedStrategy or "
        "deepspeed.zero.Init ran first), and memopt cannot probe fused modules on them. Apply "
        "memopt before DeepSpeed wraps the model (MemOptPlugin.apply before prepare; the "
        "Trainer callback does), or keep ops.fuse to [attention] (ops.loss and "
        "ops.cross_entropy work either way)"
    )


def partitioned_by_zero3(model: nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 manages ``model``'s parameters (it numbers each: ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _first(out: Any) -> torch.Tensor:
    """A module's output tensor (a max-pool returning indices gives a pair)."""
    return out[0] if isinstance(out, tuple) else out


class LeanOps:
    """Applies the ``ops`` section to a model; :meth:`remove` undoes it.

    Args:
        config: the ``ops`` section. With ``ops.optional``, what it names that the model lacks
            (a loss head it can reach, a chain named in ``fuse``) is skipped with an INFO line
            instead of a ConfigError.
    """

    def __init__(self, config: OpsConfig):
        self.config = config
        self.actions: dict[str, str] = {}  # fqn -> "lean swiglu", "lean loss", ...
        self._patched: list[_LeanForward] = []
        self._attention: list[tuple[nn.Module, str]] = []  # (model, its own implementation)
        self._routing: ModelRouting | None = None
        self._norms: ModelRouting | None = None  # F.layer_norm routed to the lean one
        self._caches: list[Any] = []  # Hugging Face configs whose use_cache was turned off

    @property
    def active(self) -> bool:
        c = self.config
        return c.loss != "none" or c.cross_entropy != "none" or bool(c.fuse)

    def apply(self, model: nn.Module) -> dict[str, str]:
        """Patch ``model``; returns ``{fqn: action}`` for every patched module."""
        _refuse_probes_on_partitioned(model, self.config.fuse)
        heads = self._loss_heads(model) if self.config.loss == "chunked" else []
        try:
            every = "all" in self.config.fuse
            # in _WHAT's order: mlp takes a gated MLP before swiglu / geglu would
            chains = [c for c in _WHAT if every or c in self.config.fuse]
            for chain in chains:
                if chain == "layernorm":
                    self._route_layer_norm(model, required=not every)
                elif chain == "attention":
                    for fqn, lm in _outermost(model, _switches_attention):
                        self._attend(lm, fqn, required=not every)
                else:
                    self._fuse(model, chain, required=not every)
            for fqn, lm in heads:
                self._chunk_loss(lm, fqn)
            if self.config.cross_entropy == "lean":
                self._route_cross_entropy(model)
            if self.active and self.config.no_cache:
                self._turn_off_cache(model)
        except BaseException:
            self.remove()
            raise
        return dict(self.actions)

    def remove(self) -> None:
        for routing in (self._routing, self._norms):
            if routing is not None:
                routing.remove()
        self._routing = self._norms = None
        for config in self._caches:
            if config.use_cache is False:  # a value set since is the user's
                config.use_cache = True
        self._caches.clear()
        for patched in reversed(self._patched):
            patched.restore()
        self._patched.clear()
        for model, implementation in reversed(self._attention):
            model.set_attn_implementation(implementation)
        self._attention.clear()
        self.actions.clear()

    def _route_cross_entropy(self, model: nn.Module) -> None:
        chunk = self.config.chunk_size
        self._routing = ModelRouting(lambda: CrossEntropyMode(chunk))
        self._routing.apply(model)
        log.info(
            "memopt: ops.cross_entropy lean: F.cross_entropy inside %s runs lean in training",
            type(model).__name__,
        )

    def _route_layer_norm(self, model: nn.Module, required: bool) -> None:
        norms = [fqn for fqn, m in model.named_modules() if _is_layer_norm(m)]
        if not norms:
            if required:
                self._not_here(
                    f"ops.fuse: 'layernorm' matches no module of {type(model).__name__} "
                    f"({_WHAT['layernorm']})"
                )
            return
        self._norms = ModelRouting(lambda: RoutingMode({F.layer_norm: _lean_layer_norm}))
        self._norms.apply(model)
        for fqn in norms:
            self.actions.setdefault(fqn, "lean layernorm")

    def _turn_off_cache(self, model: nn.Module) -> None:
        """``use_cache`` False on every Hugging Face config of ``model`` that has it True."""
        seen: set[int] = set()
        for module in model.modules():
            config = getattr(module, "config", None)
            if id(config) in seen or getattr(config, "use_cache", None) is not True:
                continue
            seen.add(id(config))
            config.use_cache = False
            self._caches.append(config)
        if self._caches:
            log.info(
                "memopt: ops: use_cache off while applied (%s): training builds no KV cache, "
                "as with transformers' gradient checkpointing; remove() turns it back on "
                "(ops.no_cache: false leaves it)",
                type(model).__name__,
            )

    def _attend(self, model: nn.Module, prefix: str, required: bool) -> None:
        config = getattr(model, "config", None)
        current = getattr(config, "_attn_implementation", None)
        dropout = max((getattr(config, n, 0.0) or 0.0 for n in _ATTENTION_DROPOUT), default=0.0)
        why = None
        if not _switches_attention(model):
            why = "it is not a Hugging Face model (no set_attn_implementation)"
        elif current != "eager":
            why = f"its attention is {current!r}, not eager"
        elif not (getattr(model, "_supports_sdpa", False) and model._can_set_attn_implementation()):
            why = "it cannot switch to SDPA attention"
        elif dropout > 0:
            why = f"its attention dropout is {dropout} (SDPA would draw its own masks)"
        if why is not None:
            if required and not self.config.optional:
                name = type(model).__name__
                raise ConfigError(f"ops.fuse: 'attention' cannot act on {name}: {why}")
            log.info("memopt: ops.fuse attention left %s as it is: %s", type(model).__name__, why)
            return
        model.set_attn_implementation("sdpa")
        self._attention.append((model, current))
        for fqn, module in model.named_modules(prefix=prefix):
            if type(module).__name__.endswith("Attention") and fqn not in self.actions:
                self.actions[fqn] = "lean attention"

    def _fuse(self, model: nn.Module, chain: str, required: bool) -> None:
        found, inexact = [], []
        for fqn, module in model.named_modules():
            forward = _lean_forward(chain, module)
            if forward is None:
                continue
            if fqn in self.actions:  # a tiled gated MLP runs the lean product too
                if self.actions[fqn] == "lean mlp":
                    found.append(fqn)
                continue
            if not _exact(module, chain):
                inexact.append(fqn)
                continue
            self._patched.append(_LeanForward(module, forward, f"lean {chain}"))
            self.actions[fqn] = f"lean {chain}"
            found.append(fqn)
        if inexact:
            log.warning(
                "memopt: ops.fuse %s left %d module(s) as they are: on random parameters their "
                "outputs or gradients differ from the lean op's (%s)",
                chain,
                len(inexact),
                ", ".join(inexact[:3]) + (", ..." if len(inexact) > 3 else ""),
            )
        if required and not found and not inexact:
            self._not_here(
                f"ops.fuse: {chain!r} matches no module of {type(model).__name__} "
                f"({_WHAT[chain]}); allowed here: "
                + (", ".join(c for c in _WHAT if _any(model, c)) or "none of them")
            )

    def _not_here(self, message: str) -> None:
        """What ``ops`` names is not in the model: a ConfigError, or with ``ops.optional`` one
        INFO line (the rest of the section still applies)."""
        if not self.config.optional:
            raise ConfigError(message)
        log.info("memopt: %s: skipped (ops.optional is true)", message)

    def _loss_heads(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The causal LMs (outermost) whose loss ``loss: chunked`` computes; where there is none,
        a ConfigError, or with ``ops.optional`` one logged line and ``[]``."""
        found = _outermost(model, _has_head)
        whys = [(type(lm).__name__, _unreachable(lm)) for _, lm in found]
        failed = [(name, why) for name, why in whys if why is not None]
        if not failed:
            return found
        name, why = failed[0]
        if self.config.cross_entropy == "lean":
            log.info(
                "memopt: ops.loss chunked left the loss of %s as it is: %s; ops.cross_entropy "
                "lean routes the F.cross_entropy it calls instead",
                name,
                why,
            )
            return [(f, lm) for (f, lm), (_, w) in zip(found, whys, strict=True) if w is None]
        if not self.config.optional:
            raise ConfigError(
                f"ops.loss: chunked cannot act on {name}: {why}. It computes the loss of a "
                "Hugging Face causal LM whose lm_head is fed by its base model; for a head of "
                "your own call memopt_plugins.lean.linear_cross_entropy in your loss, or set "
                "ops.loss: none."
            )
        log.info(
            "memopt: ops.loss chunked left the loss of %s as it is: %s (ops.optional is true; "
            "for a head of your own, call memopt_plugins.lean.linear_cross_entropy in your loss)",
            name,
            why,
        )
        return [(fqn, lm) for (fqn, lm), (_, why) in zip(found, whys, strict=True) if why is None]

    def _chunk_loss(self, model: nn.Module, fqn: str) -> None:
        head: Any = model.lm_head
        base = getattr(model, model.base_model_prefix)
        config = getattr(model, "config", None)
        softcap = getattr(config, "final_logit_softcapping", None)
        original = model.forward

        def chunked(
            outputs: Any, names: frozenset[str], args: tuple, kwargs: dict[str, Any]
        ) -> Any:
            """The model's training output (class ``outputs``, fields ``names`` besides the loss
            and logits) with the chunked loss (``logits`` None)."""
            kwargs = dict(kwargs)
            labels = kwargs.pop("labels")
            items = kwargs.pop("num_items_in_batch", None)
            shifted = kwargs.pop("shift_labels", None)
            kwargs.pop("logits_to_keep", None)
            kwargs["return_dict"] = True
            out = base(*args, **kwargs)
            hidden = out.last_hidden_state
            if shifted is None:
                shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
            loss = linear_cross_entropy(
                hidden,
                head.weight,
                shifted.to(hidden.device),
                head.bias,
                softcap=softcap,
                chunk_size=self.config.chunk_size,
                num_items_in_batch=items,
            )
            return outputs(loss=loss, logits=None, **{k: v for k, v in out.items() if k in names})

        plain = sys.modules["transformers"].modeling_outputs.CausalLMOutputWithPast
        outputs, why = _own_loss_only(model, original, chunked, plain)
        if why is not None:
            log.warning(
                "memopt: ops.loss chunked left the loss of %s (%s) as it is: %s",
                type(model).__name__,
                fqn or "the model",
                why,
            )
            return
        log.info(
            "memopt: ops.loss chunked: %s computes its training loss in chunks of tokens; its "
            "output's logits are None in training (eval mode and generation run the model's own "
            "forward)",
            type(model).__name__,
        )

        names = _other_fields(outputs)  # read here: a compiled forward traces no dataclass walk

        def forward(*args: Any, **kwargs: Any) -> Any:
            labels = kwargs.get("labels")
            own = labels is None or not model.training or not torch.is_grad_enabled()
            if own or len(args) > 1 or any(kwargs.get(k) for k in _LOSS_TERMS):
                return original(*args, **kwargs)
            return chunked(outputs, names, args, kwargs)

        self._patched.append(_LeanForward(model, forward, "lean loss"))
        self.actions[fqn] = "lean loss"


def _other_fields(outputs: type) -> frozenset[str]:
    """The fields of a model output class besides its loss and logits."""
    return frozenset(f.name for f in dataclasses.fields(outputs)) - {"loss", "logits"}


#: Arguments of a causal LM's forward that add terms to its loss (an MoE's router loss): with
#: one of them on, the model's own forward runs.
_LOSS_TERMS = ("output_router_logits",)
#: Tokens of the batch on which the chunked loss is checked against the model's own.
_PROBE_TOKENS = 8


def _own_loss_only(
    model: nn.Module, original: Callable[..., Any], chunked: Callable[..., Any], plain: type
) -> tuple[type, str | None]:
    """The output class of ``model``'s forward, and why the chunked loss would change what that
    forward returns (``None``: it would not). Both run once on a probe batch in training mode,
    with the randomness and buffers as they were after: the model's own output must hold nothing
    the chunked one drops (an MoE's ``aux_loss``), its loss must be the cross-entropy of its own
    logits (no term of its forward added), and the chunked loss must equal that. A model on the
    meta device cannot run: its config is read instead."""
    config = getattr(model, "config", None)
    on = [k for k in _LOSS_TERMS if getattr(config, k, None)]
    if on:
        return plain, f"its config's {on[0]} adds terms to the loss that the chunked loss drops"
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return plain, None
    head: Any = model.lm_head
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(head.out_features, (1, _PROBE_TOKENS), generator=generator)
    ids = ids.to(head.weight.device)
    modes = {m: m.training for m in model.modules()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    devices = [head.weight.device.index or 0] if head.weight.device.type == "cuda" else []
    try:
        model.train()
        with torch.no_grad(), torch.random.fork_rng(devices):
            torch.manual_seed(0)
            own = original(input_ids=ids, labels=ids, return_dict=True)
            outputs = type(own) if dataclasses.is_dataclass(own) else plain
            torch.manual_seed(0)
            mine = chunked(outputs, _other_fields(outputs), (), {"input_ids": ids, "labels": ids})
    except Exception as error:  # a forward that needs more than ids and labels
        return plain, f"its forward failed on a probe batch ({type(error).__name__}: {error})"
    finally:
        for m, training in modes.items():
            m.training = training
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
    if not isinstance(own, dict) or own.get("loss") is None or own.get("logits") is None:
        return plain, "its forward returned no loss and logits for labels on a probe batch"
    dropped = [k for k, v in own.items() if v is not None and k != "logits" and mine.get(k) is None]
    if dropped:
        return outputs, f"its output holds {', '.join(dropped)}, which the chunked loss drops"
    logits = own.logits.float()
    target = F.pad(ids, (0, 1), value=-100)[..., 1:]
    reference = F.cross_entropy(logits.view(-1, logits.shape[-1]), target.reshape(-1))
    if not torch.allclose(own.loss.float(), reference, rtol=1e-5, atol=1e-6):
        return outputs, (
            f"its loss ({float(own.loss):.6g}) is not the cross-entropy of its logits "
            f"({float(reference):.6g}): its forward adds a term the chunked loss would drop"
        )
    tolerance = 1e-4 if head.weight.dtype in (torch.float32, torch.float64) else 2e-2
    if not torch.allclose(mine.loss.float(), reference, rtol=tolerance, atol=tolerance):
        return outputs, (
            f"the chunked loss ({float(mine.loss):.6g}) differs from its own "
            f"({float(reference):.6g})"
        )
    return outputs, None


_WHAT = {
    "mlp": "MLP blocks: gated (gate_proj, up_proj, down_proj, act_fn) or GPT-2's (c_fc, act or "
    "gelu, c_proj, dropout)",
    "gelu": "GELU modules: nn.GELU, transformers' GELUActivation and NewGELUActivation",
    "swiglu": "gated MLPs with gate_proj, up_proj, down_proj and a SiLU act_fn",
    "geglu": "gated MLPs with gate_proj, up_proj, down_proj and a tanh-GELU act_fn",
    "rmsnorm": "Llama-style RMSNorm modules with weight and variance_epsilon",
    "layernorm": "nn.LayerNorm modules, or modules of a model's own named LayerNorm",
    "attention": "Hugging Face models built with eager attention",
    "batchnorm": "BatchNorm1d/2d/3d modules (not SyncBatchNorm)",
    "conv": "Conv1d/2d/3d modules with zero padding (not padding='same')",
    "relu": "nn.ReLU modules",
    "maxpool": "MaxPool1d/2d/3d modules",
}


def _is_layer_norm(module: nn.Module) -> bool:
    """An ``nn.LayerNorm``, or a module of its own named so (karpathy's nanoGPT's)."""
    return isinstance(module, nn.LayerNorm) or type(module).__name__ == "LayerNorm"


def _lean_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """``F.layer_norm`` as :func:`~.chains.layer_norm` where it trains (eagerly)."""
    tensors = [t for t in (input, weight, bias) if t is not None]
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        if any(t.requires_grad for t in tensors):
            return layer_norm(input, tuple(normalized_shape), weight, bias, eps)
    return F.layer_norm(input, normalized_shape, weight, bias, eps)


def _unreachable(model: nn.Module) -> str | None:
    """Why ``loss: chunked`` cannot compute the loss of ``model``, or ``None`` when it can."""
    transformers = sys.modules.get("transformers")  # a Hugging Face model has imported it
    prefix = getattr(model, "base_model_prefix", None)
    base = getattr(model, prefix, None) if isinstance(prefix, str) else None
    config = getattr(model, "config", None)
    if not isinstance(getattr(model, "lm_head", None), nn.Linear):
        return "it has no lm_head (an nn.Linear output head over the vocabulary)"
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return (
            "it is not a Hugging Face PreTrainedModel, so its own forward computes the logits "
            "and the loss"
        )
    if not isinstance(base, nn.Module):
        return "it names no base model (base_model_prefix) whose hidden states feed lm_head"
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _SCALED_LOGITS):
        return "its logits are scaled before the loss"
    return None


def _switches_attention(module: nn.Module) -> bool:
    return callable(getattr(module, "set_attn_implementation", None))


def _has_head(module: nn.Module) -> bool:
    return isinstance(getattr(module, "lm_head", None), nn.Linear)


def _outermost(model: nn.Module, test: Callable[[nn.Module], bool]) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` that pass ``test`` and sit in none that does (a Hugging Face
    model inside a LightningModule); ``[("", model)]`` when there is none, so that the model
    itself is judged, and refused, by name."""
    found: list[tuple[str, nn.Module]] = []
    for fqn, module in model.named_modules():
        if test(module) and not any(fqn.startswith(f"{outer}.") or not outer for outer, _ in found):
            found.append((fqn, module))
    return found or [("", model)]


def _any(model: nn.Module, chain: str) -> bool:
    if chain == "layernorm":
        return any(_is_layer_norm(m) for m in model.modules())
    if chain == "attention":
        return any(
            getattr(getattr(m, "config", None), "_attn_implementation", None) == "eager"
            for _, m in _outermost(model, _switches_attention)
        )
    return any(_lean_forward(chain, m) is not None for m in model.modules())
