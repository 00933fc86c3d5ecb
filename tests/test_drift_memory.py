"""A drift check's memory: streamed gradients, never a second set of them; passes in pieces."""

from __future__ import annotations

import pytest
import torch
from memory import peak_above_start
from torch import nn

from memopt_plugins import MemoryOptimizer
from memopt_plugins.drift.passes import SKETCH, cut_sample, fold
from memopt_plugins.tree import slice_batch


def test_check_costs_at_most_a_tenth_of_the_parameters_above_the_training_step():
    """An MLP whose parameters (32 MiB) dwarf its activations: a training step's backward holds
    the gradients; the check after it (as the integrations run it) adds at most 10% of the
    parameters' bytes on top, where keeping its exact and compressed gradients took 2x."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(32) for m in (nn.Linear(512, 512), nn.ReLU())])
    x = torch.randn(16, 512)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = MemoryOptimizer({"quantize": {"bits": 4}, "drift": {"metric": "sgd"}})
    opt.apply(model)
    sample = slice_batch(x, 8)

    def step() -> None:
        model(x).square().mean().backward()

    step()  # warm-up: the codec's tables, the allocator's first blocks
    model.zero_grad(set_to_none=True)
    step_peak, after_step = peak_above_start(step)
    assert after_step >= params  # the gradients are held when the check runs
    check_peak, _ = peak_above_start(lambda: opt.check_drift(lambda: model(sample).square().mean()))
    assert after_step + check_peak <= step_peak + 0.10 * params, (step_peak, check_peak, params)


def test_check_on_a_transformer_peaks_no_higher_than_the_int4_step_it_guards():
    """GPT-2 (transformers, SDPA attention, 4 layers x 256, 16 x 64 tokens) at 4 bits, checked
    after the backward with the default drift section (8 samples): the activations dominate,
    so an exact pass over the whole sample held more than the compressed step (1.7x its peak);
    run in pieces of what the step kept, every pass stays under it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=256, n_layer=4, n_head=4)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = GPT2LMHeadModel(config)
    x = torch.randint(0, 256, (16, 64))

    def loss_fn(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = m(batch).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    opt = MemoryOptimizer({"quantize": {"bits": 4}})
    opt.apply(model)

    def step() -> None:
        loss_fn(model, x).backward()

    step()  # warm-up
    model.zero_grad(set_to_none=True)
    step_peak, _ = peak_above_start(step)
    check_peak, _ = peak_above_start(lambda: opt.check_drift(loss_fn, batch=x))
    assert check_peak <= 1.10 * step_peak, (check_peak, step_peak)


def test_a_sample_is_cut_in_equal_pieces_unless_batchnorm_mixes_its_samples():
    """Pieces of at most ``most`` samples whose count divides the sample's; tensors without the
    samples along dim 0 stay whole; a BatchNorm in training mode keeps the sample whole."""
    seen = []
    sample = {"x": torch.arange(6.0).view(6, 1), "pos": torch.arange(3)}
    pieces = cut_sample(lambda m, b: seen.append(b) or torch.zeros(()), nn.Linear(1, 1), sample, 4)
    for piece in pieces:
        piece()
    assert [b["x"].flatten().tolist() for b in seen] == [[0, 1, 2], [3, 4, 5]]
    assert all(torch.equal(b["pos"], sample["pos"]) for b in seen)
    bn = nn.Sequential(nn.Linear(1, 1), nn.BatchNorm1d(1))
    assert len(cut_sample(lambda m, b: torch.zeros(()), bn, sample, 2)) == 1
    assert len(cut_sample(lambda m, b: torch.zeros(()), bn.eval(), sample, 2)) == 3


def test_fold_estimates_norms_of_differences_within_its_stated_error():
    """Folded gradients: the squared norm exact, a difference's within ~3 standard errors
    (sqrt(2 / SKETCH) relative), with the same signs in every fold of one target."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(300_000, generator=g)
    b = a + 0.1 * torch.randn(300_000, generator=g)
    fa, sq = fold(a, 7)
    fb, _ = fold(b, 7)
    assert fa.numel() == SKETCH
    assert sq == pytest.approx(float(a.double().square().sum()), rel=1e-12)
    true = float((a - b).double().square().sum())
    assert abs(float((fa - fb).square().sum()) / true - 1) < 3 * (2 / SKETCH) ** 0.5
    small = torch.randn(100, generator=g)
    assert torch.equal(fold(small, 0)[0], small.double())  # kept whole
