"""What the drift check tells its user is true: it compresses what training does whatever the
sample's size, says when it measured nothing, judges by ``sgd`` whatever the loss head, and its
line names what decided."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from zoo import hf_gpt2, hf_llama

from memopt_plugins import MemoryOptimizer
from memopt_plugins.drift.report import SAVES_NOTHING, DriftReport, describe_check


def _mlp_2_bits(drift: dict | None = None):
    """The 64-256-256-10 MLP at 2 bits, batch 32: its activations (32 x 256) are compressed in
    training, the check's 8-sample slices of them (8 x 256) are under ``min_numel``."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    opt = MemoryOptimizer({"quantize": {"bits": 2}, "drift": {"enabled": True, **(drift or {})}})
    opt.apply(model)
    F.cross_entropy(model(x), y).backward()
    assert opt.metrics()["memopt/compression_ratio"] > 4  # training compresses
    return opt, model, x, y


def _lines(caplog, text: str, level: int = logging.INFO) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "memopt" and r.levelno >= level and text in r.getMessage()
    ]


@pytest.mark.parametrize("closure", [False, True])
def test_a_2_bit_mlp_is_raised_at_the_first_check_whatever_the_sample(caplog, closure):
    """The check compresses the modules training compresses, judged by the training forward's
    sizes: the default 8 samples of a batch of 32 see the 2-bit error and raise bits, through
    ``batch=`` and through a closure told the training batch (as the integrations call it)."""
    opt, model, x, y = _mlp_2_bits()
    with caplog.at_level(logging.INFO, logger="memopt"):
        if closure:
            x8, y8 = x[:8], y[:8]
            report = opt.check_drift(lambda: F.cross_entropy(model(x8), y8), batch_size=32)
        else:
            report = opt.check_drift(lambda m, b: F.cross_entropy(m(b[0]), b[1]), batch=(x, y))
    assert report.escalated and report.total[0] > 0.05
    assert all(new > 2 for _, new in report.escalated.values())
    assert opt.metrics()["memopt/drift_blind"] == 0.0
    assert not _lines(caplog, "measured nothing")
    (line,) = _lines(caplog, "memopt: drift check at step")
    assert "modules raised" in line


def test_the_sample_decides_as_training_does_tensor_by_tensor():
    """Each saved tensor is judged by its size in training: the MLP's input (32 x 64 = 2048
    elements in training, under ``min_numel``) stays uncompressed in the check too, so the first
    Linear saves nothing compression touches there as in training; the 256-wide activations are
    compressed in both."""
    opt, model, x, y = _mlp_2_bits()
    loss = lambda m, b: F.cross_entropy(m(b[0]), b[1])  # noqa: E731
    report = opt.check_drift(loss, batch=(x, y), max_rounds=1)
    assert report.unmeasured["0"] == report.unmeasured[""] == SAVES_NOTHING
    assert set(report.first) == {"1", "2", "3", "4"}


def test_a_check_that_measures_nothing_warns_and_counts(caplog):
    """A closure not told the training batch leaves the sample's own sizes deciding: nothing is
    compressed, and the check says so in a WARNING and ``memopt/drift_blind`` -- no "0.0000", no
    "costs 0.0%" -- and changes no bits."""
    opt, model, x, y = _mlp_2_bits()
    x8, y8 = x[:8], y[:8]
    with caplog.at_level(logging.INFO, logger="memopt"):
        report = opt.check_drift(lambda: F.cross_entropy(model(x8), y8))
    assert not report.escalated and set(opt.bits.values()) == {2}
    (warning,) = _lines(caplog, "measured nothing", logging.WARNING)
    assert "6 of 6 compressed modules" in warning and "batch_size" in warning
    (line,) = _lines(caplog, "memopt: drift check at step")
    assert "0.0000" not in line and "costs 0.0%" not in line and "measured nothing" in line
    metrics = opt.metrics()
    assert metrics["memopt/drift_blind"] == 1.0 and "memopt/drift_max" not in metrics
    assert "measured nothing" in str(report) and report.total == (None, None)
    assert opt.state_dict()["drift"]["blind"] == 1


def _lean(build, ops: bool, bits: int):
    model, ids, loss = build(batch_size=8, seq=32, dim=64, layers=2)
    model.config._attn_implementation = "sdpa"
    with open("configs/lean.yaml") as f:
        config = yaml.safe_load(f)
    if not ops:
        del config["ops"]
    config["quantize"]["bits"] = bits
    opt = MemoryOptimizer(config)
    opt.apply(model)
    model.train()
    return opt, model, ids, loss


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("build", [hf_gpt2, hf_llama])
def test_lean_ops_keep_the_sgd_yardstick(caplog, build, bits):
    """With ``ops.loss: chunked`` the model returns no logits; the check still judges by ``sgd``
    (the sampling noise from the two halves of the sample run on their own) and decides as it
    does without lean ops: 2 bits go up, 4 bits stay."""
    kinds = {}
    for ops in (True, False):
        opt, _, ids, loss = _lean(build, ops, bits)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="memopt"):
            report = opt.check_drift(loss, batch=ids, max_rounds=1)
        assert report.metric == "sgd" and report.total[0] is not None
        assert not _lines(caplog, "judge by cosine")
        (line,) = _lines(caplog, "memopt: drift check at step")
        assert "(sgd, threshold 0.05)" in line
        kinds[ops] = (bool(report.escalated), report.total[0] > 0.05)
    assert kinds[True] == kinds[False] == ((True, True) if bits == 2 else (False, False))


def test_the_no_change_line_says_the_whole_gradient_decided():
    """Under ``sgd`` the whole gradient decides: a module costing more than the threshold on its
    own is shown for reference, not as what the check judged."""
    report = DriftReport(
        3,
        per_module={"fc": 0.158},
        threshold=0.05,
        metric="sgd",
        first={"fc": 0.158},
        parts={"fc": (0.2, 3.0)},
        total=(0.031, 0.031),
    )
    line = describe_check(report, {}, 4)
    assert "no change: the model's gradient costs 3.1% of a step's progress (<= 5%)" in line
    assert "which is what the threshold judges; per-module figures for reference" in line
    assert "largest fc (costs 15.8% of a step's progress" in line
    over = DriftReport(3, per_module={"fc": 0.158}, threshold=0.05, metric="sgd", total=(0.2, 0.2))
    assert "costs 20.0% of a step's progress (> 5%), but no module can go up" in (
        describe_check(over, {}, 4)
    )
    other = DriftReport(3, per_module={"fc": 0.01}, threshold=0.05, metric="cosine")
    assert "no change: every module's drift <= 0.05; largest fc 0.0100" in describe_check(
        other, {}, 4
    )
    held = DriftReport(3, per_module={"fc": 0.2}, threshold=0.05, metric="cosine")
    assert "no change: fc drifts 0.2000 (> 0.05), but no module can go up" in (
        describe_check(held, {}, 4)
    )


class _LossInside(nn.Module):
    """The MLP with its loss computed inside: its output holds no tensor with the samples."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), y)


def test_halves_run_apart_measure_the_noise_the_weighted_halves_do():
    """A loss computed inside the model (no logits out) is judged from the two halves run on
    their own: the same sampling noise, so the same noise scale per module, as weighting the
    halves of the logits. (The costs differ: inside, the model's own code also saves the logits
    compressed.)"""
    found = []
    for inside in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        model = _LossInside(net) if inside else net
        opt = MemoryOptimizer({"quantize": {"bits": 2, "min_numel": 0}})
        opt.apply(model)
        torch.manual_seed(1)
        x, y = torch.randn(7, 64), torch.randint(0, 10, (7,))  # halves of 4 and 3
        loss = (lambda m, b: m(*b)) if inside else (lambda m, b: F.cross_entropy(m(b[0]), b[1]))
        report = opt.check_drift(loss, batch=(x, y), batch_size=32, max_rounds=1)
        assert report.metric == "sgd" and report.total[0] > 0.05
        prefix = "net." if inside else ""
        found.append([report.parts[prefix + f][1] for f in ("0", "2")])
    assert found[1] == pytest.approx(found[0], rel=1e-5)


@pytest.mark.parametrize("most", [1, 2])
def test_a_check_in_pieces_judges_each_piece_at_its_training_size(monkeypatch, most):
    """A check run in pieces (the room the step left, forced) compresses what training does too:
    a piece of ``n`` samples of a batch of 32 has its saves judged at ``32 / n`` times their
    size, so the pieces' 2-bit activations are compressed as the whole sample's are, and the
    same modules are measured and raised."""
    found = {}
    for pieces in (False, True):
        if pieces:
            monkeypatch.setattr("memopt_plugins.engine.piece_samples", lambda *args: most)
        opt, model, x, y = _mlp_2_bits()
        report = opt.check_drift(lambda m, b: F.cross_entropy(m(b[0]), b[1]), batch=(x, y))
        assert not report.blind and report.total[0] > 0.05
        found[pieces] = (set(report.first), set(report.escalated))
    assert found[True] == found[False] == ({"1", "2", "3", "4"}, {"2", "4"})


@pytest.mark.parametrize(("samples", "most"), [(7, 1), (6, 2)])
def test_halves_run_apart_in_pieces_measure_the_noise_the_weighted_halves_do(
    monkeypatch, samples, most
):
    """In pieces, a loss computed inside the model runs each piece's rows of the whole sample's
    two halves on their own (a piece may straddle them): the same sampling noise, so the same
    noise scale per module, as weighting each piece's logits by their half."""
    monkeypatch.setattr("memopt_plugins.engine.piece_samples", lambda *args: most)
    found = []
    for inside in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        model = _LossInside(net) if inside else net
        opt = MemoryOptimizer({"quantize": {"bits": 2, "min_numel": 0}})
        opt.apply(model)
        torch.manual_seed(1)
        x, y = torch.randn(samples, 64), torch.randint(0, 10, (samples,))
        loss = (lambda m, b: m(*b)) if inside else (lambda m, b: F.cross_entropy(m(b[0]), b[1]))
        report = opt.check_drift(loss, batch=(x, y), batch_size=32, max_rounds=1)
        assert report.metric == "sgd" and report.total[0] > 0.05
        prefix = "net." if inside else ""
        found.append([report.parts[prefix + f][1] for f in ("0", "2")])
    assert found[1] == pytest.approx(found[0], rel=1e-5)
