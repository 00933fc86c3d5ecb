"""Accelerate plugin: escalation in a plain loop, logging, save_state/load_state, accumulation,
and two processes under `accelerate launch` (held-out model: Hugging Face Llama from a config)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.tracking import GeneralTracker
from zoo import hf_llama

from memopt_plugins.accelerate import MemOptPlugin

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")
TWO_BITS = {"quantize": {"bits": 2}, "drift": {"threshold": 0.05, "check_every": 2}}


class Recorder(GeneralTracker):
    """An Accelerate tracker that keeps every ``log`` call in memory."""

    name = "recorder"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def tracker(self) -> list:
        return self.rows

    def store_init_configuration(self, values: dict) -> None:
        pass

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self.rows.append((step, dict(values)))


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _loop(plugin: MemOptPlugin, accelerator: Accelerator, steps: int, micro: int = 1):
    """Train a small Llama for ``steps`` optimizer steps; returns the reports of the checks."""
    model, batch, loss_fn = hf_llama(batch_size=4, seq=32, dim=32, layers=1)
    model = plugin.apply(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    plugin.attach(accelerator)
    unwrapped = accelerator.unwrap_model(model)
    reports = []
    for step in range(steps):
        for _ in range(micro):
            with accelerator.accumulate(model):
                accelerator.backward(loss_fn(model, batch))
                sample = plugin.sample(batch)
                report = plugin.after_backward(step, lambda s=sample: loss_fn(unwrapped, s))
                reports.append(report)
                optimizer.step()
                optimizer.zero_grad()
    return model, reports


def test_plain_loop_escalates_from_2_bits_and_logs_metrics():
    recorder = Recorder()
    accelerator = Accelerator(cpu=True, log_with=[recorder])
    accelerator.init_trackers("memopt-test")
    plugin = MemOptPlugin({**TWO_BITS, "log": {"per_module": True}}, log_every=1)
    _, reports = _loop(plugin, accelerator, steps=3)

    checked = [r.step for r in reports if r is not None]
    assert checked == [0, 2]  # check_every 2, first check at step 0
    assert reports[0].escalated, "2-bit activations at a 5% threshold must escalate"
    assert all(old == 2 and new > 2 for old, new in reports[0].escalated.values())
    assert plugin.steps == 3
    assert max(plugin.bits.values()) > 2

    steps = [step for step, _ in recorder.rows]
    assert steps == [0, 1, 2]
    first = recorder.rows[0][1]
    assert first["memopt/escalations"] > 0
    # the logged drift is the step-0 check's (after its last round); its first round was over 5%
    assert first["memopt/drift_max"] == pytest.approx(reports[0].max) and reports[0].max > 0
    assert reports[0].round_max[0] > 0.05
    assert {f"memopt/bits/{fqn or '<root>'}" for fqn in plugin.bits} <= set(first)
    assert first["memopt/kept_bytes"] > 0 and first["memopt/compression_ratio"] > 1.0
    # drift values belong to the step of their check: the step in between has none
    between = recorder.rows[1][1]
    assert "memopt/drift_max" not in between
    assert not any(k.startswith("memopt/drift/") for k in between)
    for fqn, (_, new) in reports[0].escalated.items():
        assert first[f"memopt/bits/{fqn or '<root>'}"] == float(new)


def test_lean_ops_in_an_accelerate_loop_train_as_the_unpatched_model():
    """``MemOptPlugin`` with every lean op on a prepared Llama: the plain loop's losses within
    1e-5 (the patched forward returns the loss ``accelerator.backward`` takes)."""
    runs = []
    for config in (None, {"ops": {"loss": "chunked", "fuse": ["all"]}}):
        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = Accelerator(cpu=True)
        model, batch, loss_fn = hf_llama(batch_size=4, seq=32, dim=32, layers=1)
        plugin = MemOptPlugin(config) if config else None
        if plugin is not None:
            model = plugin.apply(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
        model, optimizer = accelerator.prepare(model, optimizer)
        losses = []
        for _ in range(4):
            loss = loss_fn(model, batch)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        runs.append(losses)
    assert max(abs(a - b) / b for a, b in zip(*runs, strict=True)) <= 1e-5
    assert {p.lean for p in plugin.memopt.plan.values() if p.lean} == {
        "lean attention", "lean loss", "lean mlp", "lean rmsnorm"
    }  # fmt: skip


def test_save_state_and_load_state_restore_bits_and_history(tmp_path):
    accelerator = Accelerator(cpu=True)
    plugin = MemOptPlugin(TWO_BITS)
    _, reports = _loop(plugin, accelerator, steps=1)
    escalated_bits = plugin.bits
    assert reports[0].escalated
    accelerator.save_state(str(tmp_path))
    assert (tmp_path / "custom_checkpoint_0.pkl").exists()

    AcceleratorState._reset_state(reset_partial_state=True)
    resumed = Accelerator(cpu=True)
    fresh = MemOptPlugin(TWO_BITS)
    model, _, _ = hf_llama(batch_size=4, seq=32, dim=32, layers=1)
    model = fresh.apply(model)
    assert set(fresh.bits.values()) == {2}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = resumed.prepare(model, optimizer)
    fresh.attach(resumed)
    resumed.load_state(str(tmp_path))
    assert fresh.bits == escalated_bits
    assert fresh.steps == 1
    assert fresh.state_dict()["drift"]["history"] == plugin.state_dict()["drift"]["history"]


def test_gradient_accumulation_checks_only_at_optimizer_step_boundaries():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    config = {"quantize": {"bits": 8}, "drift": {"check_every": 1, "threshold": 1.0}}
    plugin = MemOptPlugin(config)
    _, reports = _loop(plugin, accelerator, steps=3, micro=2)
    # 6 micro-batches, 3 boundaries (the 2nd, 4th and 6th micro-batch), a check at each
    assert [r is not None for r in reports] == [False, True] * 3
    assert [r.step for r in reports if r is not None] == [0, 1, 2]
    assert plugin.steps == 3


def test_attach_twice_registers_once():
    accelerator = Accelerator(cpu=True)
    plugin = MemOptPlugin({"quantize": {"bits": 8}})
    plugin.attach(accelerator)
    plugin.attach(accelerator)
    assert accelerator._custom_objects.count(plugin) == 1


def _launch(tmp_path: Path, name: str, *script_args: str) -> list[dict]:
    """``accelerate launch`` the example, rank 1's loss zeroed (``accelerate_rank_one_exact.py``),
    on 2 CPU processes; one JSON summary per rank.

    ``--main_process_port 0``: accelerate picks a free port, which another process may take
    before the rendezvous binds it; such a launch is tried again (at most three times).
    """
    report = tmp_path / name
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
        str(ROOT / "tests" / "accelerate_rank_one_exact.py"),
        "--cpu", "--dim", "32", "--depth", "1", "--block-size", "32", "--batch-size", "4",
        "--report", str(report), *script_args,
    ]  # fmt: skip
    # PYTHONFAULTHANDLER: a rank that crashes prints every thread's Python stack.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONFAULTHANDLER"] = "1"
    for _ in range(3):
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
        if "address already in use" not in done.stderr.lower():
            break
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return [json.loads(Path(f"{report}.rank{r}").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.xfail(
    raises=subprocess.TimeoutExpired,
    strict=False,
    reason="the resumed 2-process launch hangs now and then after training (2 of about 7 "
    "full runs); not yet found. Any other failure still fails the test",
)
def test_two_processes_escalate_identically_and_resume_from_save_state(tmp_path):
    config = tmp_path / "int2.yaml"
    config.write_text("quantize: {bits: 2}\ndrift: {threshold: 0.05, check_every: 5}\n")
    state = tmp_path / "state"
    ranks = _launch(
        tmp_path, "first.json", "--config", str(config), "--max-steps", "6",
        "--save-state", str(state),
    )  # fmt: skip
    assert [r["processes"] for r in ranks] == [2, 2]
    assert ranks[0]["escalation_count"] > 0 and ranks[0]["final_loss"] > 0
    assert ranks[1]["final_loss"] == 0  # rank 1 saw only exact gradients: the reduce moved it
    assert ranks[0]["bits"] == ranks[1]["bits"]
    assert max(ranks[0]["bits"].values()) > 2

    # Resumed at step 6 with checks due at 10: no check runs, so escalated bits can only come
    # from the saved state.
    resumed = _launch(
        tmp_path, "resumed.json", "--config", str(config), "--max-steps", "8",
        "--resume", str(state),
    )  # fmt: skip
    assert [r["steps"] for r in resumed] == [8, 8]
    assert resumed[0]["escalations"] == {} and resumed[1]["escalations"] == {}
    assert resumed[0]["bits"] == ranks[0]["bits"] == resumed[1]["bits"]


def test_a_model_accelerate_compiles_trains_compressed():
    """``Accelerator(dynamo_backend="inductor")`` compiles the patched model in ``prepare``.
    (Nearest rounding: inductor generating the stochastic codec's kernels took ~2 minutes more on
    2 cores; tests/test_compile_rounding.py compiles that codec.)"""
    torch._dynamo.reset()
    accelerator = Accelerator(cpu=True, dynamo_backend="inductor")
    plugin = MemOptPlugin({"quantize": {"bits": 8, "rounding": "nearest"}})
    model, reports = _loop(plugin, accelerator, steps=2)
    assert type(model).__name__ == "OptimizedModule"  # accelerate compiled it
    assert plugin.metrics()["memopt/compression_ratio"] > 3.0
    torch._dynamo.reset()


def _check_sizes(accelerator: Accelerator, form: str) -> list[int]:
    """The sample counts the model's forwards see in a step-0 check at 2 bits, with the loss
    handed over in ``form`` (``batch``: ``loss_fn(model, batch)`` and the batch; ``closure``)."""
    plugin = MemOptPlugin(TWO_BITS)
    model, batch, loss_fn = hf_llama(batch_size=4, seq=32, dim=32, layers=1)
    model = accelerator.prepare(plugin.apply(model))
    unwrapped = accelerator.unwrap_model(model)
    accelerator.backward(loss_fn(model, batch))
    sizes: list[int] = []
    handle = unwrapped.register_forward_pre_hook(
        lambda m, args, kwargs: sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    if form == "batch":
        report = plugin.after_backward(0, loss_fn, batch)
    else:
        sample = plugin.sample(batch)
        report = plugin.after_backward(0, lambda: loss_fn(unwrapped, sample))
    handle.remove()
    plugin.remove()
    assert report is not None and report.escalated  # the check ran and raised 2 bits
    return sizes


def test_a_check_given_the_batch_runs_its_sample_in_pieces():
    """``after_backward(step, loss_of, batch)`` hands the check the batch and the batch-form
    loss, so that its passes run in pieces sized to what the compressed step kept (at 2 bits a
    piece of one sample here), never the sample whole; a closure has the sample run whole."""
    accelerator = Accelerator(cpu=True)
    closure = _check_sizes(accelerator, "closure")
    pieces = _check_sizes(accelerator, "batch")
    assert closure and set(closure) == {4}
    assert pieces and max(pieces) < 4
