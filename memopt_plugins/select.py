"""Module selection: fqn globs, class names, and the layer kind of a module.

A glob names a module of the model the user wrote, wherever a framework wraps it: it is matched
against the module's name and against that name with leading wrapper attributes dropped
(:data:`WRAPPERS`), so ``lm_head`` matches Lightning's ``model.lm_head`` and PEFT's
``base_model.model.lm_head``. A glob that matches no module is a :class:`ConfigError`, unless
its section says ``optional: true`` (a config for many models): then it is skipped, logged.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable, Sequence

from torch import nn

from .config import ConfigError, closest

log = logging.getLogger("memopt")

#: Attributes frameworks hold the user's model under: a LightningModule's (and a Hugging Face
#: task model's) ``model``, DDP/FSDP's ``module``, torch.compile's ``_orig_mod`` and PEFT's
#: ``base_model.model``.
WRAPPERS = frozenset({"model", "module", "_orig_mod", "base_model"})

#: Layer kinds, from most to least expensive to recompute.
COMPUTE = "compute"  # Linear, Conv, attention, embedding: recompute costs a matmul
ACTIVATION = "activation"
NORM = "norm"
DROPOUT = "dropout"
CONTAINER = "container"  # no parameters of its own that do compute; holds children
OTHER = "other"

_ACTIVATIONS = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.Sigmoid,
    nn.Tanh,
    nn.Softplus,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Hardtanh,
    nn.Softmax,
    nn.Softmin,
    nn.Softmax2d,
    nn.LogSoftmax,
    nn.LogSigmoid,
    nn.GLU,
    nn.PReLU,
    nn.RReLU,
    nn.Softsign,
    nn.Tanhshrink,
    nn.Softshrink,
    nn.Hardshrink,
    nn.Threshold,
)
_NORMS = (
    nn.modules.batchnorm._BatchNorm,
    nn.LayerNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),  # torch >= 2.4
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LocalResponseNorm,
)
_DROPOUTS = (nn.modules.dropout._DropoutNd,)
_COMPUTE = (
    nn.Linear,
    nn.Bilinear,
    nn.modules.conv._ConvNd,
    nn.MultiheadAttention,
    nn.Embedding,
    nn.EmbeddingBag,
    nn.RNNBase,
)
# Name fragments of third-party classes (Hugging Face, timm) that are not subclasses of the above.
_NAME_HINTS = (
    ("RMSNorm", NORM),
    ("LayerNorm", NORM),
    ("Norm", NORM),
    ("Attention", COMPUTE),
    ("Conv1D", COMPUTE),  # GPT-2's transposed Linear
    ("Linear", COMPUTE),
    ("Activation", ACTIVATION),
    ("GELU", ACTIVATION),
    ("Act", ACTIVATION),
    ("Dropout", DROPOUT),
)


def layer_kind(module: nn.Module) -> str:
    """Classify a module as compute / activation / norm / dropout / container / other."""
    if isinstance(module, _COMPUTE):
        return COMPUTE
    if isinstance(module, _ACTIVATIONS):
        return ACTIVATION
    if isinstance(module, _NORMS):
        return NORM
    if isinstance(module, _DROPOUTS):
        return DROPOUT
    name = type(module).__name__
    for hint, kind in _NAME_HINTS:
        if hint in name:
            return kind
    if any(True for _ in module.children()):
        return CONTAINER
    return OTHER


def unwrapped_names(fqn: str) -> list[str]:
    """``fqn`` and the names it has with leading :data:`WRAPPERS` dropped, longest first:
    ``base_model.model.lm_head`` -> ``[base_model.model.lm_head, model.lm_head, lm_head]``."""
    parts = fqn.split(".")
    names = [fqn]
    for i, part in enumerate(parts[:-1]):
        if part not in WRAPPERS:
            break
        names.append(".".join(parts[i + 1 :]))
    return names


def fqn_matches(fqn: str, globs: Iterable[str]) -> bool:
    """True when the module name, or that name with leading wrappers dropped, matches one of the
    shell-style globs."""
    names = unwrapped_names(fqn)
    return any(fnmatch.fnmatchcase(n, g) for g in globs for n in names)


def parent_fqns(fqn: str) -> list[str]:
    """Ancestors of a module name, nearest first, ending with the root ``""``."""
    if not fqn:
        return []
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


def within(fqn: str, ancestor: str) -> bool:
    """True when module ``fqn`` lies strictly inside module ``ancestor`` (``""`` is the root)."""
    if fqn == ancestor:
        return False
    return ancestor == "" or fqn.startswith(ancestor + ".")


def outermost(fqns: Iterable[str]) -> list[str]:
    """The given module names without those inside another one of them (order kept)."""
    chosen = list(dict.fromkeys(fqns))
    present = set(chosen)
    return [f for f in chosen if not any(p in present for p in parent_fqns(f))]


def check_globs(
    key: str, globs: Sequence[str], names: Sequence[str], optional: bool = False
) -> None:
    """Raise ConfigError for a glob that matches none of ``names`` (module fqns of the model);
    where its section is ``optional``, log it and leave it to match nothing."""
    for glob in globs:
        if not any(fqn_matches(n, [glob]) for n in names):
            _no_match(key, glob, names, "module", optional)


def check_types(
    key: str, type_names: Sequence[str], model: nn.Module, optional: bool = False
) -> None:
    """Raise ConfigError for a class name that no module of the model has (``optional``: log)."""
    present = sorted({type(m).__name__ for m in model.modules()})
    for name in type_names:
        if name not in present:
            _no_match(key, name, present, "module class", optional)


def _no_match(key: str, given: str, names: Sequence[str], what: str, optional: bool) -> None:
    if not optional:
        raise ConfigError(_no_match_message(key, given, names, what))
    section = key.split(".")[0]
    log.info(
        "memopt: %s %r matches no %s of this model: skipped (%s.optional is true)",
        key,
        given,
        what,
        section,
    )


def select_modules(
    model: nn.Module, globs: Sequence[str] = (), type_names: Sequence[str] = ()
) -> list[str]:
    """Fqns (in ``named_modules`` order) of modules matching a glob or one of the class names."""
    types = set(type_names)
    return [
        fqn
        for fqn, module in model.named_modules()
        if fqn_matches(fqn, globs) or type(module).__name__ in types
    ]


def _no_match_message(key: str, given: str, names: Sequence[str], what: str) -> str:
    shown = [n for n in names if n][:8]
    suggestion = closest(given, list(dict.fromkeys(u for n in names for u in unwrapped_names(n))))
    hint = f" Did you mean {', '.join(repr(s) for s in suggestion)}?" if suggestion else ""
    return (
        f"{key}: {given!r} matches no {what} of the model.{hint} "
        f"Some {what} names: {', '.join(shown)}{', ...' if len(names) > len(shown) else ''}"
    )
