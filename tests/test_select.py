"""Module globs name the model the user wrote, wherever a framework wraps it (Lightning's
``model.``, PEFT's ``base_model.model.``, DDP's ``module.``, torch.compile's ``_orig_mod.``); a
glob that matches nothing is an error unless its section says ``optional: true``."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
from memopt_plugins.callbacks import MemOptCallback
from torch import nn
from zoo import hf_gpt2, hf_llama

from memopt_plugins import ConfigError, MemOptConfig, MemoryOptimizer
from memopt_plugins.select import fqn_matches, unwrapped_names

pytestmark = pytest.mark.usefixtures("one_thread")


class GPT2Module(pl.LightningModule):
    """A Hugging Face GPT-2 built from a config, held at ``self.model``."""

    def __init__(self):
        super().__init__()
        self.model, self.batch, self.loss_fn = hf_gpt2(batch_size=2, seq=16, dim=32, layers=2)

    def training_step(self, batch, batch_idx):
        return self.loss_fn(self.model, batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class PeftLike(nn.Module):
    """PEFT's attribute path: ``PeftModel.base_model`` (a tuner) ``.model`` (the user's)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.base_model = nn.Module()
        self.base_model.model = model

    def forward(self, **inputs):
        return self.base_model.model(**inputs)


def test_leading_wrapper_attributes_are_dropped_and_nothing_else():
    assert unwrapped_names("base_model.model.lm_head") == [
        "base_model.model.lm_head",
        "model.lm_head",
        "lm_head",
    ]
    assert unwrapped_names("module._orig_mod.blocks.0") == [
        "module._orig_mod.blocks.0",
        "_orig_mod.blocks.0",
        "blocks.0",
    ]
    assert unwrapped_names("transformer.h.0.model") == ["transformer.h.0.model"]
    assert fqn_matches("model.transformer.h.1.mlp", ["transformer.h.*.mlp"])
    assert not fqn_matches("model.transformer.h.1.mlp", ["h.*.mlp"])  # only wrappers drop


def _heads(bits: dict[str, int]) -> list[str]:
    return [f for f in bits if f.endswith("lm_head")]


def test_user_globs_match_a_hf_model_inside_a_lightning_module():
    module = GPT2Module()
    config = {
        "quantize": {
            "bits": 4,
            "exclude": ["lm_head"],
            "overrides": {"transformer.h.0.mlp": 8},
        },
        "recompute": {"modules": ["transformer.h.1.attn"]},
    }
    opt = MemoryOptimizer(config)
    opt.apply(module)
    assert _heads(opt.bits) == [] and opt.bits["model.transformer.h.0.mlp"] == 8
    assert opt.plan.recomputed == ("model.transformer.h.1.attn",)
    opt.remove()


def test_lightning_fit_with_a_glob_written_for_the_hf_model(tmp_path):
    module = GPT2Module()
    memopt = MemOptCallback({"quantize": {"bits": 8, "exclude": ["lm_head"]}})
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(module.batch), 2)
    trainer = pl.Trainer(
        callbacks=[memopt], accelerator="cpu", max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, loader)
    assert memopt.bits and _heads(memopt.bits) == []  # the bits the fit ended with


def test_user_globs_match_a_model_under_peft_attribute_path():
    model, batch, loss_fn = hf_llama(batch_size=2, seq=16, dim=32, layers=2)
    wrapped = PeftLike(model)
    opt = MemoryOptimizer({"quantize": {"bits": 4, "exclude": ["lm_head", "model.norm"]}})
    opt.apply(wrapped)
    assert _heads(opt.bits) == []
    assert "base_model.model.model.norm" not in opt.bits
    assert "base_model.model.model.layers.0.mlp" in opt.bits
    wrapped(input_ids=batch, labels=batch).loss.backward()


def test_a_users_typo_stays_an_error_with_the_name_it_meant():
    with pytest.raises(ConfigError, match=r"'lm_hed' matches no module.*Did you mean 'lm_head'"):
        MemoryOptimizer({"quantize": {"bits": 4, "exclude": ["lm_hed"]}}).apply(GPT2Module())


def _skipped(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]


def test_a_glob_matching_nothing_is_an_error_unless_its_section_is_optional(caplog):
    model, _, _ = hf_llama(batch_size=2, seq=16, dim=32, layers=1)  # self_attn, no *.attn
    mine = {"recompute": {"modules": ["*.attn"]}, "quantize": {"bits": 8}}
    with pytest.raises(ConfigError, match=r"recompute.modules: '\*.attn' matches no module"):
        MemoryOptimizer(mine).apply(model)
    assert all("forward" not in m.__dict__ for m in model.modules())  # refused before patching
    optional = {**mine, "recompute": {"modules": ["*.attn", "*.mlp"], "optional": True}}
    with caplog.at_level(logging.INFO, logger="memopt"):
        opt = MemoryOptimizer(optional)
        opt.apply(model)
    assert _skipped(caplog) == [
        "memopt: recompute.modules '*.attn' matches no module of this model: skipped "
        "(recompute.optional is true)"
    ]
    assert opt.plan.recomputed == ("model.layers.0.mlp",) and opt.bits  # the rest applied
    opt.remove()


def test_optional_covers_class_names_and_quantize_globs_in_its_own_section_only(caplog):
    model, _, _ = hf_llama(batch_size=2, seq=16, dim=32, layers=1)
    config = {
        "recompute": {"types": ["GELU", "LlamaMLP"], "optional": True},
        "quantize": {"bits": 4, "exclude": ["lm_hed", "lm_head"], "optional": True},
    }
    with caplog.at_level(logging.INFO, logger="memopt"):
        opt = MemoryOptimizer(config)
        opt.apply(model)
    lines = _skipped(caplog)
    assert len(lines) == 2
    assert "recompute.types 'GELU' matches no module class" in lines[0]
    assert "quantize.exclude 'lm_hed'" in lines[1] and "(quantize.optional is true)" in lines[1]
    assert opt.plan.recomputed == ("model.layers.0.mlp",) and "lm_head" not in opt.bits
    opt.remove()
    # recompute's optional says nothing about quantize's globs
    strict = {**config, "quantize": {"bits": 4, "exclude": ["lm_hed"]}}
    with pytest.raises(ConfigError, match="quantize.exclude: 'lm_hed' matches no module"):
        MemoryOptimizer(strict).apply(model)


def test_the_presets_optional_is_in_its_settings_and_a_copy_means_the_same(caplog):
    """What a preset's glob means is written in the preset (``optional: true``), not decided by
    where the config came from: its settings as a dict behave the same, and without the
    marker the glob is an error."""
    model, _, _ = hf_llama(batch_size=2, seq=16, dim=32, layers=1)
    preset = MemOptConfig.from_preset("transformer_selective_recompute")
    assert preset.recompute.optional
    for config in (preset, preset.to_dict()):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="memopt"):
            opt = MemoryOptimizer(config)
            opt.apply(model)
        assert opt.plan.recomputed == () and opt.bits  # the rest of the preset applied
        (line,) = _skipped(caplog)
        assert "recompute.modules '*.attn'" in line
        opt.remove()
    strict = preset.with_changes(recompute={"optional": False})
    with pytest.raises(ConfigError, match=r"recompute.modules: '\*.attn' matches no module"):
        MemoryOptimizer(strict).apply(model)
    # a glob added to a section the preset leaves strict is an error
    mine = preset.with_changes(quantize={"exclude": ["lm_hed"]})
    with pytest.raises(ConfigError, match="lm_hed"):
        MemoryOptimizer(mine).apply(model)


def test_user_globs_match_a_peft_lora_model():
    peft = pytest.importorskip("peft")
    model, batch, loss_fn = hf_gpt2(batch_size=2, seq=16, dim=32, layers=1)
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    )
    opt = MemoryOptimizer({"quantize": {"bits": 4, "exclude": ["lm_head", "transformer.h.*.mlp"]}})
    opt.apply(lora)
    assert "base_model.model.transformer.h.0.attn" in opt.bits
    assert _heads(opt.bits) == [] and not [f for f in opt.bits if ".mlp" in f]
    loss_fn(lora, batch).backward()
    opt.remove()


# --------------------------------------------------------------------------- containers
class Experts(nn.Module):
    """A block whose experts sit in a ModuleList (an MoE layer; T5's ``layer`` list alike)."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        return sum(torch.tanh(e(x)) for e in self.experts)


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Experts() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_blocks_glob_recomputes_the_blocks_whatever_lists_they_hold():
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(4, 8)
    model(x).square().sum().backward()
    exact = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    opt = MemoryOptimizer({"recompute": {"modules": ["blocks.*"]}})
    opt.apply(model)
    assert opt.plan.recomputed == ("blocks.0", "blocks.1", "blocks.2")
    model(x).square().sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), exact, strict=True))
    opt.remove()


def test_blocks_glob_recomputes_every_block_of_a_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=32,
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=2,
        num_heads=2,
        decoder_start_token_id=0,
    )
    model = T5ForConditionalGeneration(config)
    opt = MemoryOptimizer({"recompute": {"modules": ["encoder.block.*", "decoder.block.*"]}})
    opt.apply(model)
    assert opt.plan.recomputed == tuple(
        f"{stack}.block.{i}" for stack in ("encoder", "decoder") for i in range(2)
    )
    opt.remove()


@pytest.mark.parametrize("named", ["blocks", "blocks.1.experts"])
def test_a_list_named_alone_is_refused_with_a_glob_that_selects_its_elements(named):
    model = Blocks()
    with pytest.raises(ConfigError, match="never called") as error:
        MemoryOptimizer({"recompute": {"modules": [named]}}).apply(model)
    advice = str(error.value).split("e.g. ")[1].strip("'")
    opt = MemoryOptimizer({"recompute": {"modules": [advice]}})
    opt.apply(model)
    elements = [f"{named}.{i}" for i in range(len(model.get_submodule(named)))]
    assert list(opt.plan.recomputed) == elements
    opt.remove()


def test_a_list_named_with_only_some_of_its_elements_is_refused():
    with pytest.raises(ConfigError, match="'blocks' is a ModuleList, which is never called"):
        MemoryOptimizer({"recompute": {"modules": ["blocks", "blocks.0"]}}).apply(Blocks())
