"""MemOptSession, the framework-neutral object under the Lightning, Trainer and Accelerate
integrations: kept state across remove(), when a check runs, what a step logs, the console."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from memopt_plugins import ConfigError
from memopt_plugins.engine import patched_by
from memopt_plugins.session import MemOptSession

#: Two bits on the first Linear; Gaussian inputs make its drift far over 5% (test_drift_ddp.py).
TWO_BITS = {"quantize": {"bits": 2, "modules": ["0"], "min_numel": 0}, "drift": {"check_every": 2}}


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def loss_on(model: nn.Module):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    return lambda: model(x).square().mean()


def hooks_on(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


class Rows:
    """A framework's logger: the rows and steps it was handed."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, metrics))


def test_state_survives_remove_and_the_next_apply_starts_from_it():
    session = MemOptSession(TWO_BITS)
    model = session.apply(mlp())
    report = session.check(loss_on(model), step=0)
    session.end_step(0, log_due=False)
    assert report.escalated["0"][0] == 2 and session.bits["0"] > 2
    escalated, state = session.bits, session.memopt.state_dict()

    session.remove()
    assert hooks_on(model) == 0 and patched_by(model) is None
    assert session.bits == escalated  # what the fit learned, while unpatched
    assert session.state_dict() == state

    other = session.apply(mlp())
    assert patched_by(other) is session.memopt and session.memopt.bits == escalated
    assert session.steps == 1  # the step counter came back with the state


def test_apply_is_idempotent_and_moves_to_another_model_with_its_state():
    session = MemOptSession(TWO_BITS)
    first = session.apply(mlp())
    patched = hooks_on(first)
    assert session.apply(first) is first and hooks_on(first) == patched  # already patched
    session.memopt.set_bits("0", 8)
    second = session.apply(mlp())  # model_init: the patch moves, with the bits
    assert hooks_on(first) == 0 and patched_by(second) is session.memopt
    assert session.bits == {"0": 8}


def test_held_state_acts_only_at_restore():
    """Lightning loads a callback's state after setup patched the model; it must act from
    on_fit_start, and the checkpoint in between is the held one."""
    session = MemOptSession(TWO_BITS)
    session.apply(mlp())
    held = {**session.memopt.state_dict(), "bits": {"0": 16}}
    session.hold(held)
    assert session.memopt.bits == {"0": 2} and session.state_dict()["bits"] == {"0": 16}
    session.restore()
    assert session.memopt.bits == {"0": 16} and session.bits == {"0": 16}


def test_state_loaded_while_unpatched_is_laid_on_the_next_patch():
    session = MemOptSession(TWO_BITS)
    session.load_state_dict({"bits": {"0": 4}})
    assert session.bits == {"0": 4}
    session.apply(mlp())
    assert session.memopt.bits == {"0": 4}


def test_one_check_per_step_and_the_step_counts():
    session = MemOptSession(TWO_BITS)
    assert not session.due(0)  # nothing patched
    model = session.apply(mlp())
    assert session.due(0) and not session.due(1)  # check_every 2, first at step 0
    assert session.check(loss_on(model), step=0, if_due=True) is not None
    assert not session.due(0)  # several optimizers in a step: one check
    assert session.check(loss_on(model), step=0, if_due=True) is None
    session.end_step(0, log_due=False)
    assert session.due(0)  # a new step (a second fit starting at 0 checks again)
    assert session.steps == 1
    session.end_step(1, log_due=False)
    assert session.steps == 2 and session.due()  # default: the counted steps


def test_a_step_logs_at_logging_steps_and_at_checks_with_drift_only_then():
    session = MemOptSession(TWO_BITS)
    model = session.apply(mlp())
    assert session.end_step(0, log_due=True) is None  # no logger injected: nothing to log to
    rows = session.log_metrics = Rows()
    assert session.end_step(1, log_due=False) is None and rows.rows == []
    session.check(loss_on(model), step=2)
    logged = session.end_step(2, log_due=False)  # a check's step logs whatever the framework says
    session.end_step(3, log_due=True)
    assert [step for step, _ in rows.rows] == [2, 3] and rows.rows[0][1] is logged
    with_check, without = rows.rows[0][1], rows.rows[1][1]
    assert with_check["memopt/drift_max"] > 0 and with_check["memopt/escalations"] > 0
    assert "memopt/drift_max" not in without
    assert without["memopt/escalations"] == with_check["memopt/escalations"]
    assert session.steps == 4


def test_each_check_writes_one_line_on_the_main_process_only(caplog):
    session = MemOptSession(TWO_BITS)
    model = session.apply(mlp())
    with caplog.at_level(logging.INFO, logger="memopt"):
        report = session.check(loss_on(model), step=0)
        session.end_step(0, log_due=False)
        session.is_main = lambda: False
        session.check(loss_on(model), step=1)
    lines = [r.getMessage() for r in caplog.records if "drift check at step" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("memopt: drift check at step 0 (sgd, threshold")
    assert "1 of 1 modules raised: 0 2 -> 4 (" in lines[0]
    assert f"largest drift {report.round_max[0]:.4f} -> {report.max:.4f}" in lines[0]


def test_plan_line_and_drift_active(caplog):
    assert not MemOptSession({"quantize": {"bits": 8}, "drift": {"enabled": False}}).drift_active
    assert not MemOptSession().drift_active  # nothing compressed: nothing to check
    session = MemOptSession(TWO_BITS)
    assert session.drift_active
    session.apply(mlp())
    with caplog.at_level(logging.INFO, logger="memopt"):
        caplog.clear()  # apply's own lines are not the plan's
        session.log_plan()
    assert [r.getMessage() for r in caplog.records] == [
        "memopt: plan for 4 modules: 1 compress@2; dropout keep, batchnorm batch; "
        "drift sgd <= 0.05 every 2 steps"
    ]


def test_an_eval_pass_without_gradients_leaves_the_training_steps_metrics():
    """A forward under ``no_grad`` (an eval pass) between the training step and its row saves
    nothing for backward: the row reports the training forward's bytes, not 0 bytes at 1.0x."""
    session = MemOptSession({"quantize": {"bits": 4, "min_numel": 0}})
    model = session.apply(mlp())
    rows = session.log_metrics = Rows()
    loss_on(model)().backward()
    trained = session.memopt.metrics()
    with torch.no_grad():
        loss_on(model)()
    session.end_step(0, log_due=True)
    with torch.inference_mode():
        loss_on(model)()
    session.end_step(1, log_due=True)
    for _, row in rows.rows:
        assert row["memopt/kept_bytes"] == trained["memopt/kept_bytes"] > 0
        assert row["memopt/compression_ratio"] == trained["memopt/compression_ratio"] > 4.0


def test_a_held_state_that_does_not_load_is_kept():
    session = MemOptSession(TWO_BITS)
    session.apply(mlp())
    held = {**session.memopt.state_dict(), "bits": {"0": 16, "9": 4}}  # no module 9 here
    session.hold(held)
    with pytest.raises(ConfigError, match=r"does not have: \['9'\]"):
        session.restore()
    assert session.state_dict() == held and session.memopt.bits == {"0": 2}


class _LSTMNet(nn.Module):
    """A 2-layer LSTM over 64 steps: on the CPU each layer's oneDNN kernel saves a uint8
    workspace for its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0]).square().mean()


def _saved_storages(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages a forward saves for backward, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(seen.values())


def test_an_lstms_workspace_is_reported_kept_as_it_is_and_the_counts_stay_under_the_baseline(
    caplog,
):
    """What the hooks keep as they are where bits were asked for is counted apart
    (``memopt/kept_as_is_bytes``) and named in the first step's console lines; no count exceeds
    what the model saves without memopt."""
    torch.manual_seed(0)
    model, x = _LSTMNet(), torch.randn(8, 64, 32)
    baseline = _saved_storages(model, x)
    session = MemOptSession({"quantize": {"bits": 4}, "drift": {"enabled": False}})
    session.log_metrics = Rows()
    session.apply(model)
    with caplog.at_level(logging.INFO, logger="memopt"):
        model(x).backward()
        metrics = session.end_step(0, log_due=True)
    workspaces = [m for m in caplog.messages if "oneDNN workspace" in m]
    assert 0 < metrics["memopt/kept_as_is_bytes"] <= metrics["memopt/kept_bytes"] <= baseline
    assert len(workspaces) == 1 and "lstm" in workspaces[0] and "uint8" in workspaces[0]
    first = next(m for m in caplog.messages if "first training step kept" in m)
    assert f"{metrics['memopt/kept_as_is_bytes'] / 2**20:.2f} MiB of it kept as it is" in first
    session.remove()


def test_a_loop_that_never_says_the_plan_has_it_said_before_its_first_check(caplog):
    """An integration that does not call ``log_plan`` (Accelerate's loop) still shows the plan,
    once, before the first check's line; an integration that said it is not repeated."""
    model = mlp()
    session = MemOptSession(TWO_BITS)
    session.apply(model)
    with caplog.at_level(logging.INFO, logger="memopt"):
        for step in range(3):
            session.check(loss_on(model), step=step, if_due=True)
            loss_on(model)().backward()
            session.end_step(step, log_due=True)
    plans = [i for i, m in enumerate(caplog.messages) if m.startswith("memopt: plan for")]
    checks = [i for i, m in enumerate(caplog.messages) if "drift check at step" in m]
    assert len(plans) == 1 and checks and plans[0] < checks[0]
    caplog.clear()
    again = MemOptSession(TWO_BITS)
    again.apply(mlp())
    with caplog.at_level(logging.INFO, logger="memopt"):
        again.log_plan()
        again.end_step(0, log_due=False)
    assert sum(m.startswith("memopt: plan for") for m in caplog.messages) == 1
