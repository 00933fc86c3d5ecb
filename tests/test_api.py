"""The engine's calls as a user makes them: one loss-function form everywhere (old forms still
accepted), and bits checked where they are set."""

from __future__ import annotations

import pytest
import torch
from memopt_plugins.callbacks import MemOptCallback
from torch import nn

from memopt_plugins import MemoryOptimizer, plan_recompute
from memopt_plugins.accelerate import MemOptPlugin
from memopt_plugins.loss_fn import takes_model_and_batch
from memopt_plugins.transformers import MemOptTrainerCallback

CONFIG = {"quantize": {"bits": 4, "min_numel": 0}, "drift": {"sample_size": 3}}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))


class Recorder:
    """``loss_fn(model, batch)`` that records what it was called with."""

    def __init__(self) -> None:
        self.models: list[nn.Module] = []
        self.sizes: list[int] = []

    def __call__(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        self.models.append(model)
        self.sizes.append(batch.shape[0])
        return model(batch).square().mean()


# --------------------------------------------------------------------------- set_bits


@pytest.mark.parametrize("bits", [3, 0, 1, 64, True, "4", 4.5])
def test_set_bits_refuses_a_width_at_the_call_naming_every_valid_one(bits):
    opt = MemoryOptimizer(CONFIG)
    opt.apply(mlp())
    with pytest.raises(ValueError, match=r"one of 2, 4, 8, 16 \(half cast\) or 32 \(off\)"):
        opt.set_bits("0", bits)
    assert opt.bits["0"] == 4


@pytest.mark.parametrize("bits", [2, 4, 8, 16, 32])
def test_set_bits_takes_every_width_memopt_stores_at(bits):
    opt = MemoryOptimizer(CONFIG)
    model = opt.apply(mlp())
    opt.set_bits("0", bits)
    model(torch.randn(8, 16)).sum().backward()  # the next forward runs at those bits
    assert opt.bits["0"] == bits


def test_a_state_dict_with_a_bad_width_is_refused_before_apply():
    opt = MemoryOptimizer(CONFIG)
    with pytest.raises(ValueError, match="got 3"):
        opt.load_state_dict({"bits": {"0": 3}})


# --------------------------------------------------------------------------- loss_fn forms


def test_forms_are_told_apart_by_signature():
    sample = torch.zeros(1)
    assert takes_model_and_batch(lambda model, batch: 0)
    assert not takes_model_and_batch(lambda: 0)
    assert not takes_model_and_batch(lambda s=sample: 0)  # a closure binding its sample early
    with pytest.raises(TypeError, match=r"loss_fn\(model, batch\).*got loss_fn\(x\)"):
        takes_model_and_batch(lambda x: 0)


def test_check_drift_runs_loss_fn_on_the_patched_model_and_a_slice_of_the_batch():
    opt = MemoryOptimizer(CONFIG)
    model = opt.apply(mlp())
    loss_fn = Recorder()
    report = opt.check_drift(loss_fn, batch=torch.randn(12, 16), max_rounds=1)
    assert report.per_module
    assert set(loss_fn.sizes) == {3} and all(m is model for m in loss_fn.models)


def test_check_drift_still_takes_a_closure():
    opt = MemoryOptimizer(CONFIG)
    model = opt.apply(mlp())
    sample = torch.randn(3, 16)
    assert opt.check_drift(lambda: model(sample).square().mean(), max_rounds=1).per_module


def test_model_and_batch_form_without_a_batch_says_what_is_missing():
    opt = MemoryOptimizer(CONFIG)
    opt.apply(mlp())
    with pytest.raises(TypeError, match="pass batch="):
        opt.check_drift(Recorder())


def test_plan_recompute_takes_model_and_batch():
    opt = MemoryOptimizer({"recompute": {"auto": {"budget": 0.5}}})
    model = opt.apply(mlp())
    loss_fn = Recorder()
    plan_recompute(opt, loss_fn, batch=torch.randn(5, 16))
    assert loss_fn.sizes and set(loss_fn.sizes) == {5} and loss_fn.models[0] is model


def test_accelerate_plugin_runs_model_and_batch_on_the_patched_model():
    plugin = MemOptPlugin({**CONFIG, "drift": {"sample_size": 3, "check_every": 1}})
    model = plugin.apply(mlp())
    loss_fn = Recorder()
    report = plugin.after_backward(0, loss_fn, torch.randn(12, 16))
    assert report is not None and set(loss_fn.sizes) == {3}
    assert all(m is model for m in loss_fn.models)
    sample = torch.randn(3, 16)  # the closure form, as before
    assert plugin.after_backward(1, lambda: model(sample).square().mean()) is not None


@pytest.mark.parametrize("callback", [MemOptCallback, MemOptTrainerCallback])
def test_integrations_refuse_a_loss_fn_of_neither_form_when_built(callback):
    callback(CONFIG, loss_fn=lambda model, batch: 0)
    callback(CONFIG, loss_fn=lambda: 0)
    with pytest.raises(TypeError, match=r"loss_fn\(model, batch\)"):
        callback(CONFIG, loss_fn=lambda model, batch, extra: 0)


# ------------------------------------------------------------------ check_drift(if_due=True)
@pytest.mark.parametrize("pass_step", [True, False])
def test_check_drift_if_due_checks_once_per_optimizer_step_under_accumulation(pass_step):
    """Four micro-batches per optimizer step call it four times with the same step: one check
    at each step that is due (check_every 2: steps 0 and 2 of 0..3)."""
    opt = MemoryOptimizer({**CONFIG, "drift": {"sample_size": 3, "check_every": 2}})
    model = opt.apply(mlp())
    checks = []
    for step in range(4):
        for _ in range(4):
            model(torch.randn(12, 16)).square().mean().backward()
            given = step if pass_step else None
            report = opt.check_drift(Recorder(), batch=torch.randn(12, 16), step=given, if_due=True)
            checks.append(report is not None)
        opt.count_step()
    once = [True, False, False, False]
    assert checks == once + [False] * 4 + once + [False] * 4
    assert [h["step"] for h in opt._drift.history] == [0, 2]
