"""A tensor several modules save is kept once, at the most precise width any of them asks for."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from zoo import hf_llama

from memopt_plugins import MemoryOptimizer
from memopt_plugins.compress.codec import dequantize, quantize, tensor_nbytes


class _Sin(nn.Module):
    def forward(self, h):
        return h.sin()  # saves h


class _SavedByTwo(nn.Module):
    """``h`` saved by two child modules, ``a`` first: their scopes may ask for different bits."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _Sin(), _Sin()

    def forward(self, x):
        h = x * 2
        return (self.a(h) + self.b(h)).sum()


def _run(quantize_config: dict, x: torch.Tensor) -> tuple[torch.Tensor, tuple, int, dict]:
    return _run_model(_SavedByTwo(), quantize_config, x)


def _run_model(
    model: nn.Module, quantize_config: dict, x: torch.Tensor
) -> tuple[torch.Tensor, tuple, int, dict]:
    """``x``'s gradient; the forward's (original, stored) bytes, the bytes held for backward and
    the per-scope (original, stored) bytes."""
    x = x.clone().requires_grad_()
    opt = MemoryOptimizer({"quantize": {"min_numel": 1, "rounding": "nearest", **quantize_config}})
    loss = opt.apply(model)(x)
    stats = opt.internal.compression.stats
    scopes = {fqn: (m.original, m.stored) for fqn, m in stats.modules.items()}
    forward, held = (stats.forward_original, stats.forward_stored), stats.held_bytes
    loss.backward()
    opt.remove()
    return x.grad, forward, held, scopes


@pytest.mark.parametrize("exact", ["a", "b"])
def test_a_saver_at_32_bits_keeps_the_shared_tensor_for_every_saver(exact):
    """Whichever saves first, the 32-bit saver's original is what both decode: the gradient is
    the uncompressed one bit for bit, and no compressed copy is held beside the original."""
    x = torch.randn(64, 256)
    expected = 2 * 2 * (2 * x).cos()
    grad, forward, held, scopes = _run({"bits": 4, "exclude": [exact]}, x)
    assert torch.equal(grad, expected)
    h_bytes = tensor_nbytes(x)
    assert forward == (h_bytes, h_bytes)  # one tensor, kept as it is
    assert held == 0  # no compact copy alongside
    assert scopes == {exact: (h_bytes, h_bytes)}  # under the scope whose bits it is kept at


@pytest.mark.parametrize("precise", ["a", "b"])
def test_the_shared_copy_is_made_at_the_most_precise_savers_bits(precise):
    """One at 4 bits and one at 8: both decode one 8-bit copy, and only its bytes are held."""
    x = torch.randn(64, 256)
    grad, forward, held, scopes = _run({"bits": 4, "overrides": {precise: 8}}, x)
    h = 2 * x
    packed = quantize(h, 8, group_size=256, stochastic=False)  # quantize.group_size's default
    assert torch.equal(grad, 2 * 2 * dequantize(packed).cos())
    assert forward == (tensor_nbytes(h), packed.nbytes)
    assert held == packed.nbytes
    assert scopes == {precise: (tensor_nbytes(h), packed.nbytes)}


class _SavedByThree(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = _Sin(), _Sin(), _Sin()

    def forward(self, x):
        h = x * 2
        return (self.a(h) + self.b(h) + self.c(h)).sum()


@pytest.mark.parametrize(
    "bits", [(2, 8, 4), (4, 2, 8), (16, 4, 2), (2, 4, 16), (4, 32, 8), (8, 2, 32), (32, 16, 2)]
)
def test_every_saver_decodes_the_copy_at_the_most_bits_asked_for_in_any_order(bits):
    """Three scopes save one tensor at the bits given, in that order: each decodes what the
    most precise of them keeps (a 16-bit copy: bfloat16; 32 bits: the original), so ``x``'s
    gradient is, bit for bit, the one of a forward that saved that copy for all three."""
    x = torch.randn(64, 256)
    overrides = dict(zip("abc", bits, strict=True))
    x_grad, *_ = _run_model(_SavedByThree(), {"bits": 8, "overrides": overrides}, x)
    h = 2 * x
    most = max(bits)
    if most == 32:
        kept = h
    elif most == 16:
        kept = h.bfloat16().float()
    else:
        kept = dequantize(quantize(h, most, group_size=256, stochastic=False))
    expected = x.clone().requires_grad_()
    swap = (lambda t: kept if t.shape == h.shape else t), (lambda t: t)
    with torch.autograd.graph.saved_tensors_hooks(*swap):
        loss = _SavedByThree()(expected)
    loss.backward()
    assert torch.equal(x_grad, expected.grad)


def _llama_gradients(quantize_config: dict, exact: Callable[[str], bool] = lambda fqn: False):
    """The parameters' gradients and the forward's stored bytes; ``exact``: which compressed
    modules are set to 32 bits after apply (as the drift guard sets a module over its
    threshold)."""
    model, batch, loss_fn = hf_llama(batch_size=2, seq=32)
    opt = MemoryOptimizer({"quantize": {"rounding": "nearest", **quantize_config}})
    opt.apply(model)
    for fqn in list(opt.bits):
        if exact(fqn):
            opt.set_bits(fqn, 32)
    loss = loss_fn(model, batch)
    stored = opt.internal.compression.stats.forward_stored
    loss.backward()
    opt.remove()
    return {n: p.grad for n, p in model.named_parameters()}, stored


def test_excluding_v_proj_keeps_the_input_it_shares_with_q_and_k_exact():
    """The query, key and value projections save one normed hidden state. Excluding ``v_proj``
    keeps that state as it is for all three: the same gradients, bit for bit, and the same bytes
    as excluding all three projections."""
    grads, stored = _llama_gradients({"bits": 4, "exclude": ["*.v_proj"]})
    qkv = ["*.q_proj", "*.k_proj", "*.v_proj"]
    reference, reference_stored = _llama_gradients({"bits": 4, "exclude": qkv})
    assert stored == reference_stored
    assert all(torch.equal(grads[n], reference[n]) for n in reference)


def test_set_bits_to_32_reaches_a_tensor_another_module_saved_first():
    """Every scope but the query and key projections raised to 32 bits, as the drift guard
    raises them: ``v_proj`` saves the input ``q_proj`` saved first at 4 bits, and its 32 bits
    keep the original for all three. Nothing else is compressed: every gradient is exact."""
    exact, _ = _llama_gradients({"bits": 32})
    grads, _ = _llama_gradients({"bits": 4}, lambda fqn: not fqn.endswith(("q_proj", "k_proj")))
    for name in exact:
        assert torch.equal(grads[name], exact[name]), name


class _NormedTwice(nn.Module):
    """A layer norm's output read by two projections (the lean norm's output is a recipe over
    its compressed input, :mod:`memopt_plugins.derived`)."""

    def __init__(self):
        super().__init__()
        self.norm, self.a, self.b = nn.LayerNorm(64), nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        h = self.norm(x)
        return (self.a(h) + self.b(h)).sum()


@pytest.mark.parametrize("exact", ["a", "b"])
def test_a_saver_at_32_bits_keeps_a_lean_norms_output_rather_than_its_recipe(exact):
    """The lean norm's output saved at 8 bits is made again from the norm's 8-bit input; a saver
    at 32 bits, before or after, keeps the output itself for both projections: their weight
    gradients are the uncompressed ones, bit for bit."""
    torch.manual_seed(0)
    model, x = _NormedTwice(), torch.randn(8, 32, 64)
    model(x).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    lean = {"ops": {"fuse": ["layernorm"]}, "quantize": {"bits": 8, "exclude": [exact]}}
    opt = MemoryOptimizer(lean)
    opt.apply(model)
    loss = model(x)
    h_bytes = tensor_nbytes(x)
    scope = opt.internal.compression.stats.modules[exact]
    assert (scope.original, scope.stored) == (h_bytes, h_bytes)
    assert {"a", "b"} & set(opt.internal.compression.stats.modules) == {exact}
    loss.backward()
    opt.remove()
    for name in ("a.weight", "b.weight"):
        assert torch.equal(model.get_parameter(name).grad, expected[name]), name
