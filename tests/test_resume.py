"""Loading a MemoryOptimizer's state: checked whole before any of it is applied (a bad value is
an error naming its key and changes nothing), another model's state refused, and a config changed
since the checkpoint resolved by one rule that one log line states."""

from __future__ import annotations

import base64
import copy
import json
import logging

import pytest
import torch
from torch import nn

from memopt_plugins import ConfigError, MemoryOptimizer
from memopt_plugins.engine import patched_by

pytestmark = pytest.mark.usefixtures("one_thread")


def config(bits: int) -> dict:
    return {"quantize": {"bits": bits, "min_numel": 0}, "drift": {"sample_size": 4}}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))


class Named(nn.Module):
    """Another model: none of the MLP's module names."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


X = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))


def trained_state(bits: int = 4, raised: int = 16) -> dict:
    """A run at ``bits`` after one check and a step, module ``2`` raised to ``raised`` (as the
    drift guard raises one), through JSON as a Trainer's checkpoint keeps it."""
    opt = MemoryOptimizer(config(bits))
    model = opt.apply(mlp())
    model(X).square().mean().backward()
    opt.check_drift(lambda: model(X[:4]).square().mean(), max_rounds=1)
    opt.count_step()
    opt.set_bits("2", raised)
    state = json.loads(json.dumps(opt.state_dict()))
    opt.remove()
    return state


def resumed(state: dict, bits: int, before_apply: bool) -> MemoryOptimizer:
    opt = MemoryOptimizer(config(bits))
    if before_apply:
        opt.load_state_dict(state)
        opt.apply(mlp())
    else:
        opt.apply(mlp())
        opt.load_state_dict(state)
    return opt


def stored_bytes(opt: MemoryOptimizer) -> int:
    """What the bits that run keep for backward (one training forward)."""
    opt.internal.model(X).square().mean().backward()
    return opt.internal.compression.stats.forward_stored


def resume_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "resuming" in r.getMessage()]


# --------------------------------------------------------------------------- config changed
@pytest.mark.parametrize("before_apply", [True, False])
def test_raised_config_bits_win_and_the_guards_escalation_stays_on_top(before_apply, caplog):
    state = trained_state(bits=4, raised=16)
    assert state["bits"] == {"": 4, "0": 4, "1": 4, "2": 16}
    with caplog.at_level(logging.INFO, logger="memopt"):
        opt = resumed(state, 8, before_apply)
    assert opt.bits == {"": 8, "0": 8, "1": 8, "2": 16}
    lines = resume_lines(caplog)
    assert len(lines) == 1
    assert "the config's win for 3 modules (<root> 4 -> 8, 0 4 -> 8, 1 4 -> 8)" in lines[0]
    assert "the checkpoint's win for 1 module (2 16 (config 8))" in lines[0]
    assert opt._drift.floor == {"": 8, "0": 8, "1": 8, "2": 8}  # drift.lower's floor: the config's
    assert (
        opt.internal.steps == 1 and len(opt._drift.history) == 1
    )  # the rest of the state is restored
    fresh = MemoryOptimizer(config(8))
    fresh.apply(mlp())
    fresh.set_bits("2", 16)
    assert stored_bytes(opt) == stored_bytes(fresh)  # it runs at the bits opt.bits says


def test_lowered_config_bits_win_where_the_checkpoint_holds_no_escalation(caplog):
    state = trained_state(bits=4, raised=8)
    with caplog.at_level(logging.INFO, logger="memopt"):
        opt = resumed(state, 2, before_apply=True)
    assert opt.bits == {"": 2, "0": 2, "1": 2, "2": 8}
    assert len(resume_lines(caplog)) == 1


@pytest.mark.parametrize("before_apply", [True, False])
def test_an_unchanged_config_resumes_the_checkpoints_bits(before_apply, caplog):
    state = trained_state(bits=4, raised=16)
    with caplog.at_level(logging.INFO, logger="memopt"):
        opt = resumed(state, 4, before_apply)
    assert opt.bits == state["bits"]
    lines = resume_lines(caplog)
    assert len(lines) == 1 and "the config's win" not in lines[0]
    assert "the checkpoint's win for 1 module (2 16 (config 4))" in lines[0]
    assert opt.state_dict()["drift"] == state["drift"]


def test_a_module_this_config_does_not_compress_stays_uncompressed_and_is_named(caplog):
    state = trained_state(bits=4)
    opt = MemoryOptimizer({**config(4), "quantize": {**config(4)["quantize"], "exclude": ["0"]}})
    with caplog.at_level(logging.INFO, logger="memopt"):
        opt.load_state_dict(state)
        opt.apply(mlp())
    assert "0" not in opt.bits and opt.bits["2"] == 16
    assert "1 module (0) stay uncompressed" in resume_lines(caplog)[0]


# --------------------------------------------------------------------------- another model
def test_another_models_state_is_refused_at_apply_and_kept_for_the_right_model():
    state = trained_state()
    opt = MemoryOptimizer(config(4))
    opt.load_state_dict(state)
    other = Named()
    with pytest.raises(ConfigError, match=r"does not have: \['0', '1', '2'\]"):
        opt.apply(other)
    assert patched_by(other) is None and opt.internal.model is None
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in other.modules())
    assert opt.state_dict() == state  # nothing lost: the right model takes it
    opt.apply(mlp())
    assert opt.bits == state["bits"] and opt.internal.steps == 1


def test_another_models_state_is_refused_after_apply_and_changes_nothing():
    state = trained_state()
    opt = MemoryOptimizer(config(4))
    model = opt.apply(Named())
    model(X).square().mean().backward()
    before = opt.state_dict()
    with pytest.raises(ConfigError, match=r"names modules this model does not have: \['0', '1'"):
        opt.load_state_dict(state)
    assert opt.state_dict() == before


# --------------------------------------------------------------------------- bad values
def corrupted(state: dict, path: tuple[str, ...], value) -> dict:
    out = copy.deepcopy(state)
    part = out
    for key in path[:-1]:
        part = part[key]
    part[path[-1]] = value
    return out


SHORT = base64.b64encode(bytes(12)).decode("ascii")

BAD = [
    (("bits", "0"), 3, r"state_dict bits\['0'\]: bits must be one of .*got 3"),
    (("bits",), [4], r"state_dict bits: expected a mapping"),
    (("drift", "steps"), "7", r"state_dict drift\.steps: expected an integer >= 0, got '7'"),
    (("drift", "steps"), -1, r"state_dict drift\.steps: expected an integer >= 0"),
    (("drift", "escalations"), 1.5, r"state_dict drift\.escalations"),
    (("drift", "lowering", "floor", "0"), 5, r"state_dict drift\.lowering: bits must be"),
    (("drift", "budget", "sensitivity", "0"), "nan", r"state_dict drift\.budget: expected a fin"),
    (("drift", "history"), "x", r"state_dict drift\.history: expected a list"),
    (("drift", "last", "per_module"), None, r"state_dict drift\.last"),
    (("noise", "generators", "cpu"), SHORT, r"state_dict noise\.generators\['cpu'\]"),
    (("noise", "generators", "cpu"), "not base64!", r"state_dict noise\.generators\['cpu'\]"),
    (("noise", "generators", "nowhere"), SHORT, r"state_dict noise\.generators\['nowhere'\]"),
    (("noise", "seed"), "abc", r"state_dict noise\.seed: expected an integer seed"),
    (("recompute",), ["0"], r"recompute plan, but this config has no recompute\.auto"),
    (("extra",), 1, r"unknown key\(s\) \['extra'\]"),
]


@pytest.mark.parametrize("path, value, message", BAD, ids=[".".join(p) for p, _, _ in BAD])
def test_a_bad_value_is_an_error_naming_its_key_and_changes_nothing(path, value, message):
    state = trained_state()
    assert state["noise"]["generators"] and state["drift"]["last"] is not None
    bad = corrupted(state, path, value)
    opt = MemoryOptimizer(config(4))
    model = opt.apply(mlp())
    model(X).square().mean().backward()  # its own generators and bits, to be kept
    opt.set_bits("0", 8)
    before = json.dumps(opt.state_dict())
    with pytest.raises(ConfigError, match=message):
        opt.load_state_dict(bad)
    assert json.dumps(opt.state_dict()) == before
    opt.remove()
    held = MemoryOptimizer(config(4))  # before apply: the state held is kept
    held.load_state_dict(state)
    with pytest.raises(ConfigError, match=message):
        held.load_state_dict(bad)
    assert held.state_dict() == state
