"""Drift check: escalation bar on Llama, selectivity, exact formulas, non-interference, state."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from memory import gradients
from torch import nn
from transformers import BatchEncoding
from zoo import hf_gpt2, hf_llama, hf_resnet

from memopt_plugins import MemoryOptimizer
from memopt_plugins.config import ConfigError, DriftConfig
from memopt_plugins.drift.judges import Drifts
from memopt_plugins.drift.monitor import DriftMonitor
from memopt_plugins.drift.report import HISTORY_LIMIT, NEGLIGIBLE_GRADIENT, SAVES_NOTHING, next_rung
from memopt_plugins.drift.request import CheckSample, CompressionFace, DriftCheck
from memopt_plugins.tree import batch_size_of, slice_batch


def patched(build, config: dict, **size):
    model, batch, loss_fn = build(**size)
    opt = MemoryOptimizer(config)
    opt.apply(model)
    return opt, model, (lambda: loss_fn(model, batch))


# --------------------------------------------------------------------------- the bar
def test_llama_from_2_bits_settles_within_8_rounds(caplog):
    """One rung per call: escalation stops by round 8 with the model's drift <= 0.05."""
    opt, _, loss = patched(hf_llama, {"quantize": {"bits": 2}, "drift": {"threshold": 0.05}})
    start = opt.bits
    assert set(start.values()) == {2}
    reports = []
    with caplog.at_level(logging.INFO, logger="memopt"):
        for _ in range(8):
            reports.append(opt.check_drift(loss, max_rounds=1))
            if not reports[-1].escalated:
                break
    final = reports[-1]
    assert final.escalated == {} and len(reports) <= 8
    assert final.total[1] <= 0.05  # sgd judges the model's gradient as a whole
    assert reports[0].total[0] > 0.5 and reports[0].max > 0.5  # 2 bits really drifted
    # every escalation is one rung up the ladder, and each check has one INFO line naming its
    # moves, from what to what, and the largest drift before and after
    moves = [(f, o, n) for r in reports for f, (o, n) in r.escalated.items()]
    assert moves and all(n == next_rung((2, 4, 8, 16, 32), o) for _, o, n in moves)
    assert len(moves) == opt.metrics()["memopt/escalations"]
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "memopt" and "drift check" in r.getMessage()
    ]
    assert len(lines) == len(reports)
    for report, line in zip(reports, lines, strict=True):
        assert "(sgd, threshold 0.05)" in line
        named = [
            f for f, (o, n) in report.escalated.items() if f"{f or '<root>'} {o} -> {n} (" in line
        ]
        assert len(named) == min(len(report.escalated), 8)  # the line names 8, counts the rest
        if report.escalated:
            assert f"{len(report.escalated)} of {len(opt.bits)} modules raised" in line
            assert f"largest drift {report.round_max[0]:.4f} -> {report.max:.4f}" in line
    # modules that save nothing compression touches keep their bits: nothing to give up there
    for fqn in ("model.layers", "model.layers.0", "model.rotary_emb"):
        assert final.unmeasured[fqn] == SAVES_NOTHING and opt.bits[fqn] == 2


def test_default_check_rechecks_until_settled_in_one_call():
    config = {"quantize": {"bits": 2}, "drift": {"metric": "rel_l2"}}
    opt, _, loss = patched(hf_llama, config, batch_size=2)
    report = opt.check_drift(loss)
    assert report.round_max[0] > 1.0 and report.max <= 0.05
    assert report.rounds >= 3  # 2 -> 4 -> 8, then a round that escalates nothing
    moves = list(report.escalated.values())  # (bits before the call, bits after it)
    assert all(old == 2 and new >= 4 for old, new in moves)
    assert sum(new >= 8 for _, new in moves) > len(moves) / 2  # several rungs in one call
    again = opt.check_drift(loss)
    assert again.escalated == {} and again.rounds == 1


def test_escalation_is_selective():
    """Only the 2-bit modules climb; the 8-bit ones around them keep their bits."""
    config = {
        "quantize": {"bits": 8, "overrides": {"*.down_proj": 2}},
        "drift": {"metric": "rel_l2"},
    }
    opt, _, loss = patched(hf_llama, config)
    before = opt.bits
    report = opt.check_drift(loss, max_rounds=1)
    down = {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}
    assert report.escalated == dict.fromkeys(down, (2, 4))
    assert all(report.per_module[f] > 1.0 for f in down)
    others = {f: d for f, d in report.per_module.items() if f not in down}
    assert len(others) >= 20 and max(others.values()) < 0.05
    assert {f: b for f, b in opt.bits.items() if f not in down} == {
        f: b for f, b in before.items() if f not in down
    }


# --------------------------------------------------------------------------- what is measured
def _manual_drift(opt, model, batch, loss_fn, fqn, metric):
    """Drift of one module computed by hand (deterministic rounding, no dropout)."""
    module = dict(model.named_modules())[fqn]
    own = list(module.parameters(recurse=False))
    inputs: list[torch.Tensor] = []
    handle = module.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
    grads = []
    for exact in (True, False):
        inputs.clear()
        if exact:
            with opt.internal.hooks.suspend():
                loss = loss_fn(model, batch)
        else:
            loss = loss_fn(model, batch)
        targets = own or inputs
        grads.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, targets)]))
    handle.remove()
    g, q = (x.double() for x in grads)
    if metric == "cosine":
        return float(1 - (g @ q) / (g.norm() * q.norm()))
    return float((q - g).norm() / g.norm())


@pytest.fixture
def unfolded(monkeypatch):
    """Gradients kept whole in the check (no fold): its formulas are then exact."""
    monkeypatch.setattr("memopt_plugins.drift.passes.SKETCH", 1 << 40)


@pytest.mark.parametrize("metric", ["rel_l2", "cosine"])
def test_drift_matches_hand_computation(metric, unfolded):
    """Own-parameter drift for a Conv1D, input-gradient drift for the parameter-free GELU."""
    model, batch, loss_fn = hf_gpt2(batch_size=2, seq=64, layers=1)
    config = {
        "quantize": {"bits": 4, "rounding": "nearest"},
        "drift": {"metric": metric, "threshold": 1.0},  # nothing escalates before the hand check
    }
    opt = MemoryOptimizer(config)
    opt.apply(model)
    report = opt.check_drift(lambda: loss_fn(model, batch), max_rounds=1)
    for fqn in ("transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.act"):
        expected = _manual_drift(opt, model, batch, loss_fn, fqn, metric)
        assert expected > 1e-4
        assert report.per_module[fqn] == pytest.approx(expected, rel=1e-6)


def test_noise_drift_matches_the_two_halves_computed_by_hand(unfolded):
    """noise = |g_q - g|^2 / (|g_A - g_B|^2 / 4): the sign-weighted pass equals two half passes."""
    model, batch, loss_fn = hf_gpt2(batch_size=4, seq=32, layers=1)
    config = {"quantize": {"bits": 4, "rounding": "nearest"}}
    opt = MemoryOptimizer({**config, "drift": {"metric": "noise", "threshold": 1.0}})
    opt.apply(model)
    report = opt.check_drift(lambda: loss_fn(model, batch), max_rounds=1)
    fc = model.transformer.h[0].mlp.c_fc
    own = list(fc.parameters())

    def grad(part, exact=True):
        with opt.internal.hooks.suspend() if exact else contextlib.nullcontext():
            loss = loss_fn(model, part)
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, own)]).double()

    g, q = grad(batch), grad(batch, exact=False)
    halves = grad(batch[:2]) - grad(batch[2:])
    expected = float((q - g).square().sum() / (halves.square().sum() / 4))
    assert expected > 1e-3
    assert report.per_module["transformer.h.0.mlp.c_fc"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("metric", ["sgd", "noise", "rel_l2"])
def test_a_check_that_changes_nothing_runs_one_exact_and_one_compressed_pass(metric):
    """Given the training batch, the exact pass runs the sample's two halves as its pieces and
    measures the gradient's sampling variance from them (metrics sgd and noise): a check that
    changes nothing forwards its sample twice, exact and compressed. A closure, which cannot be
    cut, needs a pass of its own for the variance: three times."""
    model, batch, loss_fn = hf_gpt2(batch_size=16, seq=32, layers=1)
    opt = MemoryOptimizer({"quantize": {"bits": 8}, "drift": {"metric": metric, "threshold": 1}})
    opt.apply(model)
    forwarded = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: forwarded.append(batch_size_of((args, kwargs))), with_kwargs=True
    )
    sample = opt.config.drift.sample_size
    report = opt.check_drift(loss_fn, batch=batch)
    assert not report.escalated and report.per_module
    assert sum(forwarded) == 2 * sample
    assert forwarded == ([sample // 2] * 4 if metric != "rel_l2" else [sample] * 2)
    forwarded.clear()
    opt.check_drift(lambda: loss_fn(model, batch[:sample]))
    assert sum(forwarded) == (3 if metric != "rel_l2" else 2) * sample


def test_a_check_in_pieces_judges_the_mean_of_the_pieces_gradients(unfolded, monkeypatch):
    """A sample of 4 cut in pieces of 1 (the room the step left, forced): every pass runs the
    pieces, the signed pass weights each piece's rows by their half of the whole sample, and
    noise = |mean q_s - g|^2 / (|g_A - g_B|^2 / 4), the halves spanning pieces; a
    parameter-free module is judged by its pieces' input gradients together (rel_l2)."""
    monkeypatch.setattr("memopt_plugins.engine.piece_samples", lambda *args: 1)
    model, batch, loss_fn = hf_gpt2(batch_size=4, seq=32, layers=1)
    config = {"quantize": {"bits": 4, "rounding": "nearest"}}
    opt = MemoryOptimizer({**config, "drift": {"metric": "noise", "threshold": 1.0}})
    opt.apply(model)
    report = opt.check_drift(loss_fn, batch=batch, max_rounds=1)
    own = list(model.transformer.h[0].mlp.c_fc.parameters())

    def grad(part, exact=True, wrt=own):
        with opt.internal.hooks.suspend() if exact else contextlib.nullcontext():
            loss = loss_fn(model, part)
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, wrt)]).double()

    pieces = [batch[i : i + 1] for i in range(4)]
    g = grad(batch)
    q = sum(grad(p, exact=False) for p in pieces) / 4
    halves = grad(batch[:2]) - grad(batch[2:])
    expected = float((q - g).square().sum() / (halves.square().sum() / 4))
    assert expected > 1e-3
    assert report.per_module["transformer.h.0.mlp.c_fc"] == pytest.approx(expected, rel=1e-5)

    opt.remove()
    opt = MemoryOptimizer({**config, "drift": {"metric": "rel_l2", "threshold": 1.0}})
    opt.apply(model)
    report = opt.check_drift(loss_fn, batch=batch, max_rounds=1)
    inputs = []
    handle = model.transformer.h[0].mlp.act.register_forward_pre_hook(
        lambda m, args: inputs.append(args[0])
    )
    exact, approx = [], []
    for p in pieces:
        for out, flag in ((exact, True), (approx, False)):
            inputs.clear()
            with opt.internal.hooks.suspend() if flag else contextlib.nullcontext():
                loss = loss_fn(model, p)
            out.append(torch.autograd.grad(loss, inputs)[0].flatten().double())
    handle.remove()
    g, q = torch.cat(exact), torch.cat(approx)
    expected = float((q - g).norm() / g.norm())
    assert expected > 1e-4
    assert report.per_module["transformer.h.0.mlp.act"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("batch_size", [None, 64])
def test_sgd_drift_is_the_progress_cost_computed_by_hand(unfolded, batch_size):
    """sgd = e k / (1 + (1 + e) k): e = |g_q - g|^2 / Var(g), k = Var(g) / (|g|^2 - Var(g)) x
    samples / training batch (the gradient noise scale over the batch), or e / (1 + e) when the
    signal does not stand above the noise."""
    model, batch, loss_fn = hf_gpt2(batch_size=4, seq=32, layers=1)
    opt = MemoryOptimizer(
        {"quantize": {"bits": 4, "rounding": "nearest"}, "drift": {"threshold": 1.0}}
    )
    opt.apply(model)
    report = opt.check_drift(lambda: loss_fn(model, batch), max_rounds=1, batch_size=batch_size)
    own = list(model.transformer.h[0].mlp.c_fc.parameters())

    def grad(part, exact=True):
        with opt.internal.hooks.suspend() if exact else contextlib.nullcontext():
            loss = loss_fn(model, part)
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, own)]).double()

    g, q = grad(batch), grad(batch, exact=False)
    variance = float((grad(batch[:2]) - grad(batch[2:])).square().sum() / 4)
    error = float((q - g).square().sum()) / variance
    signal = float(g.square().sum()) - variance
    ratio = 4 / (batch_size or 4)
    k = variance / signal * ratio if signal > 0 else float("inf")
    expected = error / (1 + error) if k == float("inf") else error * k / (1 + (1 + error) * k)
    assert expected > 1e-4
    assert report.per_module["transformer.h.0.mlp.c_fc"] == pytest.approx(expected, rel=1e-5)
    assert report.parts["transformer.h.0.mlp.c_fc"][0] == pytest.approx(error, rel=1e-5)


def test_the_noise_scale_is_the_ratio_of_moving_averages_and_skips_what_is_not_finite():
    """B_noise = EMA(n Var) / EMA(|g|^2 - Var), each averaged from zero with NOISE_DECAY; a
    check whose numbers are not finite is left out; while the averaged signal is not positive
    the last good ratio stands."""
    from memopt_plugins.drift.judges import NOISE_DECAY, NoiseScale

    noise, d = NoiseScale(), NOISE_DECAY
    assert noise.update(norm_sq=5.0, spread=1.0, samples=8) == pytest.approx(8.0 / 4.0)
    assert noise.update(norm_sq=float("inf"), spread=1.0, samples=8) == pytest.approx(2.0)
    assert noise.update(norm_sq=0.5, spread=3.0, samples=8) == pytest.approx(
        (d * (1 - d) * 8 + (1 - d) * 24) / (d * (1 - d) * 4 + (1 - d) * -2.5)
    )
    assert (noise.trace, noise.signal) == pytest.approx(
        (d * (1 - d) * 8 + (1 - d) * 24, d * (1 - d) * 4 + (1 - d) * -2.5)
    )
    good = noise.good
    noise.update(norm_sq=0.0, spread=100.0, samples=8)  # the averaged signal goes negative
    assert noise.signal < 0 and noise.good == good


def test_a_check_whose_noise_scale_is_infinite_raises_nothing_on_it():
    """Check 1 measures a gradient standing above its noise; check 2's sample cancels its own
    mean gradient (each sample's twin with the opposite sign): its noise scale alone is
    negative or infinite, which judged a 2-bit model's cost at e / (1 + e) and raised it. The
    smoothed one, at a training batch far above it, costs nothing: no module moves. Its
    averages survive a state_dict round trip; a negative trace is refused on load."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    drift = {"metric": "sgd", "threshold": 0.005}  # under what 2 bits cost this sample
    opt = MemoryOptimizer({"quantize": {"bits": 2, "min_numel": 0}, "drift": drift})
    opt.apply(model)
    x, target = torch.randn(8, 16), torch.full((8, 4), 5.0)
    first = opt.check_drift(lambda: F.mse_loss(model(x), target), batch_size=10**6)
    assert first.escalated == {} and first.total[0] is not None
    twins, sign = torch.cat([x[:4], x[:4]]), torch.tensor([1.0] * 4 + [-1.0] * 4)
    second = opt.check_drift(
        lambda: (model(twins).sum(1) * sign).mean(), max_rounds=1, batch_size=10**6
    )
    assert second.escalated == {}, second.escalated
    noise = opt._drift.noise
    for f, (_, scale) in second.parts.items():  # each module's smoothed scale over the batch
        good = noise[f].good
        assert scale == (float("inf") if good is None else pytest.approx(good / 10**6))
    assert opt._drift.noise_whole.good is not None  # what the whole gradient was judged by
    state = json.loads(json.dumps(opt.state_dict()))
    other = MemoryOptimizer({"quantize": {"bits": 2}})
    other.load_state_dict(state)
    assert other.state_dict()["drift"]["noise"] == state["drift"]["noise"]
    state["drift"]["noise"]["whole"]["trace"] = -1.0
    with pytest.raises(ConfigError, match="drift.noise"):
        other.load_state_dict(state)


def test_sgd_metric_on_llama_lets_4_bits_through_and_stops_2_bits():
    """The default at 0.05: from 4 bits no module escalates, from 2 bits most do."""
    moved = {}
    for bits in (4, 2):
        opt, _, loss = patched(hf_llama, {"quantize": {"bits": bits}}, batch_size=8)
        report = opt.check_drift(loss, max_rounds=1, batch_size=32)
        moved[bits] = len(report.escalated) / len(report.per_module)
    assert moved[4] == 0.0 and moved[2] >= 0.5, moved


def test_a_check_meeting_a_nan_moves_no_bits_and_warns(caplog):
    """One NaN in one sample's embeddings: every module's gradient is not finite, so none is
    judged, no bits move, one WARNING names them and memopt/drift_skipped counts them."""
    for metric in ("sgd", "cosine", "rel_l2"):
        model, batch, loss_fn = hf_llama(batch_size=4)
        opt = MemoryOptimizer({"quantize": {"bits": 4}, "drift": {"metric": metric}})
        opt.apply(model)
        before = opt.bits
        embed = model.model.embed_tokens
        handle = embed.register_forward_hook(
            lambda m, args, out: out.index_put((torch.tensor([1]),), torch.tensor(float("nan")))
        )
        with caplog.at_level(logging.WARNING, logger="memopt"):
            caplog.clear()
            report = opt.check_drift(lambda m=model, b=batch, f=loss_fn: f(m, b))
        handle.remove()
        assert opt.bits == before and report.escalated == {} and report.per_module == {}
        assert report.skipped and set(report.skipped) <= set(report.unmeasured)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "not finite" in warnings[0].getMessage()
        assert opt.metrics()["memopt/drift_skipped"] == len(report.skipped)


def test_noise_metric_on_llama_lets_4_bits_through_and_stops_2_bits():
    """At 0.05: from 4 bits at most half the measured modules escalate, from 2 bits most do."""
    moved = {}
    for bits in (4, 2):
        config = {"quantize": {"bits": bits}, "drift": {"metric": "noise", "threshold": 0.05}}
        opt, _, loss = patched(hf_llama, config, batch_size=8)
        report = opt.check_drift(loss, max_rounds=1)
        moved[bits] = len(report.escalated) / len(report.per_module)
    assert moved[4] <= 0.5 and moved[2] >= 0.5, moved


def test_noise_metric_needs_two_samples():
    model, batch, loss_fn = hf_gpt2(batch_size=1, seq=32, layers=1)
    opt = MemoryOptimizer({"quantize": {"bits": 4}, "drift": {"metric": "noise"}})
    opt.apply(model)
    with pytest.raises(ValueError, match="two halves of the sample"):
        opt.check_drift(lambda: loss_fn(model, batch))


def test_key_bias_trap_module_is_measured_as_a_whole():
    """The key bias's exact gradient is ~0 (softmax ignores a shared shift): its own relative
    error is huge, but the module drift over weight and bias together stays small at 8 bits."""
    model, batch, loss_fn = hf_gpt2(batch_size=2, seq=64, layers=1)
    exact = gradients(model, batch, loss_fn)
    approx = gradients(model, batch, loss_fn, {"quantize": {"bits": 8}})
    name = "transformer.h.0.attn.c_attn.bias"
    key = slice(128, 256)
    key_error = (approx[name][key] - exact[name][key]).norm() / exact[name][key].norm()
    assert key_error > 10.0
    opt = MemoryOptimizer({"quantize": {"bits": 8}})
    opt.apply(model)
    report = opt.check_drift(lambda: loss_fn(model, batch), max_rounds=1)
    assert report.per_module["transformer.h.0.attn.c_attn"] < 0.05
    assert report.escalated == {} and 0 < report.max < 0.05


class _Branches(nn.Module):
    """A main path and a side path whose contribution to the loss is scaled by 1e-9."""

    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
        self.side = nn.Linear(64, 64)

    def forward(self, x):
        return self.main(x).sum() + 1e-9 * torch.tanh(self.side(x)).sum()


def test_negligible_exact_gradient_has_no_drift_and_never_escalates():
    model = _Branches()
    x = torch.randn(32, 64)
    opt = MemoryOptimizer({"quantize": {"bits": 2, "min_numel": 0}})
    opt.apply(model)
    report = opt.check_drift(lambda: model(x))
    assert report.unmeasured["side"] == NEGLIGIBLE_GRADIENT
    assert opt.bits["side"] == 2 and "side" not in report.escalated
    assert report.escalated["main.0"][0] == 2  # the main path did drift at 2 bits


def test_custom_ladder_climbs_to_32_and_stops():
    assert [next_rung((2, 8, 32), b) for b in (2, 4, 8, 16, 32)] == [8, 8, 32, 32, 32]
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    x = torch.randn(64, 64)
    config = {
        "quantize": {"bits": 2, "min_numel": 0},
        "drift": {"metric": "rel_l2", "threshold": 1e-9, "ladder": [2, 8, 32]},
    }
    opt = MemoryOptimizer(config)
    opt.apply(model)
    report = opt.check_drift(lambda: model(x).sum())
    assert report.escalated["0"] == (2, 32) and opt.bits["0"] == 32
    assert report.rounds == 3 and report.max == 0.0  # at 32 bits nothing drifts any more
    assert opt.check_drift(lambda: model(x).sum()).escalated == {}


def test_cosine_lets_4_bit_noise_through_that_rel_l2_stops():
    results = {}
    for metric in ("rel_l2", "cosine"):
        config = {"quantize": {"bits": 4}, "drift": {"metric": metric}}
        opt, _, loss = patched(hf_llama, config, batch_size=2)
        results[metric] = opt.check_drift(loss, max_rounds=1)
    strict, loose = results["rel_l2"], results["cosine"]
    assert strict.max > 0.2 and loose.max < 0.5 * strict.max
    assert len(loose.escalated) < len(strict.escalated) / 2


# --------------------------------------------------------------------------- non-interference
def _train(checks: bool, steps: int = 3):
    model, batch, loss_fn = hf_gpt2(batch_size=2, seq=32, layers=1, dropout=0.1)
    opt = MemoryOptimizer({"quantize": {"bits": 8}, "drift": {"threshold": 1.0, "check_every": 1}})
    opt.apply(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    losses, reports = [], []
    for _ in range(steps):
        sgd.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        if checks and opt.internal.should_check():
            grads = [p.grad.clone() for p in model.parameters()]
            reports.append(opt.check_drift(lambda: loss_fn(model, slice_batch(batch, 2))))
            assert all(
                torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True)
            )
        sgd.step()
        opt.count_step()
        losses.append(loss.item())
    return model, losses, reports


def test_checks_on_are_bit_for_bit_the_same_training_as_checks_off():
    """With dropout active and 8-bit stochastic rounding: RNG, codec noise and .grad untouched."""
    on, losses_on, reports = _train(checks=True)
    off, losses_off, _ = _train(checks=False)
    assert len(reports) == 3 and all(r.escalated == {} and r.max > 0 for r in reports)
    assert losses_on == losses_off
    for (name, a), b in zip(on.named_parameters(), off.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_check_restores_batchnorm_buffers_and_saved_stats():
    model, batch, loss_fn = hf_resnet(batch_size=2, size=32)
    opt = MemoryOptimizer({"quantize": {"bits": 4}})
    opt.apply(model)
    loss_fn(model, batch)  # a training forward: stats describe it
    stats = dataclasses.astuple(opt.internal.compression.stats)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    report = opt.check_drift(lambda: loss_fn(model, slice_batch(batch, 2)), max_rounds=1)
    assert report.per_module and report.max > 0
    assert dataclasses.astuple(opt.internal.compression.stats) == stats
    assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers())
    assert all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------------- bookkeeping
def test_state_dict_round_trips_bits_steps_and_history():
    opt, model, loss = patched(hf_llama, {"quantize": {"bits": 2}}, batch_size=1)
    opt.check_drift(loss, max_rounds=1)
    opt.count_step()
    opt.check_drift(loss, max_rounds=1)
    opt.set_bits("model.norm", 32)  # a module at the top of the ladder is still listed
    state = json.loads(json.dumps(opt.state_dict()))  # plain types only
    assert len(state["drift"]["history"]) == 2 and state["drift"]["steps"] == 1

    for load_first in (True, False):
        fresh, _, _ = hf_llama()
        other = MemoryOptimizer({"quantize": {"bits": 2}})
        if load_first:
            other.load_state_dict(state)
            other.apply(fresh)
        else:
            other.apply(fresh)
            other.load_state_dict(state)
        assert other.bits == opt.bits and other.bits["model.norm"] == 32
        assert other.internal.steps == 1
        assert other.state_dict()["drift"] == opt.state_dict()["drift"]
        per_step = (
            "memopt/kept",
            "memopt/compression",
            "memopt/peak",
            "memopt/batch",
        )  # the last forward's, not the state's
        drift_keys = {k: v for k, v in opt.metrics().items() if not k.startswith(per_step)}
        theirs = other.metrics()
        assert {k: theirs[k] for k in drift_keys} == drift_keys
        other.remove()


def test_history_is_bounded():
    monitor = DriftMonitor(DriftConfig())
    model = nn.Linear(2, 2)
    for step in range(HISTORY_LIMIT + 50):
        sample = CheckSample(model, lambda: model.weight.sum())
        face = CompressionFace({}, set_bits=None, suspend=None)
        monitor.check(DriftCheck(sample, face, step=step))
    assert len(monitor.history) == HISTORY_LIMIT
    assert monitor.history[0]["step"] == 50 and monitor.history[-1]["step"] == HISTORY_LIMIT + 49


def test_should_check_counts_optimizer_steps():
    opt, _, _ = patched(hf_llama, {"quantize": {"bits": 4}, "drift": {"check_every": 3}})
    due = []
    for _ in range(7):
        due.append(opt.internal.should_check())
        opt.count_step()
    assert due == [True, False, False, True, False, False, True]
    assert opt.internal.should_check(step=9) and not opt.internal.should_check(step=10)
    assert opt.check_drift(lambda: None, step=10, if_due=True) is None
    off, _, _ = patched(hf_llama, {"quantize": {"bits": 4}, "drift": {"enabled": False}})
    assert not off.internal.should_check(step=0)
    nothing, _, _ = patched(hf_llama, {"quantize": {"bits": 32}})
    assert not nothing.internal.should_check(step=0)


def test_metrics_report_drift_bits_escalations_and_kept_bytes():
    config = {
        "quantize": {"bits": 4},
        "drift": {"metric": "rel_l2"},  # 4 bits escalate
        "log": {"per_module": True},
    }
    opt, model, loss = patched(hf_llama, config, batch_size=2)
    before = opt.metrics()
    assert "memopt/drift_max" not in before and before["memopt/escalations"] == 0.0
    loss().backward()  # a training step fills the saved-bytes statistics
    report = opt.check_drift(loss, max_rounds=1)
    m = opt.metrics()
    assert m["memopt/drift_max"] == report.max
    assert m["memopt/drift/lm_head"] == report.per_module["lm_head"]
    changed = {k.removeprefix("memopt/bits/") for k in m if k.startswith("memopt/bits/")}
    assert changed == {f or "<root>" for f in report.escalated}  # the others were in `before`
    assert all(m[f"memopt/bits/{f or '<root>'}"] == new for f, (_, new) in report.escalated.items())
    assert m["memopt/escalations"] == len(report.escalated) > 0
    stats = opt.internal.compression.stats
    assert m["memopt/kept_bytes"] == stats.forward_stored > 0
    ratio = m["memopt/compression_ratio"]
    assert ratio == pytest.approx(stats.forward_ratio) and stats.forward_ratio > 4


def test_loss_fn_must_return_a_scalar():
    opt, model, loss = patched(hf_llama, {"quantize": {"bits": 4}}, batch_size=1)
    with pytest.raises(TypeError, match="scalar tensor; got Tensor of shape \\(2,\\)"):
        opt.check_drift(lambda: loss().repeat(2))


# --------------------------------------------------------------------------- slicing
Pair = namedtuple("Pair", "x y")


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    tag: str


def test_slice_batch_cuts_every_tensor_along_dim_0():
    t = torch.arange(20).reshape(10, 2)
    batch = {
        "ids": t,
        "pair": Pair(t, [t, 3]),
        "tuple": (t, None),
        "scalar": torch.tensor(5.0),
        "sample": Sample(t, "a"),
        "name": "x",
    }
    out = slice_batch(batch, 4)
    assert torch.equal(out["ids"], t[:4]) and isinstance(out["pair"], Pair)
    assert out["pair"].x.shape == (4, 2) and out["pair"].y[0].shape == (4, 2)
    assert out["pair"].y[1] == 3 and out["tuple"][1] is None and out["name"] == "x"
    assert out["scalar"].shape == () and out["sample"].x.shape == (4, 2)
    assert out["sample"].tag == "a"
    assert slice_batch(t, 50).shape == (10, 2)  # a smaller batch is used whole
    enc = slice_batch(BatchEncoding({"input_ids": t}), 3)
    assert isinstance(enc, BatchEncoding) and enc["input_ids"].shape == (3, 2)


# --------------------------------------------------------------------------- bits back down
def _lowering(**drift):
    return {"quantize": {"bits": 4}, "drift": {"metric": "cosine", "lower": True, **drift}}


def test_lowering_brings_bits_back_down_to_the_start_and_no_further(caplog):
    """Modules raised at a noisy moment come back down one rung per calm check, each probed at
    the lower width, never under the bits they started at; each change has its INFO line."""
    opt, _, loss = patched(hf_llama, _lowering(lower_after=1), batch_size=2)
    at_start = opt.check_drift(loss)
    assert at_start.escalated == {} and at_start.lowered == {}  # 4 bits is calm: the floor
    raised = sorted(at_start.per_module, key=at_start.per_module.get)[:2]  # as if escalated
    for fqn in raised:
        opt.set_bits(fqn, 16)
    with caplog.at_level(logging.INFO, logger="memopt"):
        first, second, third = (opt.check_drift(loss) for _ in range(3))
    assert first.lowered == dict.fromkeys(raised, (16, 8))
    assert second.lowered == dict.fromkeys(raised, (8, 4))
    assert third.lowered == {} and third.escalated == {}
    assert set(opt.bits.values()) == {4}
    assert first.rounds == 2  # the check's pass and one probe at the lower widths
    assert max(first.per_module[f] for f in raised) <= 0.025
    lines = [r.getMessage() for r in caplog.records if "lowered: " in r.getMessage()]
    assert len(lines) == 2 and all(f"{f} 16 -> 8" in lines[0] for f in raised)
    assert opt.metrics()["memopt/lowerings"] == 4.0


def test_without_lowering_raised_bits_stay_raised():
    opt, _, loss = patched(hf_llama, _lowering(lower=False), batch_size=2)
    opt.set_bits("model.layers.0.mlp.down_proj", 16)
    for _ in range(2):
        assert opt.check_drift(loss).lowered == {}
    assert opt.bits["model.layers.0.mlp.down_proj"] == 16
    assert "memopt/lowerings" not in opt.metrics()


def test_a_failed_lowering_goes_back_up_and_waits_longer():
    """A module whose probe one rung lower is not calm keeps its bits, and the calm checks it
    needs before the next try double (bounded); no width changes in training meanwhile."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    config = {
        "quantize": {"bits": 8, "min_numel": 0, "rounding": "nearest"},
        "drift": {
            "metric": "rel_l2",
            "threshold": 0.004,
            "lower": True,
            "lower_after": 1,
            "lower_below": 1.0,
        },
    }
    opt = MemoryOptimizer(config)
    opt.apply(model)
    first = opt.check_drift(lambda: model(x).sum())
    assert first.escalated["0"] == (8, 16) and first.lowered == {}
    monitor = opt._drift
    waits = []
    for _ in range(6):
        report = opt.check_drift(lambda: model(x).sum())
        assert report.lowered == {} and report.escalated == {} and opt.bits["0"] == 16
        waits.append(monitor.wait["0"])
    assert waits[0] == 2 and max(waits) <= 8 and waits == sorted(waits)
    assert monitor.deescalations == 0
    state = json.loads(json.dumps(opt.state_dict()))
    other = MemoryOptimizer(config)
    other.load_state_dict(state)
    other.apply(copy.deepcopy(model))
    assert other.state_dict()["drift"] == opt.state_dict()["drift"]  # floors, calm runs, waits
    assert other._drift.wait == monitor.wait and other._drift.floor == dict.fromkeys(opt.bits, 8)


@pytest.mark.parametrize("lower_changes", [4, 100])
def test_a_module_that_keeps_flipping_stops_being_lowered(monkeypatch, lower_changes):
    """A module over the threshold at 4 bits on every third check and calm at 8 goes up, down,
    and up, then stays up: a lowering and a return would take it past ``lower_changes`` (4).
    Without that cap (100) it keeps flipping over 24 checks, the doubling wait notwithstanding."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    drift = {"threshold": 0.05, "lower": True, "lower_after": 1, "lower_changes": lower_changes}
    opt = MemoryOptimizer({"quantize": {"bits": 4, "min_numel": 0}, "drift": drift})
    opt.apply(model)
    checks = [0]

    def scripted(fqns, *_):  # module "0": over at 4 bits on every third check, else calm
        over = opt.bits["0"] == 4 and checks[0] % 3 == 0
        return Drifts([0.2 if f == "0" and over else 0.0 for f in fqns], {}, {})

    monkeypatch.setattr("memopt_plugins.drift.rounds.module_drifts", scripted)
    widths = []
    for check in range(1, 25):
        checks[0] = check
        opt.check_drift(lambda: model(x).sum())
        widths.append(opt.bits["0"])
    changes = sum(a != b for a, b in zip([4, *widths], widths, strict=False))
    assert widths[:6] == [4, 4, 8, 4, 4, 8]
    if lower_changes == 4:
        assert changes == 3 and set(widths[5:]) == {8}
        assert opt.state_dict()["drift"]["lowering"]["changes"]["0"] == 3
    else:
        assert changes > 4


def test_metrics_log_a_bits_summary_and_a_modules_bits_only_when_they_change():
    """Every call: the mean bits and the modules per width; a module's own bits at the first
    call and then only when they changed (one chart per module per change, not per row), with
    log.per_module; without it, no series per module at all."""
    compact, _, _ = patched(hf_llama, {"quantize": {"bits": 4}}, batch_size=1)
    assert not any(k.startswith(("memopt/bits/", "memopt/drift/")) for k in compact.metrics())
    config = {"quantize": {"bits": 4}, "log": {"per_module": True}}
    opt, _, _ = patched(hf_llama, config, batch_size=1)
    first = opt.metrics()
    per_module = {k for k in first if k.startswith("memopt/bits/")}
    assert len(per_module) == len(opt.bits) and first["memopt/bits_mean"] == 4.0
    assert first["memopt/bits_modules/4"] == float(len(opt.bits))
    assert not any(k.startswith("memopt/bits/") for k in opt.metrics())
    fqn = "model.layers.0.mlp.down_proj"
    opt.set_bits(fqn, 8)
    changed = opt.metrics()
    assert {k for k in changed if k.startswith("memopt/bits/")} == {f"memopt/bits/{fqn}"}
    assert changed[f"memopt/bits/{fqn}"] == 8.0 and changed["memopt/bits_modules/8"] == 1.0
    assert changed["memopt/bits_mean"] == (4 * (len(opt.bits) - 1) + 8) / len(opt.bits)


def test_a_lowering_undone_reports_the_cost_at_the_bits_kept(caplog):
    """sgd: raised from 2 bits, the modules' lowering back to 2 is probed and undone; the check
    reports the whole model's cost at the bits it keeps (it gave the undone probe's: the demo
    printed "costs 0.3% -> 51.1% ... no change"), and its line says that the lowering was tried
    and what the probe read (it said only "no change", as if nothing had been tried)."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 64, generator=generator), torch.randn(64, 1, generator=generator)
    drift = {"metric": "sgd", "lower": True, "lower_after": 1, "lower_below": 1.0}
    opt = MemoryOptimizer({"quantize": {"bits": 2, "min_numel": 0}, "drift": drift})
    opt.apply(model)
    first = opt.check_drift(lambda: F.mse_loss(model(x), y), batch_size=64)
    assert first.escalated and first.total[0] > 0.05 >= first.total[1]
    caplog.clear()  # the first check's line may be captured too (apply sets INFO on memopt)
    with caplog.at_level(logging.INFO, logger="memopt"):
        undone = opt.check_drift(lambda: F.mse_loss(model(x), y), batch_size=64)
    assert undone.rounds == 2 and undone.lowered == {} and undone.escalated == {}
    assert undone.total[0] == undone.total[1] <= 0.05
    assert undone.tried_lower == {f: (old, 2) for f, (_, old) in first.escalated.items()}
    assert undone.tried_probe > 0.05  # the probe's whole-model cost: over the threshold
    lines = [r.getMessage() for r in caplog.records if "drift check at step" in r.getMessage()]
    assert len(lines) == 1
    line = lines[0]
    assert "no change" in line and "tried a rung lower and kept at their bits" in line
    assert f"cost {100 * undone.tried_probe:.1f}% of a step's progress" in line


class Wrapper(nn.Module):
    """Holds the model the loss calls, as a LightningModule does; its own forward never runs."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model


def test_sgd_finds_the_samples_where_the_wrapper_forward_never_runs(caplog):
    """A LightningModule's training_step calls ``self.model``, never the LightningModule's own
    forward: the check weights the halves of that call's output and judges by sgd (it fell back
    to cosine, with a warning, in every Lightning fit of a model held as ``self.model``)."""
    model, batch, loss_fn = hf_gpt2(batch_size=8, seq=16, dim=32, layers=1)
    wrapper = Wrapper(model)
    opt = MemoryOptimizer({"quantize": {"bits": 4}, "drift": {"metric": "sgd"}})
    opt.apply(wrapper)
    with caplog.at_level(logging.WARNING, logger="memopt"):
        report = opt.check_drift(lambda w, b: loss_fn(w.model, b), batch=batch)
    assert report.metric == "sgd" and report.total[0] is not None
    assert "judge by cosine instead" not in caplog.text
