"""memopt's custom autograd functions never give a silently wrong second derivative: each one's
double backward passes ``gradgradcheck`` in float64, or raises torch's ``once_differentiable``
error."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch
from torch import nn

import memopt_plugins
from memopt_plugins.batchnorm_ops import _Link
from memopt_plugins.buffers import mark_private
from memopt_plugins.lean import batch_norm, gelu, rms_norm

_D = torch.float64


def _t(*shape, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, dtype=_D, requires_grad=grad)


def _seeded(apply):
    """``apply`` drawing the same randomness at every call (gradcheck calls it many times)."""

    def run(*inputs):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return apply(*inputs)

    return run


def _cases() -> dict[str, tuple]:
    """For each custom Function, by ``module.Class``: a function of float64 tensors and them."""
    target = torch.tensor([1, 4, -100, 0, 6])
    bn_stats = (torch.rand(3, dtype=_D), torch.rand(3, dtype=_D) + 0.5)
    conv_args = ((1, 1), (1, 1), (1, 1), 1)
    ce = "memopt_plugins.lean"
    return {
        f"{ce}.chains._Gelu": (lambda x: gelu(x, "tanh"), (_t(3, 4),)),
        f"{ce}.chains._GeluMlp": (
            lambda x, a, b, c, d: _fn(ce, "chains._GeluMlp").apply(x, a, b, c, d, "tanh"),
            (_t(2, 3, 4), _t(6, 4), _t(6), _t(4, 6), _t(4)),
        ),
        f"{ce}.chains._TiledGeluMlp": (
            lambda x, a, b, c, d: _fn(ce, "chains._TiledGeluMlp").apply(x, a, b, c, d, "none", 2),
            (_t(2, 3, 4), _t(6, 4), _t(6), _t(4, 6), _t(4)),
        ),
        f"{ce}.chains._TiledGatedMlp": (
            lambda x, a, b, c: _fn(ce, "chains._TiledGatedMlp").apply(x, a, b, c, False, 2),
            (_t(2, 3, 4), _t(6, 4), _t(6, 4), _t(4, 6)),
        ),
        f"{ce}.chains._GatedProduct": (
            lambda g, u: _fn(ce, "chains._GatedProduct").apply(g, u, False),
            (_t(3, 4), _t(3, 4)),
        ),
        f"{ce}.chains._LayerNorm": (
            lambda x, w, b: _fn(ce, "chains._LayerNorm").apply(x, (4,), w, b, 1e-5),
            (_t(3, 4), _t(4), _t(4)),
        ),
        f"{ce}.chains._RMSNorm": (lambda x, w: rms_norm(x, w, 1e-6), (_t(3, 4), _t(4))),
        f"{ce}.chains._BatchNorm": (
            lambda x, w, b: batch_norm(x, w, b, None, None, 0.1, 1e-5),
            (_t(4, 3, 5), _t(3), _t(3)),
        ),
        f"{ce}.conv._Conv": (
            lambda x, w, b: _fn(ce, "conv._Conv").apply(x, w, b, *conv_args),
            (_t(2, 2, 5, 5), _t(3, 2, 3, 3), _t(3)),
        ),
        f"{ce}.conv._ReLU": (lambda x: _fn(ce, "conv._ReLU").apply(x * 1, False), (_t(3, 4),)),
        f"{ce}.conv._MaxPool": (
            lambda x: _fn(ce, "conv._MaxPool").apply(x, 2, 2, 0, 1, False)[0],
            (_t(2, 2, 4, 4),),
        ),
        f"{ce}.entropy._CrossEntropy": (
            lambda z: _fn(ce, "entropy._CrossEntropy").apply(z, target, -100, 0.1, 2, 4),
            (_t(5, 7),),
        ),
        f"{ce}.loss._LinearCrossEntropy": (
            lambda h, w, b: _fn(ce, "loss._LinearCrossEntropy").apply(
                h, w, b, target, -100, 0.0, None, 2, None, None
            ),
            (_t(5, 4), _t(7, 4), _t(7)),
        ),
        f"{ce}.loss._LinearCrossEntropyGradientsFirst": (
            lambda h, w, b: _fn(ce, "loss._LinearCrossEntropyGradientsFirst").apply(
                h, w, b, target, -100, 0.0, None, 2, 4, None
            ),
            (_t(5, 4), _t(7, 4), _t(7)),
        ),
        "memopt_plugins.batchnorm_ops._FusedReLU": (
            lambda z: _fn("memopt_plugins", "batchnorm_ops._FusedReLU").apply(
                z * 1, _Link("probe", None), False
            ),
            (_t(3, 4),),
        ),
        "memopt_plugins.batchnorm_ops._RunningBatchNorm": (
            lambda x, w, b: _fn("memopt_plugins", "batchnorm_ops._RunningBatchNorm").apply(
                x, w, b, *bn_stats, 1e-5, None, None
            ),
            (_t(4, 3, 5), _t(3), _t(3)),
        ),
        "memopt_plugins.dropout._DropoutFunction": (
            _seeded(
                lambda x: _fn("memopt_plugins", "dropout._DropoutFunction").apply(
                    x, 0.3, False, True, False, False, False
                )
            ),
            (_t(3, 4),),
        ),
    }


def _fn(package: str, name: str) -> type[torch.autograd.Function]:
    module, cls = name.rsplit(".", 1)
    return getattr(importlib.import_module(f"{package}.{module}"), cls)


def _functions() -> set[str]:
    """Every ``torch.autograd.Function`` subclass defined in memopt_plugins' modules."""
    found = set()
    path, prefix = memopt_plugins.__path__, "memopt_plugins."
    for info in pkgutil.walk_packages(path, prefix):
        if info.name.startswith("memopt_plugins.callbacks"):
            continue  # the framework callbacks (Lightning, Accelerate) define no Function
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, torch.autograd.Function) and cls.__module__ == info.name:
                found.add(f"{info.name}.{cls.__name__}")
    return found


def test_every_custom_function_has_a_double_backward_case():
    assert _functions() == set(_cases())


def _decoded(private: bool):
    """Saved-tensor hooks that hand each node a fresh copy, marked private (as memopt's decoded
    tensors are: a lean backward may write its gradients into them) or not."""
    unpack = (lambda t: mark_private(t.clone())) if private else (lambda t: t.clone())
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), unpack)


@pytest.mark.parametrize("private", [False, True], ids=["saved", "decoded"])
@pytest.mark.parametrize("name", sorted(_cases()))
def test_double_backward_is_right_or_raises(name, private):
    torch.manual_seed(0)
    apply, plain = _cases()[name]

    def apply(*inputs, apply=apply):
        with _decoded(private):
            return apply(*inputs)

    inputs = plain
    try:
        passed = torch.autograd.gradgradcheck(apply, inputs, atol=1e-5, rtol=1e-4)
    except RuntimeError as error:
        if "once_differentiable" not in str(error):
            raise
        passed = False
    if passed:
        return
    # first order only: refused even where the incoming gradient is a constant (the op ends the
    # model) and the second backward asks for some inputs only
    out = apply(*inputs)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grads = torch.autograd.grad(out.sum(), inputs, create_graph=True, allow_unused=True)
        penalty = sum(g.square().sum() for g in grads if g is not None)
        torch.autograd.grad(penalty, inputs[-1:], allow_unused=True)


class _Lean(nn.Module):
    """A small model whose ops the test swaps for the lean ones."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(6, 6, dtype=_D)
        self.bn = nn.BatchNorm1d(6, dtype=_D)
        self.weight = nn.Parameter(torch.rand(6, dtype=_D) + 0.5)
        self.out = nn.Linear(6, 1, dtype=_D)

    def forward(self, x: torch.Tensor, lean: bool) -> torch.Tensor:
        h = self.inp(x)
        if self.kind == "batchnorm":
            h = (
                batch_norm(h, self.bn.weight, self.bn.bias, None, None, 0.1, 1e-5)
                if lean
                else (nn.functional.batch_norm(h, None, None, self.bn.weight, self.bn.bias, True))
            )
        elif self.kind == "rmsnorm":
            h = (
                rms_norm(h, self.weight, 1e-6)
                if lean
                else (self.weight * h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-6))
            )
        else:
            h = gelu(h) if lean else nn.functional.gelu(h)
        return self.out(h)


@pytest.mark.parametrize("kind", ["batchnorm", "rmsnorm", "gelu"])
def test_a_gradient_penalty_equals_torchs_through_lean_ops(kind):
    """An R1-style penalty (the input gradient's squared norm) through a lean BN / RMSNorm /
    GELU whose inputs come back decoded: the parameters' gradients equal plain torch's."""
    torch.manual_seed(0)
    model = _Lean(kind)
    x = torch.randn(8, 6, dtype=_D)

    def grads(lean: bool) -> list[torch.Tensor]:
        model.zero_grad()
        xi = x.clone().requires_grad_()
        with _decoded(private=lean):  # the lean ops' inputs come back decoded, as compressed
            out = model(xi, lean)
        (g,) = torch.autograd.grad(out.square().sum(), xi, create_graph=True)
        g.square().sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    mine, theirs = grads(True), grads(False)
    assert len(mine) == len(theirs) >= 2
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
