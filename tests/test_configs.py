"""The YAML presets in configs/: each loads, is commented, says what it promises, applies to the
models it is written for (ours and third-party ones), trains a step and cuts retained memory."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from memory import gradients, measure
from torch import nn
from zoo import hf_gpt2, hf_llama, hf_resnet

from examples.models import cnn, gpt
from memopt_plugins import MemOptConfig, MemoryOptimizer

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PRESETS = sorted(p.name for p in CONFIGS.glob("*.yaml"))


pytestmark = pytest.mark.usefixtures("one_thread")


def preset(name: str) -> MemOptConfig:
    return MemOptConfig.from_yaml(CONFIGS / name)


def test_the_presets_the_docs_name_exist():
    assert {
        "int8.yaml",
        "int4_drift.yaml",
        "transformer_selective_recompute.yaml",
        "convnet.yaml",
        "auto_budget.yaml",
        "gpt_int4_auto.yaml",
        "gpt_int8.yaml",
        "lean.yaml",
    } <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_and_is_commented(name):
    text = (CONFIGS / name).read_text()
    config = MemOptConfig.from_yaml(CONFIGS / name)
    assert config != MemOptConfig()  # a preset changes something
    comments = [line for line in text.splitlines() if line.lstrip().startswith("#")]
    assert text.startswith("#"), "a preset opens with a comment saying what it is for"
    assert len(comments) >= 3
    assert MemOptConfig.from_dict(config.to_dict()) == config


def test_presets_say_what_they_promise():
    int8 = preset("int8.yaml")
    assert int8.quantize.bits == 8 and int8.quantize.modules == ("*",)

    int4 = preset("int4_drift.yaml")
    assert int4.quantize.bits == 4 and int4.drift.enabled and int4.drift.ladder[0] == 4
    assert int4.drift.lower  # bits both ways (issue 32)

    megatron = preset("transformer_selective_recompute.yaml")
    assert megatron.recompute.modules == ("*.attn",)

    conv = preset("convnet.yaml")
    assert (conv.batchnorm.mode, conv.dropout.mode, conv.quantize.bits) == ("running", "bitmask", 4)

    auto = preset("auto_budget.yaml")
    assert auto.recompute.auto is not None and auto.recompute.auto.budget == 0.5
    assert auto.quantize.bits == 32

    gpt_auto = preset("gpt_int4_auto.yaml")
    assert gpt_auto.recompute.auto is not None and gpt_auto.quantize.bits == 4
    assert preset("gpt_int8.yaml").quantize.bits == 8

    lean = preset("lean.yaml")
    assert (lean.ops.loss, lean.ops.fuse, lean.quantize.bits) == ("chunked", ("all",), 4)
    assert lean.drift.enabled


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_the_lean_preset_fuses_what_each_causal_lm_has():
    """``fuse: [all]``: both get their MLPs run over chunks of tokens, GPT-2 its tanh-GELU and
    LayerNorms, Llama its RMSNorm (its MLPs' SwiGLU is the lean one), both the chunked loss and
    SDPA attention; what a model lacks is no error."""
    gpt2 = {"lean mlp", "lean gelu", "lean layernorm", "lean loss", "lean attention"}
    for build, expected in (
        (_small_hf_gpt2, gpt2),
        (lambda: hf_llama(batch_size=2, seq=16, dim=32, layers=1), LLAMA_LEAN),
    ):
        model, batch, loss_fn = build()
        opt = MemoryOptimizer(CONFIGS / "lean.yaml")
        opt.apply(model)
        assert {p.lean for p in opt.plan.values() if p.lean} == expected
        loss = loss_fn(model, batch)
        loss.backward()
        assert torch.isfinite(loss) and opt.bits
        opt.remove()
        assert all("forward" not in m.__dict__ for m in model.modules())


LLAMA_LEAN = {"lean loss", "lean rmsnorm", "lean mlp", "lean attention"}


# Which models each preset is written for: ours and a third-party one of the same family.
TRANSFORMERS = [
    "int8.yaml",
    "int4_drift.yaml",
    "transformer_selective_recompute.yaml",
    "auto_budget.yaml",
    "gpt_int4_auto.yaml",
    "gpt_int8.yaml",
]
CONVNETS = ["int8.yaml", "int4_drift.yaml", "convnet.yaml", "auto_budget.yaml"]


def _small_gpt():
    return gpt(batch_size=2, block_size=32)


def _small_hf_gpt2():
    return hf_gpt2(batch_size=2, seq=32, dim=32, layers=1)


def _small_cnn():
    return cnn(batch_size=4, size=16)


def _small_hf_resnet():
    return hf_resnet(batch_size=4, size=32)


@pytest.mark.parametrize(
    "name, build",
    [(n, b) for n in TRANSFORMERS for b in (_small_gpt, _small_hf_gpt2)]
    + [(n, b) for n in CONVNETS for b in (_small_cnn, _small_hf_resnet)],
    ids=lambda v: v if isinstance(v, str) else v.__name__.lstrip("_"),
)
def test_preset_applies_trains_a_step_and_removes_cleanly(name, build):
    model, batch, loss_fn = build()
    keys = list(model.state_dict())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = MemoryOptimizer(CONFIGS / name)
    opt.apply(model)
    for _ in range(2):  # the planner measures on the first step and acts from the second
        loss = loss_fn(model, batch)
        loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    acted = bool(opt.bits) or bool(opt.plan.recomputed)
    assert acted, f"{name} did nothing to {build.__name__}"
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    moved = [k for k, p in model.named_parameters() if not torch.equal(p, before[k])]
    assert len(moved) > len(grads) // 2  # the step trained the patched model
    opt.remove()
    assert _hook_count(model) == 0
    assert list(model.state_dict()) == keys
    # removed exactly: the trained model computes what a plain copy of it computes, bit for bit
    # (a deep copy drops whatever memopt left on the model)
    exact = gradients(copy.deepcopy(model), batch, loss_fn)
    after = gradients(model, batch, loss_fn)
    assert after.keys() == exact.keys()
    assert all(torch.equal(after[k], exact[k]) for k in exact)


def _measured_gpt():
    return gpt(batch_size=4, block_size=64)


def _measured_cnn():
    return cnn(batch_size=16, size=32)


MEASURED = {"gpt": _measured_gpt, "cnn": _measured_cnn}


@pytest.fixture(scope="module")
def baselines():
    return {family: measure(build) for family, build in MEASURED.items()}


# Floors: about 80% of the ratio measured on these models (8 bits ~3.9x, 4 bits ~7.5x, the
# Megatron preset ~8x, the planner at budget 0.5 ~2.1x, the conv-net preset ~7.9x).
@pytest.mark.parametrize(
    "name, family, floor",
    [
        ("int8.yaml", "gpt", 3.0),
        ("int4_drift.yaml", "gpt", 5.5),
        ("transformer_selective_recompute.yaml", "gpt", 5.5),
        ("auto_budget.yaml", "gpt", 1.7),
        ("convnet.yaml", "cnn", 5.5),
    ],
)
def test_preset_cuts_retained_memory(baselines, name, family, floor):
    reading = measure(MEASURED[family], CONFIGS / name)
    ratio = baselines[family].retained / reading.retained
    assert ratio >= floor, f"{name} on {family}: {ratio:.2f}x < {floor}x"
