"""memopt's techniques on a CUDA GPU: dropout's one mask, exact recompute, drift that falls with
bits. Skipped without CUDA (the CPU suite covers the same behaviours on the CPU)."""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from examples.models import gpt
from memopt_plugins import MemoryOptimizer, plan_recompute
from memopt_plugins.dropout import MemoryDropout
from memopt_plugins.tree import map_tensors, slice_batch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before CUDA)
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def gpt_on_cuda():
    """The examples' 4-block GPT on CUDA, with its batch and loss."""
    model, batch, loss_fn = gpt()
    return model.cuda().train(), map_tensors(lambda t: t.cuda(), batch), loss_fn


def rel_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``|a - b| / |b|`` over all gradients together."""
    num = sum(float(((a[k] - v).double() ** 2).sum()) for k, v in b.items())
    return (num / sum(float((v.double() ** 2).sum()) for v in b.values())) ** 0.5


def step_gradients(model, batch, loss_fn) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same dropout masks for every configuration
    loss_fn(model, batch).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["bitmask", "regenerate"])
def test_dropout_applies_one_mask_forward_and_backward(mode):
    layer = MemoryDropout(0.3)
    layer.mode = mode
    x = torch.ones(4096, 33, device="cuda", requires_grad=True)
    out = layer(x)
    out.backward(torch.ones_like(out))
    # With x = 1, output and gradient are both mask / (1 - p): one mask, forward and backward.
    assert torch.equal(x.grad, out.detach())
    assert 0.68 < float((out != 0).float().mean()) < 0.72


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.usefixtures("deterministic")
def test_recompute_gives_the_baseline_gradients():
    """The planner at budget 0.5 and checkpointing every block: the baseline's gradients (up to
    float rounding: deterministic algorithms on)."""
    model, batch, loss_fn = gpt_on_cuda()
    exact = step_gradients(model, batch, loss_fn)

    planned, _, _ = gpt_on_cuda()
    opt = MemoryOptimizer({"recompute": {"auto": {"budget": 0.5}}})
    opt.apply(planned)
    plan = plan_recompute(opt, lambda: loss_fn(planned, batch))
    assert plan.chosen
    got = step_gradients(planned, batch, loss_fn)
    opt.remove()
    assert rel_error(got, exact) <= 1e-6

    every, _, _ = gpt_on_cuda()
    blocks = [m for m in every.modules() if type(m).__name__ == "Block"]
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    assert rel_error(step_gradients(every, batch, loss_fn), exact) <= 1e-6


def test_drift_runs_on_cuda_and_falls_as_bits_rise():
    drifts = {}
    for bits in (8, 4, 2):
        model, batch, loss_fn = gpt_on_cuda()
        opt = MemoryOptimizer({"quantize": {"bits": bits}, "drift": {"enabled": True}})
        opt.apply(model)
        sample = slice_batch(batch, 8)
        report = opt.check_drift(functools.partial(loss_fn, model, sample), max_rounds=1)
        drifts[bits] = report.round_max[0]  # before any escalation
        opt.remove()
    assert all(math.isfinite(d) for d in drifts.values())
    assert drifts[8] < drifts[4] < drifts[2]
