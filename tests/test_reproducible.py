"""Runs that reproduce: seeded codec noise, and a drift check that leaves every RNG stream be."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn
from zoo import hf_gpt2

from memopt_plugins import MemoryOptimizer
from memopt_plugins.tree import slice_batch


def _train(config: dict, steps: int = 3, checks: bool = False, build=None):
    """``steps`` SGD steps on a fresh model after ``torch.manual_seed(7)``; the parameters."""
    torch.manual_seed(7)
    model, batch, loss_fn = (build or _gpt2)()
    opt = MemoryOptimizer(config)
    opt.apply(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    reports = []
    for _ in range(steps):
        sgd.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        if checks and opt.internal.should_check():
            reports.append(opt.check_drift(lambda: loss_fn(model, slice_batch(batch, 4))))
        sgd.step()
        opt.count_step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), reports


def _gpt2():
    model, batch, loss_fn = hf_gpt2(batch_size=2, seq=32, layers=1, seed=torch.initial_seed())
    return model, batch, loss_fn


INT4 = {"quantize": {"bits": 4}, "drift": {"enabled": False}}


def test_two_seeded_int4_runs_in_one_process_end_with_identical_parameters():
    first, _ = _train(INT4)
    second, _ = _train(INT4)
    assert torch.equal(first, second)


def test_codec_seed_changes_the_noise_and_never_the_global_rng():
    a, _ = _train({**INT4, "quantize": {"bits": 4, "seed": 1}})
    b, _ = _train({**INT4, "quantize": {"bits": 4, "seed": 2}})
    assert (a - b).abs().max() > 1e-6  # a different seed: different rounding noise
    torch.manual_seed(3)
    model, batch, loss_fn = _gpt2()
    MemoryOptimizer({"quantize": {"bits": 4}}).apply(model)
    state = torch.get_rng_state()
    loss_fn(model, batch).backward()  # every saved activation quantized stochastically
    assert torch.equal(torch.get_rng_state(), state)


class NumpyMasked(nn.Module):
    """A forward that masks its input with ``np.random`` and adds ``random`` noise, the way
    wav2vec2's time masking draws its spans (a third-party habit the check must survive)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 128)
        self.act = nn.GELU()
        self.out = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.from_numpy(np.random.rand(*x.shape) > 0.5).to(x.dtype)
        return self.out(self.act(self.inp(x * keep * (1 + random.random()))))


def _numpy_masked():
    model = NumpyMasked()
    x, y = torch.randn(64, 64), torch.randint(0, 4, (64,))
    return model, (x, y), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])


def test_numpy_masked_forward_has_no_false_drift_and_checks_change_no_training():
    config = {"quantize": {"bits": 8, "min_numel": 1}, "drift": {"metric": "cosine"}}
    np.random.seed(0)
    random.seed(0)
    checked = {**config, "drift": {"metric": "cosine", "check_every": 1}}
    on, reports = _train(checked, checks=True, build=_numpy_masked)
    after = (np.random.get_state()[1].copy(), random.getstate())
    np.random.seed(0)
    random.seed(0)
    off, _ = _train(config, build=_numpy_masked)
    assert len(reports) == 3 and all(0 < r.max <= 0.05 and not r.escalated for r in reports)
    assert torch.equal(on, off)
    assert np.array_equal(after[0], np.random.get_state()[1]) and after[1] == random.getstate()
