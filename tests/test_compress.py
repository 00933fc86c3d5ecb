"""Compression engine: memory really freed, gradients close, model restored, skip rules."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from memory import gradients, measure, rel_error
from torch import nn
from zoo import hf_clip, hf_gpt2, hf_resnet

from memopt_plugins import ConfigError, MemoryOptimizer
from memopt_plugins.compress.bits import BitTable
from memopt_plugins.compress.codec import PackedTensor, dequantize, quantize
from memopt_plugins.compress.hooks import CompressionHooks
from memopt_plugins.lean.chains import gelu


def q(bits: int, **extra) -> dict:
    return {"quantize": {"bits": bits, **extra}}


# --------------------------------------------------------------------------- the bar
@pytest.fixture(scope="module")
def gpt_baseline():
    return measure(hf_gpt2)


@pytest.fixture(scope="module")
def cnn_baseline():
    return measure(hf_resnet)


def held(reading) -> int:
    """Retained bytes, never less than what the hooks hold: RSS misses small blocks that the
    allocator serves from heap pages already resident, so it can read below the packed bytes."""
    return max(reading.retained, reading.packed)


def _check_ratio_and_peak(baseline, reading, bits, floor):
    ratio = baseline.retained / held(reading)
    assert ratio >= floor, f"{bits}-bit: {ratio:.2f}x < {floor}x ({reading})"
    # the peak over the step falls by at least half of the retained saving
    saving = baseline.retained - held(reading)
    assert baseline.peak - reading.peak >= 0.5 * saving, (baseline, reading)


@pytest.mark.parametrize("bits, floor", [(8, 3.7), (4, 7.0), (2, 12.0)])
def test_transformer_retained_memory_ratio(gpt_baseline, bits, floor):
    _check_ratio_and_peak(gpt_baseline, measure(hf_gpt2, q(bits)), bits, floor)


@pytest.mark.parametrize("bits, floor", [(8, 3.5), (4, 6.5), (2, 11.0)])
def test_cnn_retained_memory_ratio(cnn_baseline, bits, floor):
    _check_ratio_and_peak(cnn_baseline, measure(hf_resnet, q(bits)), bits, floor)


def test_packed_bytes_account_for_retained_memory(gpt_baseline):
    """The process really holds what the hooks say they hold (within 25%: see ``held``)."""
    reading = measure(hf_gpt2, q(4))
    assert reading.packed > 0
    assert abs(reading.retained - reading.packed) <= 0.25 * reading.packed


@pytest.mark.parametrize("build, limit", [(hf_gpt2, 0.01), (hf_resnet, 0.015)])
def test_8bit_gradient_error(build, limit):
    model, batch, loss_fn = build()
    exact = gradients(model, batch, loss_fn)
    err = rel_error(gradients(model, batch, loss_fn, q(8)), exact)
    assert err <= limit
    assert err > 0  # something was compressed


def test_clip_8bit_gradient_error():
    """Two towers into one contrastive loss: the image embeddings that the similarity matmul
    saves transposed are grouped in their index order (measured 1.82% at nearest rounding;
    grouped in memory order, per sample, 2.25%)."""
    model, batch, loss_fn = hf_clip()
    exact = gradients(model, batch, loss_fn)
    err = rel_error(gradients(model, batch, loss_fn, q(8, rounding="nearest")), exact)
    assert 0 < err <= 0.019


class _Towers(nn.Module):
    """Two projections into one similarity matrix, the pattern of CLIP's loss."""

    def __init__(self, dim: int = 64):
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x, y):
        a, b = self.a(x), self.b(y)
        return F.cross_entropy(a @ b.t(), torch.arange(len(x)))


def test_a_transposed_saved_view_is_grouped_in_its_index_order():
    """``a @ b.t()`` saves ``b.t()``. When ``b``'s rows are nearly alike (a shared direction, as
    an untrained CLIP's embeddings are), groups along the samples see only their small spread,
    and groups along a row see the whole shared direction. Only the matmul's saved tensors are
    compressed here: measured 2.03% error in index order, 7.2% in memory order."""
    model = _Towers()
    x, y = torch.randn(256, 64), torch.randn(1, 64) + 0.05 * torch.randn(256, 64)
    exact = gradients(model, (x, y), lambda m, b: m(*b))
    config = q(8, rounding="nearest", exclude=["a", "b"])
    err = rel_error(gradients(model, (x, y), lambda m, b: m(*b), config), exact)
    assert 0 < err <= 0.025
    hooks = CompressionHooks(BitTable(), group_size=256, stochastic=False, min_numel=1)
    transposed = hooks._compress(y.t(), 8)
    assert torch.equal(transposed.payload.codes, quantize(y.t().contiguous(), 8, 256, False).codes)


def test_lower_bits_give_larger_but_bounded_error():
    model, batch, loss_fn = hf_gpt2(batch_size=4, seq=64)
    exact = gradients(model, batch, loss_fn)
    errors = {b: rel_error(gradients(model, batch, loss_fn, q(b)), exact) for b in (16, 8, 4, 2)}
    assert errors[16] < errors[8] < errors[4] < errors[2]
    # measured over quantize.seed 0-7: 16 bits 0.185%, 8 bits 0.78-0.79%, 4 bits 15.4-15.5%,
    # 2 bits 239-246% (2 bits needs the drift check; see test_drift)
    assert errors[16] < 0.0025 and errors[8] < 0.009 and errors[4] < 0.17 and errors[2] < 2.7


def test_32_bits_is_bit_for_bit_identical():
    model, batch, loss_fn = hf_gpt2(batch_size=2, seq=32)
    exact = gradients(model, batch, loss_fn)
    same = gradients(model, batch, loss_fn, q(32, overrides={"transformer.h.0": 32}))
    assert all(torch.equal(same[k], exact[k]) for k in exact)


# --------------------------------------------------------------------------- scoping
class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x):
        h = torch.tanh(self.a(x))  # tanh saves its output in the root scope
        return self.b(h).sin().sum()


def _packed_bits(model, x, config) -> list[int]:
    opt = MemoryOptimizer(config)
    opt.apply(model)
    seen: list[int] = []
    orig = opt.internal.hooks._compress

    def spy(t, bits):
        saved = orig(t, bits)
        payload = getattr(saved, "payload", None)
        seen.append(payload.bits if isinstance(payload, PackedTensor) else 32)
        return saved

    opt.internal.hooks._compress = spy
    model(x).backward()
    opt.remove()
    return seen


def test_innermost_module_decides_bits():
    model, x = Toy(), torch.randn(128, 64)
    cfg = {"quantize": {"bits": 8, "overrides": {"b": 2}, "min_numel": 1}}
    seen = _packed_bits(model, x, cfg)
    # a: input x (8); root: tanh output (8); b: its input h is already packed at 8 (dedup) and
    # the sin input (b's output) is saved in the root scope (8). Nothing from b's own scope
    # except the dedup hit, so no 2-bit pack of h.
    assert seen.count(8) == 3 and 2 not in seen
    cfg = {"quantize": {"bits": 32, "overrides": {"b": 2}, "min_numel": 1}}
    assert _packed_bits(model, x, cfg) == [2]  # only h, saved inside b


def test_exclude_shields_a_subtree():
    model, batch, loss_fn = hf_gpt2(batch_size=2, seq=32)
    opt = MemoryOptimizer(q(4, exclude=["transformer.h.0"]))
    opt.apply(model)
    assert not any(f.startswith("transformer.h.0") for f in opt.bits)
    assert "transformer.h.1.mlp.c_fc" in opt.bits
    assert opt.plan["transformer.h.0.mlp.c_fc"].action == "keep"
    entry = opt.plan["transformer.h.1.mlp.c_fc"]
    assert (entry.kind, entry.action, entry.bits) == ("compute", "compress", 4)
    opt.remove()


def test_parameters_and_autocast_copies_are_not_compressed():
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    x = torch.randn(64, 256)
    opt = MemoryOptimizer(q(8, min_numel=1))
    opt.apply(model)
    kept: list[torch.Tensor] = []
    orig = opt.internal.hooks._compress
    opt.internal.hooks._compress = lambda t, b: (kept.append(t), orig(t, b))[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().sum().backward()
    opt.remove()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert kept, "activations were packed"
    assert all(t.untyped_storage().data_ptr() not in weights for t in kept)
    assert all(t.grad_fn is None or t.grad_fn.name() != "ToCopyBackward0" for t in kept)


def test_tensor_saved_twice_is_packed_once():
    class Square(nn.Module):
        def forward(self, x):
            y = x.exp()  # exp saves its output y
            return (y * y).sum()  # mul saves y twice more

    x = torch.randn(64, 128, requires_grad=True)
    opt = MemoryOptimizer(q(8, min_numel=1))
    loss = opt.apply(Square())(x)
    assert opt.internal.compression.stats.forward_tensors == 1
    loss.backward()
    opt.remove()
    expected = 2 * (2 * x.detach()).exp()
    assert ((x.grad - expected).norm() / expected.norm()).item() < 0.01


class _SavedTwiceInARow(nn.Module):
    """``h`` saved by two nodes one after the other (``second`` is the lean GELU, which writes
    its gradient into a private decode of ``h``, or ``cos``, which only reads it)."""

    def __init__(self, second):
        super().__init__()
        self.second = second

    def forward(self, x):
        h = x * 2
        return (h.sin() + self.second(h)).sum()


@pytest.mark.parametrize("second, decodes", [(torch.cos, 1), (gelu, 2)])
def test_consecutive_saves_of_one_tensor_share_one_decode(monkeypatch, second, decodes):
    """Consecutive saves of one tensor (a layer norm's output by the query, key and value
    projections) run their backward nodes one after the other: one decode serves them all,
    unless a node writes its gradient into it, and then the next decodes its own."""
    import memopt_plugins.compress.saved as saved_module

    calls = []
    decode = saved_module.dequantize
    monkeypatch.setattr(saved_module, "dequantize", lambda p: calls.append(1) or decode(p))
    x = torch.randn(64, 256, requires_grad=True)
    opt = MemoryOptimizer(q(8, min_numel=1, rounding="nearest"))
    opt.apply(_SavedTwiceInARow(second))(x).backward()
    group_size = opt.internal.hooks.group_size
    opt.remove()
    assert len(calls) == decodes
    h = (2 * x).detach()
    hq = dequantize(quantize(h, 8, group_size=group_size, stochastic=False))
    ones = torch.ones_like(h)
    _, reference = torch.autograd.functional.vjp(lambda v: v.sin() + second(v), hq, ones)
    assert torch.allclose(x.grad, 2 * reference, atol=1e-6)


def test_reused_address_never_gets_another_tensors_pack(monkeypatch):
    """A freed tensor's address is reused at once, so a new tensor can arrive with a dead one's
    cache key: the cache must prove the cached tensor alive before handing out its pack."""
    import memopt_plugins.compress.hooks as hooks_module

    hooks = CompressionHooks(BitTable(), group_size=256, stochastic=False, min_numel=1)
    a = torch.rand(64, 256)
    saved_a = hooks.pack(a, 8)
    assert hooks.pack(a, 8) is saved_a  # alive: a second save of the same tensor is a hit
    key = hooks_module._alias_key(a)
    del a  # freed: its address may now hold anything
    b = -torch.rand(64, 256)
    monkeypatch.setattr(hooks_module, "_alias_key", lambda t: key)  # b lands on a's address
    saved_b = hooks.pack(b, 8)
    assert saved_b is not saved_a
    assert (hooks.unpack(saved_b) - b).abs().max() <= 2 * b.abs().max() / 255  # b, not a


def test_a_replaced_buffers_reused_address_is_not_the_models_memory(monkeypatch):
    """A forward that reassigns a buffer (``self.avg = 0.9 * self.avg + ...``) frees the one the
    storages were read from, and the allocator may hand that address to the next tensor: only a
    storage still alive is the model's memory, so a tensor on the reused address is compressed
    as any other. Kept as a buffer, whether it was compressed depended on the allocator, and two
    equal runs (drift checks on and off) trained differently."""
    import memopt_plugins.measure.storage as storage_module
    from memopt_plugins.compress.hooks import _Kept

    model = nn.Linear(256, 256)
    model.register_buffer("avg", torch.zeros(64, 256))
    opt = MemoryOptimizer(q(8, min_numel=1))
    opt.apply(model)
    assert isinstance(opt.internal.hooks.pack(model.avg, 8), _Kept)  # a buffer is kept as it is
    key = storage_module.storage_key(model.avg)
    model.avg = torch.ones(64, 256)  # the old buffer is freed: its address may hold anything
    h = torch.rand(64, 256)
    real = storage_module.storage_key
    monkeypatch.setattr(storage_module, "storage_key", lambda t: key if t is h else real(t))
    try:
        assert not isinstance(opt.internal.hooks.pack(h, 8), _Kept)
    finally:
        opt.remove()


def test_integer_tensors_are_narrowed_losslessly():
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.MaxPool2d(2, return_indices=False), nn.ReLU())
    x = torch.randn(8, 3, 34, 34)
    exact = gradients(model, (x,), lambda m, b: m(b[0]).square().sum())
    opt = MemoryOptimizer(q(16, min_numel=1))
    opt.apply(model)
    kinds = []
    orig = opt.internal.hooks._compress
    opt.internal.hooks._compress = lambda t, b: (kinds.append((t.dtype, orig(t, b))), kinds[-1][1])[
        1
    ]
    model(x).square().sum().backward()
    opt.remove()
    index_saves = [saved for dtype, saved in kinds if dtype == torch.int64]
    assert index_saves and all(s.payload.values.element_size() <= 2 for s in index_saves)
    got = {n: p.grad for n, p in model.named_parameters()}
    assert rel_error(got, exact) < 0.01


def test_nan_activations_propagate_like_the_baseline():
    model = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1))
    x = torch.randn(64, 128)
    x[3, 5] = float("nan")
    exact = gradients(model, (x,), lambda m, b: m(b[0]).sum())
    got = gradients(model, (x,), lambda m, b: m(b[0]).sum(), q(8, min_numel=1))
    for k in exact:
        assert torch.equal(exact[k].isnan(), got[k].isnan())


# --------------------------------------------------------------------------- lifecycle
def test_remove_restores_the_model_exactly():
    model, batch, loss_fn = hf_gpt2(batch_size=2, seq=32)
    keys = list(model.state_dict())
    hooks_before = {
        n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()
    }
    exact = gradients(model, batch, loss_fn)  # before apply
    opt = MemoryOptimizer(q(4))
    opt.apply(model)
    loss_fn(model, batch).backward()
    assert rel_error(gradients(model, batch, loss_fn), exact) > 0.01  # 4 bits acted
    opt.remove()
    assert list(model.state_dict()) == keys
    assert {
        n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()
    } == hooks_before
    again = gradients(model, batch, loss_fn)
    assert again.keys() == exact.keys()
    assert all(torch.equal(exact[k], again[k]) for k in exact)
    again_opt = MemoryOptimizer(q(4))
    again_opt.apply(model)  # can be patched again after remove
    again_opt.remove()


def test_second_apply_raises():
    model, _, _ = hf_gpt2(batch_size=1, seq=8)
    opt = MemoryOptimizer(q(8))
    opt.apply(model)
    with pytest.raises(RuntimeError, match="already patched"):
        MemoryOptimizer(q(4)).apply(model)
    with pytest.raises(RuntimeError, match="already applied"):
        opt.apply(nn.Linear(2, 2))
    opt.remove()


def test_glob_matching_nothing_is_a_config_error_listing_real_names():
    model, _, _ = hf_gpt2(batch_size=1, seq=8)
    with pytest.raises(ConfigError) as err:
        MemoryOptimizer(q(4, overrides={"transformer.h.*.mpl": 8})).apply(model)
    msg = str(err.value)
    assert "quantize.overrides" in msg and "transformer.h.*.mpl" in msg
    assert "transformer" in msg.split("matches no module")[1]
    opt = MemoryOptimizer(q(4))
    opt.apply(model)  # the failed apply left the model untouched and patchable
    opt.remove()


def test_bits_plan_and_state_dict_round_trip():
    model, batch, loss_fn = hf_gpt2(batch_size=1, seq=8)
    opt = MemoryOptimizer(q(4, overrides={"lm_head": 8}))
    opt.apply(model)
    assert opt.bits["lm_head"] == 8 and opt.bits["transformer.h.0.attn.c_attn"] == 4
    assert "compress" in str(opt.plan) and "lm_head" in str(opt.plan)
    opt.set_bits("transformer.h.0.attn.c_attn", 8)
    state = opt.state_dict()
    opt.remove()
    fresh = MemoryOptimizer(q(4, overrides={"lm_head": 8}))
    fresh.load_state_dict(state)  # before apply: takes effect at apply
    fresh.apply(model)
    assert fresh.bits == state["bits"]
    fresh.remove()


def test_functional_calls_inside_a_selected_module_are_compressed():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(128, 128) / 12)

        def forward(self, x):
            return F.silu(F.linear(x, self.w)).sum()

    model, x = Functional(), torch.randn(256, 128)
    opt = MemoryOptimizer(q(4))
    opt.apply(model)
    loss = model(x)
    stats = opt.internal.compression.stats
    assert stats.forward_original == 2 * 256 * 128 * 4  # x and the silu input
    assert stats.forward_ratio > 7.0
    loss.backward()
    opt.remove()


def test_dedup_cache_is_emptied_after_each_forward_even_when_the_root_is_not_called():
    """Lightning modules often call ``self.model(x)``: the patched root's own hooks never run."""

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))

    wrapper = Wrapper()
    opt = MemoryOptimizer(q(8, min_numel=1))
    opt.apply(wrapper)
    for _ in range(3):
        wrapper.model(torch.randn(32, 64)).sum().backward()
        assert len(opt.internal.hooks._cache) == 0
        assert opt.internal.compression.stats.held_bytes == 0  # payloads freed with the graph
    loss = wrapper.model(torch.randn(32, 64)).sum()
    one_forward = opt.internal.compression.stats.forward_original
    assert one_forward == 3 * 32 * 64 * 4  # x, the GELU input, the GELU output: one step only
    loss.backward()
    opt.remove()


@pytest.mark.parametrize(
    "layout",
    [
        lambda t: t,
        lambda t: t.transpose(0, 2),  # what a matmul saves of a transposed weight-like view
        lambda t: t.permute(1, 2, 0),
        lambda t: t[:, ::2],  # a slice with gaps: not dense
        lambda t: t[:, :1].transpose(0, 1),  # a size-1 dim
        lambda t: t.unsqueeze(1).expand(-1, 3, -1, -1)[:, 1],  # a view of an expanded tensor
    ],
    ids=["contiguous", "transposed", "permuted", "strided-slice", "size-1", "expanded-view"],
)
@pytest.mark.parametrize("bits", [16, 8, 2])
def test_unpack_returns_the_size_and_strides_that_were_saved(layout, bits):
    """Decoding gives back the saved size and layout exactly where the saved tensor is dense
    (values within the codec's error); a slice with gaps comes back dense in its own dim order,
    never in a buffer the size of the tensor it was sliced from."""
    hooks = CompressionHooks(BitTable(), group_size=256, stochastic=False, min_numel=1)
    t = layout(torch.randn(64, 48, 32))
    out = hooks.unpack(hooks._compress(t, bits))
    assert out.shape == t.shape and out.dtype == t.dtype
    if t.untyped_storage().nbytes() > t.numel() * t.element_size() and not t.is_contiguous():
        assert out.is_contiguous() and out.untyped_storage().nbytes() == t.numel() * 4
    else:
        assert out.stride() == t.stride()
    if bits == 2:  # four levels: only the sign pattern is asserted (the codec keeps it)
        assert torch.equal(torch.sign(out), torch.sign(t))
    else:
        step = (t.max() - t.min()) / 255
        assert (out - t).abs().max() <= (step if bits == 8 else 0.01 * t.abs().max())


def test_attention_output_saved_heads_apart_and_side_by_side_is_packed_once():
    """SDPA returns its output as a transposed view of a (batch, tokens, heads, head size)
    buffer and saves it; the output projection saves the same memory as (tokens, width). One
    copy is kept, and each unpacks in its own shape and strides."""
    hooks = CompressionHooks(BitTable(), group_size=256, stochastic=False, min_numel=1)
    memory = torch.randn(2, 64, 4, 32)
    heads = memory.transpose(1, 2)  # (batch, heads, tokens, head size), as SDPA returns it
    side_by_side = heads.transpose(1, 2).view(2 * 64, 4 * 32)
    first = hooks.pack(heads, 4)
    second = hooks.pack(side_by_side, 4)
    assert hooks.counter.stats.forward_tensors == 1 and second.payload is first
    a, b = hooks.unpack(first), hooks.unpack(second)
    assert a.shape == heads.shape and a.stride() == heads.stride()
    assert b.shape == side_by_side.shape and b.is_contiguous()
    assert torch.equal(b, a.transpose(1, 2).reshape(2 * 64, 4 * 32))
    assert (b - side_by_side).abs().max() <= (memory.max() - memory.min()) / 15


def test_bool_tensors_small_tensors_and_views_of_one_tensor_as_documented():
    """The README's "never compressed" list: bool tensors and tensors under ``min_numel`` are
    kept as they are; a tensor saved as several dense views of its memory (reshaped, transposed)
    is stored once, a view with gaps (a slice) a second time."""
    hooks = CompressionHooks(BitTable(), group_size=256, stochastic=False, min_numel=1000)
    small, mask = torch.rand(999), torch.rand(64, 256) > 0.5
    assert hooks.unpack(hooks.pack(small, 8)) is small
    assert hooks.unpack(hooks.pack(mask, 8)) is mask
    a = torch.rand(64, 256)
    plain = hooks.pack(a, 8)
    assert hooks.pack(a, 8) is plain and plain.nbytes < a.numel() * a.element_size() / 3
    flat = hooks.pack(a.view(-1), 8)  # a (contiguous) view of the same elements
    assert flat.payload is plain  # the one compressed copy, reshaped on unpack
    out = hooks.unpack(flat)
    assert out.shape == (64 * 256,) and (out - a.view(-1)).abs().max() <= a.max() / 255
    transposed = hooks.pack(a.t(), 8)  # the same memory in another dim order
    assert transposed.payload is plain
    out = hooks.unpack(transposed)
    assert out.stride() == a.t().stride() and torch.equal(out, hooks.unpack(plain).t())
    sliced = hooks.pack(a[:, :128], 8)
    assert getattr(sliced, "payload", None) is not plain
    assert hooks.unpack(sliced).shape == (64, 128)


class _Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(256, 256)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(self.lin(x)).pow(2).sum()


def test_a_dropout_mask_is_kept_exactly_as_bits():
    """On the CPU dropout saves its mask as a float tensor of 0 and 1 / (1 - p) with no autograd
    history. Quantized as an activation, rounding moved 1 / (1 - p) to neighbouring levels (at 2
    bits up to a third off, at random); kept as a bit an element it is exact at any width: with
    only the dropout's scope at 2 bits, the gradients are the baseline's to the bit, and its
    scope's counts hold a bit an element, the same at every width (the budget's estimate)."""
    model, x = _Dropped(), torch.randn(64, 256, requires_grad=True)
    baseline = copy.deepcopy(model)
    torch.manual_seed(5)
    baseline(x).backward()
    expected = (x.grad.clone(), baseline.lin.weight.grad)
    x.grad = None
    opt = MemoryOptimizer({"quantize": {"bits": 32, "overrides": {"drop": 2}, "min_numel": 1}})
    opt.apply(model)
    torch.manual_seed(5)
    model(x).backward()
    assert torch.equal(x.grad, expected[0]) and torch.equal(model.lin.weight.grad, expected[1])
    saved = opt.internal.compression.stats.modules["drop"]
    opt.remove()
    assert saved.original == 64 * 256 * 4 and saved.stored == 64 * 256 // 8 + 4
    assert saved.floats == [] and saved.bytes_at(8, 256) == saved.stored
    # a size-1 dim's stride, whatever it is, comes back as it was saved (as the codec's decodes)
    hooks = CompressionHooks(BitTable(), group_size=256, stochastic=True, min_numel=1)
    mask = ((torch.rand(64, 1, 256) > 0.1).float() / 0.9).as_strided((64, 1, 256), (256, 7, 1))
    packed = hooks.pack(mask, 2)
    out = hooks.unpack(packed)
    assert packed.nbytes == 64 * 256 // 8 + 4
    assert out.stride() == mask.stride() and torch.equal(out, mask)


def _frames_to_kernel(pack: Callable[[torch.Tensor], object], t: torch.Tensor) -> list[str]:
    """The Python frames between ``pack(t)``'s call and the C kernel's, innermost first."""
    from memopt_plugins.compress.codec import native

    lib = native.library()
    if lib is None:
        pytest.skip("the C kernels are not built here")
    seen: list[list[str]] = []

    class Kernels:  # the library, with the quantize entry point noting the stack
        def __getattr__(self, name):
            return getattr(lib, name)

        def memopt_quantize(self, *args):
            frame, names = sys._getframe(1), []
            while frame is not None and frame.f_code.co_name != "calling_pack":
                names.append(frame.f_code.co_name)
                frame = frame.f_back
            seen.append(names)
            return lib.memopt_quantize(*args)

    def calling_pack():
        return pack(t)

    before = native._state["lib"]
    native._state["lib"] = Kernels()
    try:
        calling_pack()
    finally:
        native._state["lib"] = before
    return seen[0]


def test_a_saved_tensor_reaches_the_c_kernel_within_five_python_frames():
    """Every frame on the eager pack path runs for every saved tensor: the scope's pack hook (a
    GraphModule, as compiled graphs need) calls the hooks' pack directly, and pack reaches the
    kernel through the codec's quantize and the kernel's wrapper only."""
    opt = MemoryOptimizer(q(8, min_numel=1, rounding="nearest"))
    model = opt.apply(nn.Linear(256, 256))
    hook, _ = opt.internal.hooks.pair("")
    t = torch.randn(64, 256)
    frames = _frames_to_kernel(hook, t)
    opt.remove()
    assert frames[-1] == "pack" and len(frames) <= 5, frames
    del model


def test_nothing_is_read_from_the_environment_per_saved_tensor(monkeypatch):
    """``MEMOPT_CODEC`` is read once, at import: packing and unpacking read no variable."""
    import os

    reads = []

    class Environment(dict):
        def get(self, key, default=None):
            reads.append(key)
            return super().get(key, default)

        def __getitem__(self, key):
            reads.append(key)
            return super().__getitem__(key)

    hooks = CompressionHooks(BitTable(), group_size=256, stochastic=True, min_numel=1)
    monkeypatch.setattr(os, "environ", Environment(os.environ))
    for bits in (8, 4, 2):
        hooks.unpack(hooks.pack(torch.randn(64, 256), bits))
    assert reads == []
