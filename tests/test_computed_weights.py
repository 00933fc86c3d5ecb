"""Weights a forward computes from parameters alone are kept as they are, like the parameters."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

from memopt_plugins import MemoryOptimizer
from memopt_plugins.compress.codec import tensor_nbytes

_TWO_BITS = {"quantize": {"bits": 2, "min_numel": 1, "rounding": "nearest"}}


class _Scaled(nn.Module):
    """``F.linear(x, scale * w)``: the weight is made in the forward, by a functional call."""

    def __init__(self, dim: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.scale = nn.Parameter(torch.rand(dim, 1) + 0.5)

    def forward(self, x):
        return F.linear(x, self.scale * self.w)


def _hook_style(norm):
    def make(linear: nn.Linear) -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # weight_norm: deprecated
            return norm(linear)

    return make


_KINDS = {
    "weight_norm": parametrizations.weight_norm,
    "orthogonal": parametrizations.orthogonal,
    "spectral_norm": parametrizations.spectral_norm,
    "hook-style spectral_norm": _hook_style(nn.utils.spectral_norm),
    "hook-style weight_norm": _hook_style(nn.utils.weight_norm),
    "functional": lambda linear: _Scaled(linear.in_features),
}


def _hook_counts(model: nn.Module) -> dict[str, tuple[int, int]]:
    return {n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()}


@pytest.mark.parametrize("kind", list(_KINDS))
def test_a_weight_computed_in_the_forward_is_kept_as_it_is(kind):
    """At 2 bits, the weight of the second layer is made from parameters in the forward. It is
    kept as it is: the first layer's gradient equals that of a model whose second layer holds
    the same weight as a parameter (both compress the same two activations, at nearest
    rounding), and the weight's bytes are counted as kept in its scope, not packed."""
    torch.manual_seed(0)
    dim = 64
    model = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), _KINDS[kind](nn.Linear(dim, dim)))
    model.eval()  # the spectral norms' power iteration changes nothing between the two runs
    with torch.no_grad():
        if isinstance(model[2], _Scaled):
            weight = model[2].scale * model[2].w
        else:
            model[2](torch.zeros(1, dim))  # a hook-style norm sets its weight in its pre-hook
            weight = model[2].weight
    plain = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim, bias=False))
    with torch.no_grad():
        plain[0].load_state_dict(model[0].state_dict())
        plain[2].weight.copy_(weight)
    x = torch.randn(256, dim)
    hooks = _hook_counts(model)
    grads, scopes = [], []
    for net in (model, plain):
        opt = MemoryOptimizer(_TWO_BITS)
        opt.apply(net)
        loss = net(x).sum()
        scope = opt.internal.compression.stats.modules.get("2")
        scopes.append(None if scope is None else (scope.original, scope.stored))
        loss.backward()
        opt.remove()
        grads.append(net[0].weight.grad)
    assert _hook_counts(model) == hooks  # remove() took memopt's off the parametrizations too
    assert torch.equal(grads[0], grads[1])
    assert scopes == [(tensor_nbytes(weight), tensor_nbytes(weight)), None]  # a parameter: none


class _Data(nn.Module):
    """An embedding's output and a first layer's output on a batch that needs no gradient:
    activations, though the only tensors they are made from that need gradients are
    parameters."""

    def __init__(self):
        super().__init__()
        self.embed, self.first = nn.Embedding(1000, 64), nn.Linear(64, 64)
        self.after_embed, self.after_first = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, ids, x):
        return (self.after_embed(self.embed(ids)).sum() + self.after_first(self.first(x))).sum()


def test_activations_made_from_parameters_and_data_stay_compressed():
    """The saved embedding output (4 x 16 rows: fewer elements than the table) and the first
    layer's output (16 rows: fewer elements than its weight) are packed at 2 bits."""
    torch.manual_seed(0)
    model, ids, x = _Data(), torch.randint(0, 1000, (4, 16)), torch.randn(16, 64)
    opt = MemoryOptimizer(_TWO_BITS)
    opt.apply(model)
    model(ids, x).backward()
    modules = opt.internal.compression.stats.modules
    for fqn in ("after_embed", "after_first"):
        assert modules[fqn].stored * 8 < modules[fqn].original, fqn
    opt.remove()


def test_autocast_copy_of_a_frozen_weight_is_kept_as_it_is():
    """PEFT LoRA's base layers are frozen: autocast casts their weights afresh at every call, a
    copy with no autograd history (it caches, and gives a history to, only casts of weights that
    need gradients). That copy is the weight backward multiplies by, so it is kept as it is:
    the input's gradient through a frozen bf16-autocast layer equals that without memopt, bit
    for bit (the output's gradient, of a sum, is exact), and the copy's bytes are kept."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 96).requires_grad_(False)
    x = torch.randn(32, 64)

    def input_grad(model: nn.Module) -> torch.Tensor:
        x_ = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x_).float().sum().backward()
        return x_.grad

    expected = input_grad(layer)
    opt = MemoryOptimizer(_TWO_BITS)
    opt.apply(layer)
    try:
        got = input_grad(layer)
        stats = opt.internal.compression.stats
        assert torch.equal(got, expected)
        weight_copy = 64 * 96 * 2  # bf16
        assert stats.forward_stored >= weight_copy
    finally:
        opt.remove()


def test_a_frozen_weight_shaped_activation_is_still_compressed():
    """Only a copy with no autograd history is taken for a frozen weight's: an activation of the
    same shape that needs a gradient is compressed as any other."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64).requires_grad_(False))
    x = torch.randn(64, 64)
    opt = MemoryOptimizer(_TWO_BITS)
    opt.apply(model)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).float().sum().backward()
        modules = opt.internal.compression.stats.modules
        relu, frozen = modules["1"], modules["2"]  # bf16 (64, 64), the frozen weight's shape
        assert relu.original == frozen.original == frozen.stored == 64 * 64 * 2
        assert relu.stored < relu.original
    finally:
        opt.remove()
