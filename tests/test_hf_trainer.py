"""transformers.Trainer callback: escalation and logging, checkpoint/resume, accumulation,
non-interference, activation checkpointing, PEFT/LoRA, the example under DDP.

The held-out model is Hugging Face GPT-2 built from a config (tests/zoo.py: 2 layers, width 64);
the bar of the issue is the first two tests and the LoRA ones.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from memory import peak_above_start, record_check_peaks
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments
from zoo import hf_gpt2

from memopt_plugins import ConfigError, MemOptConfig, MemoryOptimizer
from memopt_plugins.compress.codec import codec_generator
from memopt_plugins.engine import patched_by
from memopt_plugins.transformers import STATE_KEY, MemOptTrainerCallback

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")
TWO_BITS = {
    "quantize": {"bits": 2},
    "drift": {"threshold": 0.05, "check_every": 2},
    "log": {"per_module": True},  # the tests follow each module's bits
}
EIGHT_BITS_NO_ESCALATION = {"quantize": {"bits": 8}, "drift": {"threshold": 1.0, "check_every": 1}}


class Tokens(Dataset):
    """``n`` random token windows as causal-LM samples ``{input_ids, labels}``."""

    def __init__(self, n: int = 64, seq: int = 32):
        self.ids = torch.randint(0, 512, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recorder(TrainerCallback):
    """Keeps every row the Trainer logs, as a ``report_to`` integration sees it.

    Passed before the memopt callback, it runs where integrations run (before user callbacks).
    """

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.rows.append(dict(logs))


def gpt2(dropout: float = 0.0):
    model, _, _ = hf_gpt2(batch_size=4, seq=32, dim=64, layers=2, dropout=dropout)
    return model


def make_trainer(out: Path, callbacks: list, model=None, n: int = 64, **options) -> Trainer:
    settings = dict(
        output_dir=str(out),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    settings.update(options)
    return Trainer(
        model=model if model is not None else gpt2(),
        args=TrainingArguments(**settings),
        train_dataset=Tokens(n),
        callbacks=callbacks,
    )


def memopt_rows(trainer: Trainer, after: int = 0) -> list[dict[str, float]]:
    return [r for r in trainer.state.log_history if "memopt/escalations" in r and r["step"] > after]


def bits_in(row: dict[str, float]) -> dict[str, float]:
    return {
        k.removeprefix("memopt/bits/"): v for k, v in row.items() if k.startswith("memopt/bits/")
    }


def named(bits: dict[str, int]) -> dict[str, float]:
    return {(f or "<root>"): float(b) for f, b in bits.items()}


# --------------------------------------------------------------------------- the bar
class Lines(logging.Handler):
    """Keeps the messages of the records it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def two_bit_run(tmp_path_factory, one_thread):
    """3 steps from 2 bits, checks at steps 0 and 2, ``checkpoint-3`` saved; INFO lines kept."""
    out = tmp_path_factory.mktemp("two_bits")
    recorder, memopt = Recorder(), MemOptTrainerCallback(TWO_BITS)
    trainer = make_trainer(out, [recorder, memopt], save_strategy="steps", save_steps=3)
    lines, logger = Lines(), logging.getLogger("memopt")
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        trainer.train()
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    return trainer, memopt, recorder, lines.messages, out


def test_two_bit_run_escalates_and_logs_memopt_metrics(two_bit_run):
    trainer, memopt, recorder, messages, _ = two_bit_run
    rows = memopt_rows(trainer)
    assert [r["step"] for r in rows] == [1, 2, 3]  # every logging step (logging_steps=1)
    first = rows[0]
    assert first["memopt/drift_max"] >= 0 and first["memopt/escalations"] > 0
    assert first["memopt/bits/transformer.h.0.mlp.c_fc"] > 2  # escalated from 2 bits
    assert first["memopt/compression_ratio"] > 1.0 and first["memopt/kept_bytes"] > 0
    # drift values belong to the rows of the checks (steps 0 and 2, logged at 1 and 3)
    assert ["memopt/drift_max" in r for r in rows] == [True, False, True]
    logged: dict[str, float] = {}  # a module's bits are logged when they change
    for row in rows:
        logged.update(bits_in(row))
    assert logged == named(memopt.bits) and len(bits_in(rows[1])) < len(logged)
    assert all(r["memopt/bits_mean"] > 2 for r in rows)
    # the Trainer's own rows are all there (its should_log survives memopt's rows)...
    assert [r["step"] for r in trainer.state.log_history if "loss" in r] == [1, 2, 3]
    # ...and an integration called before the memopt callback got memopt's rows too
    seen = [r for r in recorder.rows if "memopt/escalations" in r]
    assert [r["memopt/escalations"] for r in seen] == [r["memopt/escalations"] for r in rows]

    # one INFO line per check: what it raised, from what to what, and why
    history = memopt.state_dict()["drift"]["history"]
    assert [h["step"] for h in history] == [0, 2]
    lines = [m for m in messages if "memopt: drift check at step" in m]
    climbed = sum(len(h["escalated"]) for h in history)
    assert len(lines) == len(history) and rows[-1]["memopt/escalations"] >= climbed > 0
    raised = history[0]["escalated"]
    assert f"{len(raised)} of " in lines[0] and "threshold 0.05" in lines[0]
    assert any(f"{f or '<root>'} {old} -> " in lines[0] for f, (old, _) in raised.items())


def test_rows_printed_with_disable_tqdm_hold_the_compact_metric_set(tmp_path, capsys):
    """``disable_tqdm=True`` prints every logged row: with the int4_drift preset (checks every 2
    steps) each of memopt's rows holds at most 25 ``memopt/`` keys, not one per module."""
    preset = Path(__file__).resolve().parents[1] / "configs" / "int4_drift.yaml"
    config = MemOptConfig.from_yaml(preset).with_changes(drift={"check_every": 2, "sample_size": 2})
    memopt = MemOptTrainerCallback(config)
    trainer = make_trainer(tmp_path, [memopt])
    trainer.train()
    printed = [line for line in capsys.readouterr().out.splitlines() if "'memopt/" in line]
    assert len(printed) == 3 and len(memopt.bits) > 25
    assert all(line.count("'memopt/") <= 25 for line in printed)
    assert all("'memopt/batch_fits_x'" in line for line in printed)


def test_checkpoint_holds_memopt_state(two_bit_run):
    _, memopt, _, _, out = two_bit_run
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    saved = state["stateful_callbacks"]["MemOptTrainerCallback"][STATE_KEY]
    assert saved["bits"] == memopt.bits and max(saved["bits"].values()) > 2
    assert [h["step"] for h in saved["drift"]["history"]] == [0, 2]
    assert saved["drift"]["steps"] == 3


@pytest.mark.parametrize("restore_flag", [False, True])
def test_resumed_trainer_starts_from_the_checkpointed_bits(two_bit_run, tmp_path, restore_flag):
    _, first, _, _, out = two_bit_run
    resumed = MemOptTrainerCallback(TWO_BITS)
    trainer = make_trainer(
        out, [resumed], max_steps=4, restore_callback_states_from_checkpoint=restore_flag
    )
    assert set(resumed.bits.values()) == {2}  # a fresh model, patched at 2 bits
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    # Step 3 has no check due (every 2): the bits it logs can only come from the checkpoint.
    (row,) = memopt_rows(trainer, after=3)
    assert bits_in(row) == named(first.bits)
    assert "memopt/drift_max" not in row
    state = resumed.state_dict()
    assert [h["step"] for h in state["drift"]["history"]] == [0, 2] and state["drift"]["steps"] == 4
    # with the flag the Trainer swapped the callback for a copy; the user's instance is back
    assert sum(c is resumed for c in trainer.callback_handler.callbacks) == 1


@pytest.mark.parametrize("restore_flag", [False, True])
def test_the_trainer_says_what_lightning_says_and_a_resumed_plan_names_the_bits_it_runs_at(
    two_bit_run, tmp_path, restore_flag
):
    """The console of a Trainer run has the Lightning callback's lines: the plan when training
    starts, the first step's memory (once, with the figure its row logs), each check. A resumed
    run's plan counts the bits the checkpoint laid (escalated modules at their widths), not the
    config's, whether or not the Trainer swaps the callback for a copy."""
    trainer, _, _, messages, out = two_bit_run
    (plan,) = [m for m in messages if m.startswith("memopt: plan for")]
    (first,) = [m for m in messages if "first training step kept" in m]
    assert "compress@2" in plan and "every 2 steps" in plan
    fits = float(first.split("a batch ")[1].split("x as large")[0])
    assert fits == round(memopt_rows(trainer)[0]["memopt/batch_fits_x"], 1)

    resumed = MemOptTrainerCallback(TWO_BITS)
    again = make_trainer(
        out, [resumed], max_steps=4, restore_callback_states_from_checkpoint=restore_flag
    )
    lines, logger = Lines(), logging.getLogger("memopt")
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        again.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    (plan,) = [m for m in lines.messages if m.startswith("memopt: plan for")]
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    saved = list(state["stateful_callbacks"]["MemOptTrainerCallback"][STATE_KEY]["bits"].values())
    widths = {b: saved.count(b) for b in set(saved)}
    assert len(widths) > 1 and max(widths) > 2  # the checkpoint's escalations: more than 2 bits
    counts = re.findall(r"(\d+) compress@(\d+)", plan)
    assert {int(b): int(n) for n, b in counts} == widths, plan


# --------------------------------------------------------------------------- the loop
def test_checks_at_optimizer_steps_on_a_slice_of_the_last_micro_batch(tmp_path):
    """Gradient accumulation 2: 10 micro-batches, 5 optimizer steps, checks at 0, 2, 4, each on
    the first drift.sample_size samples of the step's last micro-batch (in pieces)."""
    seen: list[torch.Tensor] = []  # input_ids of every forward with grad (training and checks)
    checked: list[bool] = []

    def loss_fn(model, inputs):
        # each of the check's forwards runs a piece of the first 3 samples of the step's last
        # training forward (the last whole batch seen)
        ids, last = inputs["input_ids"], next(i for i in reversed(seen) if len(i) == 4)
        checked.append(any(torch.equal(ids, last[i : i + len(ids)]) for i in range(3)))
        return model(**inputs).loss

    memopt = MemOptTrainerCallback(
        {"quantize": {"bits": 8}, "drift": {"check_every": 2, "sample_size": 3}}, loss_fn=loss_fn
    )
    trainer = make_trainer(tmp_path, [memopt], max_steps=5, gradient_accumulation_steps=2, n=40)

    def record(module, args, kwargs):
        if torch.is_grad_enabled():
            seen.append(kwargs["input_ids"])

    trainer.model.register_forward_pre_hook(record, with_kwargs=True)
    trainer.train()
    state = memopt.state_dict()["drift"]
    assert [h["step"] for h in state["history"]] == [0, 2, 4]
    assert state["steps"] == 5  # optimizer steps, not the 10 micro-batches
    assert len(checked) >= 6 and all(checked)  # an exact and a compressed pass per check
    assert sum(len(ids) == 4 for ids in seen) == 10  # the training forwards, whole batches


def test_the_check_runs_the_trainers_own_loss(tmp_path):
    """With compute_loss_func the Trainer takes the labels out of the model's inputs: the check
    goes through compute_loss, and so through compute_loss_func, on pieces of the sliced batch."""
    sizes: list[int] = []

    def compute_loss_func(outputs, labels, num_items_in_batch=None):
        sizes.append(labels.shape[0])
        logits = outputs.logits[:, :-1].flatten(0, 1)
        return torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten())

    memopt = MemOptTrainerCallback({"quantize": {"bits": 2}, "drift": {"sample_size": 2}})
    trainer = make_trainer(tmp_path, [memopt], max_steps=1)
    trainer.compute_loss_func = compute_loss_func
    trainer.train()
    # the step's 4 samples, then the check's 2-sample slice in pieces of what 2 bits kept
    assert sizes[0] == 4 and set(sizes[1:]) == {1} and len(sizes) >= 5
    assert memopt.state_dict()["drift"]["escalations"] > 0


def test_the_check_runs_compute_loss_on_pieces_of_its_sample(tmp_path):
    """The check is handed ``compute_loss`` as ``loss_fn(model, inputs)`` and its 4-sample slice,
    so its passes run pieces sized to what the 2-bit step kept (one sample of a 4-sample batch
    keeps more uncompressed than the whole batch at 2 bits): never the slice whole."""
    sizes: list[int] = []
    memopt = MemOptTrainerCallback({"quantize": {"bits": 2}, "drift": {"sample_size": 4}})
    trainer = make_trainer(tmp_path, [memopt], max_steps=1)
    compute_loss = trainer.compute_loss

    def counted(model, inputs, *args, **kwargs):
        sizes.append(inputs["input_ids"].shape[0])
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = counted
    trainer.train()
    assert sizes[0] == 4  # the training step
    checked = sizes[1:]  # the check's exact, signed-halves and compressed passes
    assert len(checked) >= 3 and max(checked) < 4 and sum(checked) % 4 == 0
    assert memopt.state_dict()["drift"]["history"][0]["step"] == 0


def test_a_checks_metrics_land_in_the_row_of_the_step_it_ran_in(tmp_path):
    """Checks every 2 steps, rows every 3: a check's ``drift_max`` is in the row the Trainer
    numbers for the optimizer step that ran it (its ``global_step`` then, plus one: the Trainer
    counts the step taken), never in a later step's row; a logging step without a check has no
    drift value."""
    memopt = MemOptTrainerCallback({"quantize": {"bits": 2}, "drift": {"check_every": 2}})
    checks: list[tuple[int, float]] = []  # (the Trainer's number for the step, the check's max)
    check = memopt.memopt.check_drift

    def recorded(*args, **kwargs):
        report = check(*args, **kwargs)
        checks.append((trainer.state.global_step + 1, report.max))
        return report

    memopt.memopt.check_drift = recorded
    trainer = make_trainer(tmp_path, [memopt], max_steps=5, logging_steps=3)
    trainer.train()
    rows = memopt_rows(trainer)
    assert [c for c, _ in checks] == [1, 3, 5]
    assert [(r["step"], r["memopt/drift_max"]) for r in rows if "memopt/drift_max" in r] == checks
    assert [r["step"] for r in rows] == [1, 3, 5]  # the check's steps (3 is a logging step too)
    assert [r["step"] for r in trainer.state.log_history if "loss" in r] == [3]


def check_over_step(model, batch_size: int, seq: int, tmp_path: Path) -> float:
    """The drift check's peak over the int4 training step's it guards (``Trainer.training_step``:
    forward and backward), at step 1 of a Trainer run (checks every step, the default drift
    section otherwise), each above where it started."""
    memopt = MemOptTrainerCallback({"quantize": {"bits": 4}, "drift": {"check_every": 1}})
    checks = record_check_peaks(memopt.memopt)
    trainer = make_trainer(
        tmp_path, [memopt], model=model, max_steps=2, per_device_train_batch_size=batch_size
    )
    trainer.train_dataset = Tokens(2 * batch_size, seq)
    steps: list[int] = []
    training_step = trainer.training_step

    def measured(*args, **kwargs):
        out = None

        def run() -> None:
            nonlocal out
            out = training_step(*args, **kwargs)

        steps.append(peak_above_start(run)[0])
        return out

    trainer.training_step = measured
    trainer.train()
    assert len(checks) == len(steps) == 2
    return checks[1] / steps[1]


def test_a_check_through_the_trainer_peaks_no_higher_than_the_step_it_guards(tmp_path):
    """GPT-2 (2 layers x 128, eager attention), 16 x 128 tokens at 4 bits: the check's 8-sample
    slice run whole kept more than the compressed step; run through ``compute_loss`` in pieces of
    what the step kept, the check peaks within 10% of the step."""
    model, _, _ = hf_gpt2(batch_size=16, seq=128, dim=128, layers=2)
    ratio = check_over_step(model, batch_size=16, seq=128, tmp_path=tmp_path)
    assert ratio <= 1.10, ratio


class OwnLossTrainer(Trainer):
    """A Trainer whose training_step computes the loss itself, without compute_loss."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        loss = model(**self._prepare_inputs(inputs)).loss
        self.accelerator.backward(loss)
        return loss.detach()


def test_a_trainer_that_bypasses_compute_loss_is_told_once_that_no_check_runs(tmp_path, caplog):
    memopt = MemOptTrainerCallback({"quantize": {"bits": 8}, "drift": {"check_every": 1}})
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
        report_to="none", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    trainer = OwnLossTrainer(model=gpt2(), args=args, train_dataset=Tokens(), callbacks=[memopt])
    with caplog.at_level(logging.WARNING, logger="memopt"):
        trainer.train()
    warnings = [r.getMessage() for r in caplog.records if "no drift check" in r.getMessage()]
    assert len(warnings) == 1 and "compute_loss" in warnings[0]
    assert memopt.state_dict()["drift"]["history"] == []


def test_a_check_that_escalates_nothing_leaves_training_bit_for_bit_unchanged(tmp_path):
    """Dropout on, accumulation 2: with the check every step and with drift off, same weights."""
    runs = []
    for drift in (EIGHT_BITS_NO_ESCALATION["drift"], {"enabled": False}):
        memopt = MemOptTrainerCallback({"quantize": {"bits": 8}, "drift": drift})
        trainer = make_trainer(
            tmp_path / str(len(runs)), [memopt], model=gpt2(dropout=0.1),
            max_steps=3, gradient_accumulation_steps=2,
        )  # fmt: skip
        codec_generator("cpu").manual_seed(1)  # stochastic rounding: both runs draw the same noise
        trainer.train()
        runs.append((trainer, memopt))
    (_, on), (_, off) = runs
    assert len(on.state_dict()["drift"]["history"]) == 3
    assert not off.state_dict()["drift"]["history"]
    assert on.state_dict()["drift"]["escalations"] == 0
    losses = [[r["loss"] for r in t.state.log_history if "loss" in r] for t, _ in runs]
    assert losses[0] == losses[1]
    for a, b in zip(runs[0][0].model.parameters(), runs[1][0].model.parameters(), strict=True):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- set-up, tear-down
def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_patched_at_construction_restored_after_training_and_a_second_train_carries_on(tmp_path):
    memopt = MemOptTrainerCallback(TWO_BITS)
    model = gpt2()
    keys = list(model.state_dict())
    trainer = make_trainer(tmp_path, [memopt], model=model, max_steps=1)
    assert patched_by(model) is memopt.memopt and _hooks(model) > 0  # before train()
    trainer.train()
    assert patched_by(model) is None and _hooks(model) == 0 and list(model.state_dict()) == keys
    assert "compute_loss" not in vars(trainer)  # the Trainer's own method again
    escalated = memopt.bits
    assert max(escalated.values()) > 2  # kept after the patch is gone
    trainer.train()  # patched again, from the bits the first train() ended with
    (row,) = memopt_rows(trainer)
    assert all(bits_in(row)[f] >= b for f, b in named(escalated).items())
    assert [h["step"] for h in memopt.state_dict()["drift"]["history"]] == [0, 0]


def test_the_model_trained_is_patched_when_added_late_or_built_by_model_init(tmp_path):
    late = MemOptTrainerCallback({"quantize": {"bits": 4}})
    trainer = make_trainer(tmp_path, [], max_steps=1)
    trainer.add_callback(late)  # after __init__: patched when training begins
    trainer.train()
    assert memopt_rows(trainer)[0]["memopt/compression_ratio"] > 4.0

    memopt = MemOptTrainerCallback({"quantize": {"bits": 4}})
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4,
        report_to="none", use_cpu=True, disable_tqdm=True, logging_steps=1,
    )  # fmt: skip
    trainer = Trainer(
        model_init=lambda: gpt2(), args=args, train_dataset=Tokens(), callbacks=[memopt]
    )
    built_first = trainer.model
    assert patched_by(built_first) is memopt.memopt
    trainer.train()  # model_init builds the model again: the patch moves to that one
    assert trainer.model is not built_first and patched_by(built_first) is None
    assert memopt_rows(trainer)[0]["memopt/compression_ratio"] > 4.0


def test_trainer_checkpointing_with_a_recompute_config_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        make_trainer(
            tmp_path, [MemOptTrainerCallback({"recompute": {"modules": ["*.mlp"]}})],
            activation_checkpointing=True,
        )  # fmt: skip
    # compression alone trains under the Trainer's checkpointing
    memopt = MemOptTrainerCallback({"quantize": {"bits": 8}})
    trainer = make_trainer(tmp_path, [memopt], max_steps=1, activation_checkpointing=True)
    assert trainer.model.transformer.gradient_checkpointing is False  # memopt patched first
    trainer.train()
    assert trainer.model.transformer.gradient_checkpointing is True
    assert memopt_rows(trainer)[0]["memopt/compression_ratio"] > 1.0


def test_a_bad_config_fails_when_the_callback_is_built():
    with pytest.raises(ConfigError, match="Did you mean 'bits'"):
        MemOptTrainerCallback({"quantize": {"bitz": 4}})


# --------------------------------------------------------------------------- PEFT / LoRA
def lora_gpt2():
    from peft import LoraConfig, get_peft_model

    model = gpt2()
    config = LoraConfig(
        r=8,
        target_modules=["c_attn", "c_proj", "c_fc"],
        fan_in_fan_out=True,
        lora_dropout=0.0,
        init_lora_weights=False,  # random B too, so that every adapter has a gradient
    )
    return get_peft_model(model, config)


class Packs:
    """A PackObserver: what the compression hooks were handed, and which of it they compressed."""

    def __init__(self) -> None:
        self.compressed: list[int] = []  # storage addresses
        self.kept: list[int] = []

    def packed(self, t, saved, added):
        (self.kept if saved is t else self.compressed).append(t.untyped_storage().data_ptr())


def test_lora_compresses_activations_only_and_adapter_gradients_stay_within_2_percent():
    model = lora_gpt2()
    batch = torch.randint(0, 512, (8, 32))

    def loss_fn(model, batch):
        return model(input_ids=batch, labels=batch).loss

    adapters = [p for p in model.parameters() if p.requires_grad]
    frozen = {p.untyped_storage().data_ptr() for p in model.parameters() if not p.requires_grad}
    assert adapters and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    exact = torch.autograd.grad(loss_fn(model, batch), adapters)

    opt = MemoryOptimizer({"quantize": {"bits": 8}})
    opt.apply(model)
    packs = Packs()
    with opt.internal.compression.observed(packs):
        compressed = torch.autograd.grad(loss_fn(model, batch), adapters)
    opt.remove()
    # frozen base weights are saved for the input gradient, and kept as they are
    assert frozen & set(packs.kept) and not frozen & set(packs.compressed)
    assert len(packs.compressed) > 20
    error = torch.cat([(a - b).flatten() for a, b in zip(compressed, exact, strict=True)]).norm()
    relative = float(error / torch.cat([g.flatten() for g in exact]).norm())
    assert relative < 0.02, relative  # measured 0.9%


def test_lora_model_trains_under_the_trainer_with_its_adapters_checked(tmp_path):
    # min_numel 0: the rank-8 inputs of the B matrices are compressed (and judged) too
    config = {
        "quantize": {"bits": 8, "min_numel": 0},
        "drift": {"check_every": 1},
        "log": {"per_module": True},
    }
    memopt = MemOptTrainerCallback(config)
    trainer = make_trainer(tmp_path, [memopt], model=lora_gpt2(), max_steps=2)
    trainer.train()
    row = memopt_rows(trainer)[0]
    adapters = {k: v for k, v in row.items() if k.startswith("memopt/drift/") and ".lora_" in k}
    assert len(adapters) == 2 * 4 * 2  # A and B of 4 projections in each of 2 layers
    assert max(adapters.values()) < 0.03 and row["memopt/escalations"] == 0  # measured 1.5%
    assert "memopt/bits/base_model.model.transformer.h.0.attn.c_attn.base_layer" in row


# --------------------------------------------------------------------------- the example, DDP
@pytest.mark.slow
def test_example_under_ddp_keeps_ranks_identical_and_checkpoints_state(tmp_path):
    """Two processes over gloo, LoRA, accumulation 2: same checks, bits and weights everywhere."""
    config = tmp_path / "int2.yaml"
    config.write_text("quantize: {bits: 2}\ndrift: {threshold: 0.05, check_every: 2}\n")
    report = tmp_path / "summary.json"
    cmd = [
        # --standalone: the rendezvous store binds a free port itself (no port to race for)
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "examples" / "train_hf_trainer.py"), "--cpu", "--config", str(config),
        "--max-steps", "3", "--dim", "64", "--depth", "1", "--block-size", "32",
        "--batch-size", "4", "--accumulate", "2", "--lora", "4",
        "--logging-steps", "1", "--save-steps", "3",
        "--output-dir", str(tmp_path / "run"), "--report", str(report),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    ranks = [json.loads(Path(f"{report}.rank{r}").read_text()) for r in range(2)]
    assert [r["processes"] for r in ranks] == [2, 2]
    assert ranks[0]["checks"] == ranks[1]["checks"] == [0, 2]
    assert ranks[0]["escalations"] == ranks[1]["escalations"] > 0
    assert ranks[0]["bits"] == ranks[1]["bits"] and max(ranks[0]["bits"].values()) > 2
    assert any(".lora_A." in fqn for fqn in ranks[0]["bits"])
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]  # the replicas stayed equal
    assert [len(r["logged"]) for r in ranks] == [3, 3]
    state = json.loads((tmp_path / "run" / "checkpoint-3" / "trainer_state.json").read_text())
    assert (
        state["stateful_callbacks"]["MemOptTrainerCallback"][STATE_KEY]["bits"] == ranks[0]["bits"]
    )


def test_lean_ops_under_the_trainer_train_as_the_model_does(tmp_path):
    """The chunked loss head under the Trainer (which passes num_items_in_batch to the model):
    the training losses are those of a Trainer without memopt, and evaluation, in eval mode,
    runs the model's own forward (its loss equal too)."""
    lean = {"ops": {"loss": "chunked", "fuse": ["gelu"]}}
    runs = []
    for callbacks in ([], [MemOptTrainerCallback(lean)]):
        trainer = make_trainer(tmp_path / str(len(runs)), callbacks)
        trainer.train()
        losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        runs.append((losses, trainer.evaluate(Tokens(16))["eval_loss"]))
    (plain, plain_eval), (mine, mine_eval) = runs
    assert len(mine) == 3 and all(
        abs(a - b) <= 1e-5 * abs(b) for a, b in zip(mine, plain, strict=True)
    )
    assert abs(mine_eval - plain_eval) <= 1e-5 * abs(plain_eval)
