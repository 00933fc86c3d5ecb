"""Copies of a patched model (deepcopy: EMA, SWA; pickling: torch.save) are plain models."""

import copy
import io

import pytest
import torch
from memory import gradients, rel_error
from torch.optim.swa_utils import AveragedModel

from examples.models import cnn, gpt
from memopt_plugins import MemoryOptimizer

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = {
    "quantize": (gpt, {"quantize": {"bits": 2, "modules": ["*"]}}),
    "dropout": (gpt, {"dropout": {"mode": "bitmask"}}),
    "recompute": (gpt, {"recompute": {"modules": ["blocks.*"]}}),
    "batchnorm": (cnn, {"batchnorm": {"mode": "running", "warmup_steps": 0}}),
    "everything": (
        cnn,
        {
            "quantize": {"bits": 2, "modules": ["*"]},
            "recompute": {"modules": ["layer1"]},
            "dropout": {"mode": "regenerate"},
            "batchnorm": {"mode": "running", "warmup_steps": 0},
        },
    ),
}


def _small(factory):
    model, batch, loss_fn = factory(batch_size=4, **({"block_size": 32} if factory is gpt else {}))
    return model, batch, loss_fn


def _reference(model):
    """An unpatched model with the weights and buffers of ``model``."""
    plain, _, _ = _small(gpt if type(model).__name__ == "GPT" else cnn)
    plain.load_state_dict(model.state_dict())
    return plain


@pytest.mark.parametrize("case", CASES)
def test_a_deep_copy_is_a_plain_model_and_the_original_stays_patched(case):
    factory, config = CASES[case]
    model, batch, loss_fn = _small(factory)
    opt = MemoryOptimizer(config)
    opt.apply(model)
    loss_fn(model, batch).backward()  # patched state in use (plans, counters, packed tensors)
    model.zero_grad(set_to_none=True)

    twin = copy.deepcopy(model)

    assert twin.state_dict().keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(twin.state_dict()[key], value), key
    # The copy computes what an unpatched model with its weights computes, bit for bit ...
    exact = gradients(_reference(model), batch, loss_fn)
    copied = gradients(twin, batch, loss_fn)
    assert copied.keys() == exact.keys()
    for key in exact:
        assert torch.equal(copied[key], exact[key]), key
    # ... with its own parameters: changing them changes its gradient, not the original's weights.
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    first = next(iter(exact))
    assert not torch.equal(gradients(twin, batch, loss_fn)[first], exact[first])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # The original is still patched: compression still perturbs its gradient, and remove works.
    if "quantize" in config:
        assert rel_error(gradients(model, batch, loss_fn), exact) > 1e-3
    opt.remove()
    assert torch.equal(
        gradients(model, batch, loss_fn)[next(iter(exact))], exact[next(iter(exact))]
    )
    # A copy can be patched on its own.
    MemoryOptimizer(config).apply(twin).train()
    loss_fn(twin, batch).backward()


def test_swa_averaged_model_of_a_patched_model_is_plain_and_updates():
    model, batch, loss_fn = _small(cnn)
    MemoryOptimizer(CASES["everything"][1]).apply(model)
    average = AveragedModel(model)
    loss_fn(model, batch).backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    average.update_parameters(model)
    copied = average.module
    # the average computes what an unpatched model with its weights computes, bit for bit
    exact = gradients(_reference(copied), batch, loss_fn)
    averaged = gradients(copied, batch, loss_fn)
    assert averaged.keys() == exact.keys()
    for key in exact:
        assert torch.equal(averaged[key], exact[key]), key


@pytest.mark.parametrize("case", CASES)
def test_a_pickled_patched_model_loads_as_a_plain_model(case):
    factory, config = CASES[case]
    model, batch, loss_fn = _small(factory)
    MemoryOptimizer(config).apply(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    exact = gradients(_reference(model), batch, loss_fn)
    restored = gradients(loaded, batch, loss_fn)
    for key in exact:
        assert torch.equal(restored[key], exact[key]), key
