"""Per-module saved bytes, the byte-weighted mean bits, and quantize.budget (bits solved for a
memory target at each drift check)."""

from __future__ import annotations

import json
import logging

import pytest
from zoo import hf_gpt2

from memopt_plugins import MemoryOptimizer
from memopt_plugins.config import ConfigError, MemOptConfig
from memopt_plugins.drift.budget import Pricing, solve, step_size

SIZE = {"batch_size": 4, "seq": 32, "dim": 64}


def _gpt2(config: dict):
    model, batch, loss_fn = hf_gpt2(**SIZE)
    opt = MemoryOptimizer(config)
    opt.apply(model)
    return opt, model, (lambda: loss_fn(model, batch)), (lambda: loss_fn(model, batch[:2]))


# --------------------------------------------------------------------------- per-module bytes
def test_per_module_counts_add_up_and_predict_the_bytes_at_another_width():
    """Each scope's counts sum to the forward's; the bytes a scope would keep at 8 bits, priced
    from a 4-bit forward by the codec's packed sizes, are what an 8-bit forward keeps."""
    opt, _, train, _ = _gpt2({"quantize": {"bits": 4}})
    train().backward()
    stats = opt.internal.compression.stats
    modules = stats.modules
    assert len(modules) > 5
    assert sum(m.original for m in modules.values()) == stats.forward_original
    assert sum(m.stored for m in modules.values()) == stats.forward_stored
    group = opt.config.quantize.group_size
    assert all(m.bytes_at(4, group) == m.stored for m in modules.values())
    predicted = {f: (m.bytes_at(8, group), m.bytes_at(16, group)) for f, m in modules.items()}
    assert all(m.bytes_at(32, group) == m.original for m in modules.values())
    for fqn in opt.bits:
        opt.set_bits(fqn, 8)
    train().backward()
    assert {f: m.stored for f, m in stats.modules.items()} == {
        f: p[0] for f, p in predicted.items()
    }
    for fqn in opt.bits:
        opt.set_bits(fqn, 16)
    train().backward()
    assert {f: m.stored for f, m in stats.modules.items()} == {
        f: p[1] for f, p in predicted.items()
    }


def test_bits_mean_is_weighted_by_the_bytes_each_module_saved():
    opt, _, train, _ = _gpt2({"quantize": {"bits": 4}})
    assert opt.metrics()["memopt/bits_mean"] == 4.0  # no forward yet: unweighted
    train().backward()
    biggest = max(opt.internal.compression.stats.modules.items(), key=lambda kv: kv[1].original)[0]
    opt.set_bits(biggest, 16)
    modules = opt.internal.compression.stats.modules
    weights = {f: modules[f].original for f in opt.bits if f in modules}
    want = sum(opt.bits[f] * w for f, w in weights.items()) / sum(weights.values())
    mean = opt.metrics()["memopt/bits_mean"]
    assert mean == pytest.approx(want, rel=1e-12)
    unweighted = (4 * (len(opt.bits) - 1) + 16) / len(opt.bits)
    assert mean > unweighted + 0.5  # the biggest module weighs more than one vote


# --------------------------------------------------------------------------- the solver
def _pricing(target: float) -> Pricing:
    # module "a" is big and calm, "b" small and sensitive; bytes proportional to width
    costs = {
        "a": {b: 100.0 * b for b in (2, 4, 8, 16, 32)},
        "b": {b: 10.0 * b for b in (2, 4, 8, 16, 32)},
    }
    return Pricing(costs, target)


def test_solver_lowers_the_cheapest_drift_per_byte_and_respects_floors():
    ladder = (2, 4, 8, 16, 32)
    sensitivity = {"a": 0.01, "b": 1.0}
    # from 8 bits each (880 bytes) to 500: "a" goes down (least drift per byte), "b" stays
    out = solve({"a": 8, "b": 8}, _pricing(500), sensitivity, ladder, {}, 0.05)
    assert out["a"] < 8 and out["b"] >= 8
    assert sum(_pricing(0).costs[f][b] for f, b in out.items()) <= 500
    # with room to spare the sensitive one is raised first
    out = solve({"a": 2, "b": 2}, _pricing(1000), sensitivity, ladder, {}, 0.05)
    assert out["b"] == 32 and _pricing(0).total(out) <= 1000
    # a floor holds a module where the threshold put it, even over the budget
    out = solve({"a": 8, "b": 8}, _pricing(100), sensitivity, ladder, {"a": 8}, 0.05)
    assert out == {"a": 8, "b": 2}
    assert step_size(32) == 0.0 and step_size(4) == pytest.approx(1 / 15)


# --------------------------------------------------------------------------- the budget
def _budgeted(budget, threshold: float = 0.1):
    return {"quantize": {"bits": 4, "budget": budget}, "drift": {"threshold": threshold}}


def test_budget_is_met_and_a_training_forward_keeps_what_the_check_predicted(caplog):
    opt, _, train, sample = _gpt2(_budgeted(0.25))
    train().backward()
    uncompressed = opt.internal.compression.stats.forward_original
    with caplog.at_level(logging.INFO, logger="memopt"):
        report = opt.check_drift(sample)
    target, kept = report.budget
    assert target == pytest.approx(0.25 * uncompressed)
    assert 0.95 * target <= kept <= 1.05 * target
    assert report.max <= 0.1  # the threshold still holds
    assert any(
        "quantize.budget" in r.getMessage() and "keep" in r.getMessage() for r in caplog.records
    )
    assert max(opt.bits.values()) > 4  # 4 bits keep about 13%: the budget buys more bits
    train().backward()
    stats = opt.internal.compression.stats
    assert stats.forward_stored == pytest.approx(kept, rel=0.01)  # measured
    # a second check with the same drift finds nothing to change
    again = opt.check_drift(sample)
    assert again.escalated == {} and again.lowered == {}


def test_a_budget_the_threshold_forbids_is_missed_and_the_log_names_the_modules(caplog):
    opt, _, train, sample = _gpt2(_budgeted(0.07, threshold=0.05))
    train().backward()
    with caplog.at_level(logging.INFO, logger="memopt"):
        report = opt.check_drift(sample)
    target, kept = report.budget
    assert kept > 1.05 * target
    assert report.max <= 0.05  # the threshold wins
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "missed by" in warnings[0]
    held = [f for f, (w, _) in opt._drift.held.items() if opt.bits[f] > 2]
    assert held and all(f in warnings[0] for f in held)


def _with_memory(memory, budget=None):
    return {
        "quantize": {"bits": 4, "budget": budget, "memory": memory},
        "drift": {"threshold": 0.1},
    }


def test_memory_waits_for_a_training_forward_and_scales_to_it(caplog):
    opt, _, train, sample = _gpt2(_with_memory("700KiB"))
    with caplog.at_level(logging.INFO, logger="memopt"):
        report = opt.check_drift(sample)
    assert report.budget is None and "quantize.memory waits for a training forward" in caplog.text
    train().backward()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="memopt"):
        report = opt.check_drift(sample)
    target, kept = report.budget
    assert target == 700 * 1024 and kept <= 1.05 * target
    assert "memopt: quantize.memory 0.68 MiB: the bits keep" in caplog.text
    train().backward()
    assert opt.internal.compression.stats.forward_stored == pytest.approx(kept, rel=0.01)


@pytest.mark.parametrize(
    ("budget", "memory", "tighter"), [(1.0, "700KiB", "memory"), (0.25, "1GiB", "budget")]
)
def test_with_budget_and_memory_the_tighter_is_the_target(budget, memory, tighter, caplog):
    opt, _, train, sample = _gpt2(_with_memory(memory, budget))
    train().backward()
    uncompressed = opt.internal.compression.stats.forward_original
    with caplog.at_level(logging.INFO, logger="memopt"):
        report = opt.check_drift(sample)
    target, kept = report.budget
    fraction, amount = (
        budget * uncompressed,
        float(MemOptConfig.from_dict(_with_memory(memory)).quantize.memory),
    )
    assert (fraction < amount) == (tighter == "budget")
    assert target == pytest.approx(min(fraction, amount)) and kept <= 1.05 * target
    assert "the tighter of quantize.budget and quantize.memory" in caplog.text


def test_budget_state_round_trips_and_the_check_leaves_the_counts_of_training():
    opt, model, train, sample = _gpt2(_budgeted(0.2, threshold=0.05))
    train().backward()
    before = {f: (m.original, m.stored) for f, m in opt.internal.compression.stats.modules.items()}
    opt.check_drift(sample)
    after = {f: (m.original, m.stored) for f, m in opt.internal.compression.stats.modules.items()}
    assert after == before  # the check's passes do not replace the training forward's counts
    state = json.loads(json.dumps(opt.state_dict()))
    assert state["drift"]["budget"]["sensitivity"]
    other = MemoryOptimizer(_budgeted(0.2, threshold=0.05))
    other.load_state_dict(state)
    assert other.state_dict()["drift"] == opt.state_dict()["drift"]


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("budget", 1.5, "a fraction in (0, 1]"),
        ("budget", 0, "a fraction in (0, 1]"),
        ("budget", 2048, "an amount of memory is quantize.memory's: write memory: 2048"),
        ("budget", "6MiB", "an amount of memory is quantize.memory's: write memory: '6MiB'"),
        ("budget", True, "a fraction in (0, 1]"),
        ("memory", 1, "bytes (an integer >= 1024)"),
        ("memory", 0.5, "bytes (an integer >= 1024)"),
        ("memory", "lots", "is not an amount of memory"),
        ("memory", True, "true/false is not an amount of memory"),
    ],
)
def test_budget_and_memory_config_errors(key, value, problem):
    """One meaning per key: budget is a fraction, memory an amount of memory."""
    with pytest.raises(ConfigError, match=f"quantize.{key}") as err:
        MemOptConfig.from_dict({"quantize": {key: value}})
    assert problem in str(err.value)


def test_budget_and_memory_config_values():
    assert MemOptConfig.from_dict({"quantize": {"memory": "6MiB"}}).quantize.memory == 6 << 20
    assert MemOptConfig.from_dict({"quantize": {"memory": 4096}}).quantize.memory == 4096
    assert MemOptConfig.from_dict({"quantize": {"budget": 0.3}}).quantize.budget == 0.3
    assert MemOptConfig.from_dict({"quantize": {"budget": 1}}).quantize.budget == 1.0
    both = MemOptConfig.from_dict({"quantize": {"budget": 0.3, "memory": "1GiB"}}).quantize
    assert (both.budget, both.memory, both.targets_memory) == (0.3, 1 << 30, True)
    assert not MemOptConfig.from_dict({}).quantize.targets_memory
    for key, value in (("budget", 0.3), ("memory", "6MiB")):
        with pytest.raises(ConfigError, match=f"quantize.{key} is solved at each drift check"):
            MemOptConfig.from_dict({"quantize": {key: value}, "drift": {"enabled": False}})


def test_escalation_never_takes_the_bits_past_the_budget(caplog):
    """From 2 bits, where the threshold wants every module up, a budget just above what 2 bits
    keep caps the check: the bits it leaves keep within the budget (5% tolerance), and one
    WARNING names the modules the budget holds and what a rung up for them needs."""
    opt, _, train, check = _gpt2({"quantize": {"bits": 2, "budget": 0.08}})
    train().backward()
    stats = opt.internal.compression.stats
    assert stats.forward_stored < 0.08 * stats.forward_original  # 2 bits fit the budget
    with caplog.at_level(logging.WARNING, logger="memopt"):
        report = opt.check_drift(check)
    target, kept = report.budget
    assert report.first and max(report.first.values()) > opt.config.drift.threshold
    assert kept <= 1.05 * target
    train().backward()  # the next training forward keeps what the check predicted
    assert stats.forward_stored <= 1.05 * 0.08 * stats.forward_original
    held = [r.getMessage() for r in caplog.records if "holds" in r.getMessage()]
    assert len(held) == 1 and "drift.threshold" in held[0] and "MiB more" in held[0]


@pytest.mark.parametrize("ladder, set_to", [((4, 8, 16, 32), None), ((4, 8, 32), 16)])
def test_bits_off_the_ladder_are_priced_and_solved_from(ladder, set_to):
    """quantize.bits 2 under a ladder from 4 (the presets'), and a module set to a width the
    ladder lacks: the check prices every width a module stands at, meets the budget and keeps
    the start bits as a rung the solver may come back to."""
    config = {"quantize": {"bits": 2, "budget": 0.08}, "drift": {"ladder": list(ladder)}}
    opt, _, train, check = _gpt2(config)
    if set_to is not None:
        opt.set_bits("transformer.h.0.mlp.c_fc", set_to)
    train().backward()
    report = opt.check_drift(check)
    target, kept = report.budget
    assert kept <= 1.05 * target
    assert min(opt.bits.values()) == 2 and set(opt.bits.values()) <= {2, set_to, *ladder}
    train().backward()
    assert opt.internal.compression.stats.forward_stored == pytest.approx(kept, rel=0.01)
