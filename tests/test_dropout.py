"""Dropout modes: nn.Dropout's semantics with the mask kept as bits or a seed, less memory."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from memory import measure
from torch import nn
from torch.utils.checkpoint import checkpoint
from zoo import hf_bert

from memopt_plugins import MemoryOptimizer
from memopt_plugins.dropout import (
    BITMASK,
    REGENERATE,
    DropoutPatch,
    FunctionalDropoutMode,
    dropout,
    memory_dropout_module,
    pack_mask,
    unpack_mask,
)

MODES = [BITMASK, REGENERATE]


def saved_tensors_of(fn):
    """Run ``fn()`` and return (output, [every tensor autograd saved while it ran])."""
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


class FunctionalDrop(nn.Module):
    """Calls F.dropout in its own forward, the way Hugging Face attention does."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return F.dropout(x, p=self.p, training=self.training)


class Block(nn.Module):
    def __init__(self, p: float = 0.3):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.drop = nn.Dropout(p)
        self.attn_drop = FunctionalDrop(p)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(self.attn_drop(self.drop(torch.relu(self.fc1(x)))))


# --------------------------------------------------------------------------- semantics


@pytest.mark.parametrize(
    "module, shape",
    [
        (nn.Dropout(0.3), (64, 50)),
        (nn.Dropout1d(0.3), (8, 6, 10)),
        (nn.Dropout1d(0.3), (6, 10)),  # unbatched
        (nn.Dropout2d(0.3), (4, 6, 5, 5)),
        (nn.Dropout3d(0.3), (2, 6, 3, 4, 4)),
        (nn.Dropout3d(0.3), (6, 3, 4, 4)),  # unbatched
        (nn.AlphaDropout(0.3), (64, 50)),
        (nn.FeatureAlphaDropout(0.3), (4, 6, 5, 5)),
        (nn.Dropout(0.3, inplace=True), (64, 50)),
    ],
)
def test_bitmask_equals_pytorch_dropout_bit_for_bit_on_cpu(module, shape):
    """Same seed, same mask: output and input gradient identical to PyTorch's module."""
    x = torch.randn(shape, requires_grad=True)
    grad = torch.randn(shape)
    results = []
    for m in (module, memory_dropout_module(module, BITMASK)):
        torch.manual_seed(7)
        inp = x.clone()  # a non-leaf, so in-place dropout is allowed
        out = m(inp)
        (g,) = torch.autograd.grad(out, x, grad)
        results.append((out.detach(), g))
    (out_ref, g_ref), (out_mem, g_mem) = results
    assert torch.equal(out_mem, out_ref)
    assert torch.equal(g_mem, g_ref)
    assert isinstance(memory_dropout_module(module, BITMASK), type(module))


@pytest.mark.parametrize("mode", MODES)
def test_mask_statistics_scaling_and_gradient(mode):
    """Dropped fraction ≈ p, kept values scaled by 1/(1−p), gradient uses the forward's mask."""
    p = 0.3
    x = torch.randn(400_000, requires_grad=True)
    out = dropout(x, p, True, mode=mode)
    kept = out != 0
    assert abs((1 - kept.float().mean().item()) - p) < 0.005  # 4.5 sigma at n = 400k
    scale = torch.ones(()) / (1 - p)
    assert torch.equal(out[kept], x.detach()[kept] * scale)
    grad = torch.randn_like(x)
    out.backward(grad)
    assert torch.equal(x.grad, grad * (kept.float() * scale))


@pytest.mark.parametrize("mode", MODES)
def test_two_calls_draw_different_masks_and_a_seed_repeats_them(mode):
    x = torch.randn(10_000)
    a, b = dropout(x, 0.5, True, mode=mode), dropout(x, 0.5, True, mode=mode)
    assert ((a != 0) != (b != 0)).float().mean() > 0.4  # independent masks differ in ~half
    torch.manual_seed(3)
    c = dropout(x, 0.5, True, mode=mode)
    torch.manual_seed(3)
    assert torch.equal(dropout(x, 0.5, True, mode=mode), c)


@pytest.mark.parametrize("mode", MODES)
def test_eval_p0_and_p1(mode):
    x = torch.randn(100, requires_grad=True)
    module = memory_dropout_module(nn.Dropout(0.4), mode).eval()
    assert module(x) is x  # eval: identity, as nn.Dropout returns its input
    assert dropout(x, 0.0, True, mode=mode) is x
    out = dropout(x, 1.0, True, mode=mode)
    out.sum().backward()
    assert torch.equal(out, torch.zeros(100)) and torch.equal(x.grad, torch.zeros(100))
    with pytest.raises(ValueError, match="between 0 and 1"):
        dropout(x, 1.5, True, mode=mode)


def test_regenerate_draws_one_seed_from_the_global_stream_and_never_reseeds(monkeypatch):
    """The global generator advances by exactly one randint per call; manual_seed is never used."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the global RNG was reseeded")

    monkeypatch.setattr(torch, "manual_seed", forbidden)
    monkeypatch.setattr(torch.random, "manual_seed", forbidden)
    x = torch.randn(1000, requires_grad=True)
    start = torch.get_rng_state()
    dropout(x, 0.2, True, mode=REGENERATE).sum().backward()
    after_call = torch.get_rng_state()
    torch.set_rng_state(start)
    torch.randint(2**63 - 1, (), dtype=torch.int64)
    assert torch.equal(after_call, torch.get_rng_state())


@pytest.mark.parametrize("mode, stored", [(BITMASK, math.ceil(50_000 / 8)), (REGENERATE, 0)])
def test_backward_keeps_one_bit_per_element_or_nothing(mode, stored):
    x = torch.randn(50_000, requires_grad=True)
    _, native = saved_tensors_of(lambda: F.dropout(x, 0.1))
    _, saved = saved_tensors_of(lambda: dropout(x, 0.1, True, mode=mode))
    assert sum(t.numel() * t.element_size() for t in native) == 50_000 * 4  # float mask
    assert sum(t.numel() * t.element_size() for t in saved) == stored
    assert all(t.dtype == torch.uint8 for t in saved)


def test_pack_and_unpack_round_trip_odd_length():
    noise = (torch.rand(3, 7, 5) > 0.5).float()
    packed = pack_mask(noise)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(105 / 8)
    assert torch.equal(unpack_mask(packed, noise.shape, torch.float32), noise)


def test_compression_hooks_store_the_packed_mask_losslessly():
    """At 2 bits with min_numel 0 the hooks see the mask, keep its bytes and the gradient exact."""
    model = nn.Sequential(nn.Dropout(0.3))
    opt = MemoryOptimizer({"dropout": {"mode": "bitmask"}, "quantize": {"bits": 2, "min_numel": 0}})
    opt.apply(model)
    x = torch.randn(8000, requires_grad=True)
    out = model(x)
    assert opt.internal.compression.stats.forward_tensors == 1
    assert opt.internal.compression.stats.forward_stored == 8000 // 8  # the packed mask, as it is
    grad = torch.randn(8000)
    out.backward(grad)
    assert torch.equal(x.grad, grad * ((out != 0).float() / 0.7))
    opt.remove()


# --------------------------------------------------------------------------- functional dropout


@pytest.mark.parametrize("mode", MODES)
def test_hf_bert_attention_dropout_is_routed(mode):
    """No float mask of the attention-probability shape is saved; masks are uint8 bits."""
    model, batch, loss_fn = hf_bert(batch_size=2, seq=32, layers=1)
    probs = torch.Size((2, 4, 32, 32))  # (batch, heads, seq, seq)

    def is_mask(t):  # values {0, 1/(1-p)} with p = 0.1
        values = torch.unique(t).tolist()
        return len(values) == 2 and values[0] == 0 and abs(values[1] - 1 / 0.9) < 1e-6

    def float_masks(saved):
        return [t for t in saved if t.shape == probs and t.is_floating_point() and is_mask(t)]

    _, saved = saved_tensors_of(lambda: loss_fn(model, batch))
    assert len(float_masks(saved)) == 1  # premise: PyTorch keeps the attention mask as floats
    opt = MemoryOptimizer({"dropout": {"mode": mode}})
    opt.apply(model)
    _, saved = saved_tensors_of(lambda: loss_fn(model, batch))
    opt.remove()
    assert float_masks(saved) == []
    packed = [t for t in saved if t.dtype == torch.uint8 and t.numel() == probs.numel() // 8]
    assert len(packed) == (1 if mode == BITMASK else 0)


def bert_128():
    """BERT at sequence length 128 (attention probabilities outweigh the MLM head)."""
    return hf_bert(batch_size=4, seq=128)


@pytest.fixture(scope="module")
def bert_keep():
    return measure(bert_128)


@pytest.mark.parametrize("mode", MODES)
def test_hf_bert_retained_memory_at_least_1_2x_lower(bert_keep, mode):
    reading = measure(bert_128, {"dropout": {"mode": mode}})
    assert bert_keep.retained / reading.retained >= 1.2, (bert_keep, reading)
    assert bert_keep.peak / reading.peak >= 1.1, (bert_keep, reading)


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_recompute_reproduces_the_masks(mode):
    """checkpoint(use_reentrant=False) replays both module and functional dropout exactly."""
    torch.manual_seed(0)
    block = Block()
    patch = DropoutPatch(mode)
    patch.apply(block)
    x = torch.randn(32, 16, requires_grad=True)
    runs = []
    for seed, wrap in (
        (11, lambda: block(x)),
        (11, lambda: checkpoint(block, x, use_reentrant=False)),
        (12, lambda: block(x)),
    ):
        torch.manual_seed(seed)
        out = wrap()
        runs.append((out.detach(), torch.autograd.grad(out.square().sum(), [x, block.fc1.weight])))
    patch.remove()
    (out_a, grads_a), (out_b, grads_b), (out_c, _) = runs
    assert block.attn_drop.calls == 4  # forward, checkpointed forward, its recompute, forward
    assert torch.equal(out_a, out_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    assert not torch.equal(out_a, out_c)  # dropout was active: another seed, other masks


def test_engine_recompute_of_a_module_calling_functional_dropout():
    """The engine's recompute replays module.forward directly: the mode is entered there too.

    (Without it the replay would save PyTorch's float mask and checkpoint would refuse it.)
    """
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(32, 16, requires_grad=True)
    grads = []
    for config in (
        {"dropout": {"mode": "bitmask"}},
        {"dropout": {"mode": "bitmask"}, "recompute": {"modules": ["attn_drop"]}},
    ):
        opt = MemoryOptimizer(config)
        opt.apply(block)
        torch.manual_seed(5)
        grads.append(torch.autograd.grad(block(x).square().sum(), [x, block.fc1.weight]))
        opt.remove()
    assert block.attn_drop.calls == 3
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_functional_dropout_under_autocast_matches_pytorch():
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    x = torch.randn(64, 16, requires_grad=True)
    results = []
    for mode in (None, FunctionalDropoutMode(BITMASK)):
        torch.manual_seed(2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if mode is None:
                out = F.dropout(lin(x), p=0.25, training=True)
            else:
                with mode:
                    out = F.dropout(lin(x), p=0.25, training=True)
        results.append((out, torch.autograd.grad(out.float().sum(), x)[0]))
    (ref, g_ref), (mem, g_mem) = results
    assert mem.dtype == ref.dtype == torch.bfloat16
    assert mem.grad_fn.name() == "_DropoutFunctionBackward"
    assert torch.equal(mem, ref) and torch.equal(g_mem, g_ref)


# --------------------------------------------------------------------------- patching


def test_swap_keeps_names_types_and_state_dict_and_remove_restores_exactly():
    torch.manual_seed(0)
    shared = nn.Dropout(0.2)
    model = nn.Sequential(
        nn.Linear(4, 4), shared, nn.Sequential(nn.Dropout2d(0.1), shared), nn.AlphaDropout(0.05)
    )
    originals = dict(model.named_modules(remove_duplicate=False))
    keys = list(model.state_dict())
    opt = MemoryOptimizer({"dropout": {"mode": "bitmask"}})
    opt.apply(model)
    swapped = dict(model.named_modules(remove_duplicate=False))
    assert list(swapped) == list(originals) and list(model.state_dict()) == keys
    assert model[1] is model[2][1]  # a shared module stays shared
    assert isinstance(model[1], nn.Dropout) and type(model[1]) is not nn.Dropout
    kinds = sorted(type(m).__name__ for m in model.modules() if "Dropout" in type(m).__name__)
    assert kinds == ["MemoryAlphaDropout", "MemoryDropout", "MemoryDropout2d"]
    model[1].p = 0.5  # the user changes p while patched
    model.eval()
    opt.remove()
    restored = dict(model.named_modules(remove_duplicate=False))
    assert all(restored[n] is originals[n] for n in originals)
    assert shared.p == 0.5 and not shared.training
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_a_dropout_replaced_after_apply_is_left_with_a_warning(caplog):
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2))
    opt = MemoryOptimizer({"dropout": {"mode": "bitmask"}})
    opt.apply(model)
    mine = model[1] = nn.Identity()
    with caplog.at_level(logging.WARNING, logger="memopt"):
        opt.remove()
    assert "Sequential.1 was replaced by someone else since apply" in caplog.text
    assert model[1] is mine
