"""Module selection: fqn globs, class names, and the layer kind of a module."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

from torch import nn

from .config import ConfigError, closest

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


def fqn_matches(fqn: str, globs: Iterable[str]) -> bool:
    """True when the fully qualified module name matches one of the shell-style globs."""
    return any(fnmatch.fnmatchcase(fqn, g) for g in globs)


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


def check_globs(key: str, globs: Sequence[str], names: Sequence[str]) -> None:
    """Raise ConfigError for any glob that matches none of ``names`` (module fqns of the model)."""
    for glob in globs:
        if not any(fnmatch.fnmatchcase(n, glob) for n in names):
            raise ConfigError(_no_match_message(key, glob, names, "module"))


def check_types(key: str, type_names: Sequence[str], model: nn.Module) -> None:
    """Raise ConfigError for a class name that no module of the model has."""
    present = sorted({type(m).__name__ for m in model.modules()})
    for name in type_names:
        if name not in present:
            raise ConfigError(_no_match_message(key, name, present, "module class"))


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
    suggestion = closest(given, names)
    hint = f" Did you mean {', '.join(repr(s) for s in suggestion)}?" if suggestion else ""
    return (
        f"{key}: {given!r} matches no {what} of the model.{hint} "
        f"Some {what} names: {', '.join(shown)}{', ...' if len(names) > len(shown) else ''}"
    )
