"""Lightning callback: patching, drift checks in the loop, logging, checkpoint/resume, DDP, CLI.

The held-out model is Hugging Face GPT-2 built from a config (tests/zoo.py), wrapped in a
LightningModule; the bar of the issue is the first two tests.
"""

from __future__ import annotations

import csv
import json
import logging
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import BatchSizeFinder, Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from memopt_plugins.callbacks import MemOptCallback, MemOptProfileCallback
from memory import AllocationPeak, record_check_peaks
from probes import BitsAtFirstBatch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from zoo import hf_gpt2

from memopt_plugins import ConfigError, MemOptConfig
from memopt_plugins.engine import patched_by

TWO_BITS_YAML = """\
quantize:
  bits: 2
drift:
  threshold: 0.05
  check_every: 3
  sample_size: 2
"""


pytestmark = pytest.mark.usefixtures("one_thread")


class GPT2Module(pl.LightningModule):
    """Hugging Face GPT-2 (1 layer, width 32 by default) as a LightningModule.

    Args:
        lr: SGD learning rate.
        seq, dim, layers: the GPT-2's context, width and depth.
    """

    def __init__(self, lr: float = 0.01, seq: int = 32, dim: int = 32, layers: int = 1):
        super().__init__()
        self.lr = lr
        self.model, _, self.loss_fn = hf_gpt2(batch_size=4, seq=seq, dim=dim, layers=layers)
        self.log_calls = 0

    def forward(self, **inputs):
        return self.model(**inputs)

    def log(self, *args, **kwargs):
        self.log_calls += 1
        super().log(*args, **kwargs)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.loss_fn(self, tokens)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loader(n: int = 32, batch_size: int = 4, seq: int = 32) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (n, seq), generator=generator)
    return DataLoader(TensorDataset(tokens), batch_size)


def make_trainer(root: Path, callbacks: list[Callback], **kwargs) -> pl.Trainer:
    options = dict(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=CSVLogger(root, name="run"),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


def csv_rows(trainer: pl.Trainer) -> list[dict[str, str]]:
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


# --------------------------------------------------------------------------- the bar
def test_two_bit_yaml_escalates_logs_csv_and_checkpoints_state(tmp_path, caplog):
    memopt = MemOptCallback(yaml_config(tmp_path))
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(tmp_path, [memopt, ckpt], enable_checkpointing=True, max_steps=2)
    with caplog.at_level(logging.INFO, logger="memopt"):
        trainer.fit(GPT2Module(), loader())

    rows = csv_rows(trainer)
    logged = {k for row in rows for k, v in row.items() if v != ""}
    escalations = [float(r["memopt/escalations"]) for r in rows if r["memopt/escalations"]]
    assert "memopt/drift_max" in logged
    assert max(escalations) > 0
    assert {"memopt/kept_bytes", "memopt/compression_ratio", "memopt/bits_mean"} <= logged
    assert not any(k.startswith(("memopt/bits/", "memopt/drift/")) for k in logged)  # opt-in

    state = torch.load(tmp_path / "ckpt" / "epoch=0-step=2.ckpt", weights_only=False)
    saved = state["callbacks"]["MemOptCallback"]
    assert saved["bits"] == memopt.bits
    assert max(saved["bits"].values()) > 2
    assert saved["drift"]["history"][0]["step"] == 0
    assert saved["drift"]["escalations"] == max(escalations)

    # the console: one line per check, naming each module it raised (old -> new bits)
    messages = [r.getMessage() for r in caplog.records]
    checks = [m for m in messages if "drift check at step 0" in m]
    raised = saved["drift"]["history"][0]["escalated"]
    assert len(checks) == 1 and raised
    assert f"{len(raised)} of " in checks[0] and " modules raised: " in checks[0]
    named = [f for f, (old, _) in raised.items() if f"{f} {old} -> " in checks[0]]
    assert len(named) == min(len(raised), 8)  # the line names 8, counts the rest


def test_resumed_run_starts_with_escalated_bits(tmp_path):
    first = MemOptCallback(yaml_config(tmp_path))
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(tmp_path, [first, ckpt], enable_checkpointing=True, max_steps=2)
    trainer.fit(GPT2Module(), loader())
    escalated = first.bits
    assert max(escalated.values()) > 2

    resumed = MemOptCallback(yaml_config(tmp_path))
    probe = BitsAtFirstBatch(resumed)
    trainer = make_trainer(tmp_path, [resumed, probe], max_steps=3)  # step 2: no check due
    trainer.fit(GPT2Module(), loader(), ckpt_path=tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    assert probe.bits == escalated
    assert resumed.state_dict()["drift"]["history"][-1]["step"] == 0  # no new check ran


def yaml_config(tmp_path: Path) -> str:
    path = tmp_path / "int2.yaml"
    path.write_text(TWO_BITS_YAML)
    return str(path)


# --------------------------------------------------------------------------- the loop
def test_drift_check_does_not_duplicate_training_step_logs(tmp_path):
    memopt = MemOptCallback({"quantize": {"bits": 4}, "drift": {"check_every": 1}})
    module = GPT2Module()
    trainer = make_trainer(tmp_path, [memopt], max_steps=3)
    trainer.fit(module, loader())
    history = memopt.state_dict()["drift"]["history"]
    assert [h["step"] for h in history] == [0, 1, 2]  # a check (a training_step) every step
    assert module.log_calls == 3  # ...whose self.log calls went nowhere
    train_loss_rows = [r for r in csv_rows(trainer) if r["train_loss"]]
    assert len(train_loss_rows) == 3


class CountingModule(GPT2Module):
    """Counts its training samples in a torchmetrics metric, as users count accuracy."""

    def __init__(self):
        super().__init__()
        self.samples = torchmetrics.SumMetric()

    def training_step(self, batch, batch_idx):
        self.samples.update(torch.tensor(float(len(batch[0]))))
        return super().training_step(batch, batch_idx)


def test_drift_checks_leave_torchmetrics_state_as_they_found_it(tmp_path):
    """The check's own training_step calls (three passes each on a slice of 2) update no metric:
    the sum counts the 12 samples of 3 steps of 4, as without memopt (it counted 30)."""
    memopt = MemOptCallback({"quantize": {"bits": 4}, "drift": {"check_every": 1}})
    module = CountingModule()
    make_trainer(tmp_path, [memopt], max_steps=3).fit(module, loader())
    assert len(memopt.state_dict()["drift"]["history"]) == 3
    assert module.samples.compute().item() == 12
    assert module.samples._update_count == 3


def test_checks_run_at_optimizer_step_boundaries_under_accumulation(tmp_path):
    memopt = MemOptCallback({"quantize": {"bits": 4}, "drift": {"check_every": 2}})
    trainer = make_trainer(tmp_path, [memopt], max_steps=5, accumulate_grad_batches=2)
    trainer.fit(GPT2Module(), loader(n=40))
    assert trainer.global_step == 5
    history = memopt.state_dict()["drift"]["history"]
    assert [h["step"] for h in history] == [0, 2, 4]
    assert memopt.state_dict()["drift"]["steps"] == 5  # optimizer steps, not the 10 batches


def test_metrics_respect_log_every_n_steps_and_checks_log_at_their_step(tmp_path):
    memopt = MemOptCallback({"quantize": {"bits": 8}, "drift": {"check_every": 4}})
    trainer = make_trainer(tmp_path, [memopt], max_steps=6, log_every_n_steps=2)
    trainer.fit(GPT2Module(), loader())
    rows = csv_rows(trainer)
    bits_steps = sorted(int(r["step"]) for r in rows if r["memopt/kept_bytes"])
    drift_steps = sorted(int(r["step"]) for r in rows if r["memopt/drift_max"])
    assert drift_steps == [0, 4]
    assert bits_steps == [0, 1, 3, 4, 5]  # every 2nd step, plus the steps of the checks


def test_fit_start_summary_goes_to_the_memopt_logger(tmp_path, caplog):
    memopt = MemOptCallback({"quantize": {"bits": 4}, "drift": {"enabled": False}})
    with caplog.at_level(logging.INFO, logger="memopt"):
        make_trainer(tmp_path, [memopt], max_steps=1).fit(GPT2Module(), loader())
    text = caplog.text
    n_compressed = len(memopt.state_dict()["bits"])
    assert f"{n_compressed} compress@4" in text
    assert "drift off" in text
    line = next(r.getMessage() for r in caplog.records if "kept" in r.getMessage())
    ratio = float(line.split("(")[1].split("x less")[0])
    assert ratio > 4.0  # 4-bit storage of float32 activations


def test_profile_callback_measures_the_first_batch_under_the_memopt_callbacks_plan(
    tmp_path, caplog
):
    """MemOptProfileCallback beside MemOptCallback: the table of the first batch is measured
    under the callback's config (4 bits), and the patch is back for training."""
    memopt = MemOptCallback({"quantize": {"bits": 4}, "drift": {"enabled": False}})
    probe = BitsAtFirstBatch(memopt)
    callbacks = [memopt, MemOptProfileCallback(top=3), probe]
    trainer = make_trainer(tmp_path, callbacks, max_steps=1)
    with caplog.at_level(logging.INFO, logger="memopt"):
        trainer.fit(GPT2Module(), loader())
    table = next(r.getMessage() for r in caplog.records if "by module" in r.getMessage())
    assert "compress 4" in table and len(table.splitlines()) == 1 + 2 + 3  # title, header, top 3
    assert (Path(trainer.log_dir) / "memopt_profile.png").read_bytes()[:4] == b"\x89PNG"
    assert probe.bits and set(probe.bits.values()) == {4}
    # every picture the Markdown links is written beside it
    folder = Path(trainer.log_dir)
    linked = re.findall(r"!\[[^]]*\]\(([^)]+)\)", (folder / "memopt_profile.md").read_text())
    assert linked == ["memopt_profile.png", "memopt_timeline.png"]
    assert all((folder / name).read_bytes()[:4] == b"\x89PNG" for name in linked)
    # the training patch's lines once: the profile's own patch and the put-back say nothing
    messages = [r.getMessage() for r in caplog.records]
    assert sum("compressing what autograd saves" in m for m in messages) == 1
    assert sum("by module" in m for m in messages) == 1
    # the state of the optimizer configure_optimizers returned is counted (SGD: none)
    assert "optimizer state" in (folder / "memopt_profile.md").read_text()


def test_the_console_the_metrics_and_the_profile_give_one_batch_fits_figure(tmp_path, caplog):
    """How many times larger a batch fits, for the step the profile measured: the console line,
    ``memopt/batch_fits_x`` of that step and ``memopt_profile.md`` say the same number, and the
    number the later steps log follows it, not the compression ratio."""
    memopt = MemOptCallback({"quantize": {"bits": 4}, "drift": {"enabled": False}})
    trainer = make_trainer(tmp_path, [memopt, MemOptProfileCallback(top=3)], max_steps=2)
    with caplog.at_level(logging.INFO, logger="memopt"):
        trainer.fit(GPT2Module(), loader())
    (line,) = [m for m in caplog.messages if "first training step kept" in m]
    console = float(re.search(r"a batch ([0-9.]+)x as large fits", line)[1])
    markdown = (Path(trainer.log_dir) / "memopt_profile.md").read_text()
    profiled = float(re.search(r"a batch ([0-9.]+)x as large fits", markdown)[1])
    rows = [r for r in csv_rows(trainer) if r["memopt/kept_bytes"]]
    logged = float(rows[0]["memopt/batch_fits_x"])
    assert console == profiled == round(logged, 1)
    # the line's "saved" figure is the hooks' own count, named so beside the profile's storages
    assert "its hooks were handed" in line and "the model saves" not in line
    assert abs(float(rows[1]["memopt/batch_fits_x"]) - logged) < 0.15 * logged
    assert logged < 0.9 * float(rows[0]["memopt/compression_ratio"])


def test_a_bad_config_fails_when_the_callback_is_built():
    with pytest.raises(ConfigError, match="Did you mean 'bits'"):
        MemOptCallback({"quantize": {"bitz": 4}})


class NoLossModule(GPT2Module):
    def training_step(self, batch, batch_idx):
        return {"loss": super().training_step(batch, batch_idx), "tokens": batch[0]}


def test_training_step_output_without_a_loss_tensor_is_refused_by_the_check(tmp_path):
    class Nothing(GPT2Module):
        def training_step(self, batch, batch_idx):
            super().training_step(batch, batch_idx)  # Lightning skips the batch's backward

    memopt = MemOptCallback({"quantize": {"bits": 4}})
    with pytest.raises(MisconfigurationException, match="loss_fn"):
        make_trainer(tmp_path, [memopt], max_steps=1).fit(Nothing(), loader())
    # a dict with "loss" is what Lightning accepts, and so does the check
    memopt = MemOptCallback({"quantize": {"bits": 4}})
    make_trainer(tmp_path, [memopt], max_steps=1).fit(NoLossModule(), loader())
    assert memopt.state_dict()["drift"]["history"][0]["step"] == 0


class SizesSeen(GPT2Module):
    """Records the sample count of every ``training_step`` call (training's and the checks')."""

    def __init__(self, **size):
        super().__init__(**size)
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        self.sizes.append(batch[0].shape[0])
        return super().training_step(batch, batch_idx)


def test_the_check_runs_training_step_on_pieces_of_its_sample():
    """The check is handed ``training_step`` as ``loss_fn(module, batch)`` and its 4-sample slice,
    so its passes run pieces sized to what the 2-bit step kept (one sample of a 4-sample batch
    keeps more uncompressed than the whole batch at 2 bits): never the slice whole."""
    module = SizesSeen()
    memopt = MemOptCallback({"quantize": {"bits": 2}, "drift": {"sample_size": 4}})
    make_trainer(Path("."), [memopt], max_steps=1, logger=False).fit(module, loader())
    assert module.sizes[0] == 4  # the training step
    checked = module.sizes[1:]  # the check's exact, signed-halves and compressed passes
    assert len(checked) >= 3 and max(checked) < 4 and sum(checked) % 4 == 0
    assert memopt.state_dict()["drift"]["history"][0]["step"] == 0


class StepPeak(Callback):
    """The CPU allocator's peak over training step ``at``: from its batch's start to the optimizer
    step, before the drift check (listed before the memopt callback, it stops first)."""

    def __init__(self, at: int):
        self.at = at
        self.meter = AllocationPeak()
        self.peak = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            self.meter.start()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.at:
            self.peak = self.meter.stop()


def check_over_step(module: GPT2Module, batch_size: int, seq: int) -> float:
    """The drift check's peak over the int4 training step's it guards, at step 1 of a Lightning
    fit (checks every step, the default drift section otherwise), each above where it started."""
    memopt = MemOptCallback({"quantize": {"bits": 4}, "drift": {"check_every": 1}})
    step = StepPeak(at=1)
    trainer = make_trainer(Path("."), [step, memopt], max_steps=2, logger=False)
    checks = record_check_peaks(memopt.memopt)
    trainer.fit(module, loader(n=2 * batch_size, batch_size=batch_size, seq=seq))
    assert len(checks) == 2 and step.peak > 0
    return checks[1] / step.peak


def test_a_check_through_lightning_peaks_no_higher_than_the_step_it_guards():
    """GPT-2 (2 layers x 128, eager attention), 16 x 128 tokens at 4 bits: the check's 8-sample
    slice run whole kept more than the compressed step; run through ``training_step`` in pieces
    of what the step kept, the check peaks within 10% of the step."""
    ratio = check_over_step(GPT2Module(seq=128, dim=128, layers=2), batch_size=16, seq=128)
    assert ratio <= 1.10, ratio


# --------------------------------------------------------------------------- set-up, tear-down
def _hooks(module: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


def test_setup_patches_teardown_restores_and_other_stages_do_not_patch(tmp_path):
    module = GPT2Module()
    keys = list(module.state_dict())
    memopt = MemOptCallback({"quantize": {"bits": 8}})
    trainer = make_trainer(tmp_path, [memopt], max_steps=1)

    memopt.setup(trainer, module, "validate")
    assert memopt.memopt.internal.model is None
    memopt.setup(trainer, module, "fit")
    patched = _hooks(module)
    assert patched > 0 and memopt.memopt.internal.model is module
    memopt.setup(trainer, module, "fit")  # idempotent
    assert _hooks(module) == patched
    memopt.teardown(trainer, module, "fit")
    assert _hooks(module) == 0 and list(module.state_dict()) == keys

    trainer.fit(module, loader())  # a whole fit leaves the module as it was
    assert _hooks(module) == 0 and list(module.state_dict()) == keys


class Losses(Callback):
    """Every training step's loss, and the lean ops memopt's plan lists at the end of the fit."""

    def __init__(self, memopt: MemOptCallback | None = None):
        self.memopt = memopt
        self.values: list[float] = []
        self.lean: dict[str, str] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(outputs["loss"].item())

    def on_train_end(self, trainer, pl_module):
        if self.memopt is not None:
            self.lean = {f: p.lean for f, p in self.memopt.memopt.plan.items() if p.lean}


def test_lean_ops_inside_a_lightning_module_train_as_the_unpatched_model(tmp_path):
    """The Hugging Face model inside the LightningModule gets every lean op (the module itself
    has no lm_head): the unpatched fit's losses within 1e-5, and teardown restores its forward and
    attention."""
    runs = []
    for memopt in (None, MemOptCallback({"ops": {"loss": "chunked", "fuse": ["all"]}})):
        torch.manual_seed(0)
        module, losses = GPT2Module(lr=0.02), Losses(memopt)
        callbacks = [losses] if memopt is None else [memopt, losses]
        make_trainer(tmp_path, callbacks, max_steps=4, logger=False).fit(module, loader())
        runs.append(losses.values)
    assert len(runs[1]) == 4
    assert max(abs(a - b) / b for a, b in zip(*runs, strict=True)) <= 1e-5
    lean = losses.lean
    assert lean["model"] == "lean loss" and lean["model.transformer.h.0.mlp.act"] == "lean gelu"
    assert lean["model.transformer.h.0.attn"] == "lean attention"
    assert module.model.config._attn_implementation == "eager"
    assert all("forward" not in m.__dict__ for m in module.modules())


def test_second_fit_keeps_the_bits_the_first_escalated(tmp_path):
    memopt = MemOptCallback(yaml_config(tmp_path))
    module = GPT2Module()
    make_trainer(tmp_path, [memopt], max_steps=1).fit(module, loader())
    escalated = memopt.state_dict()["bits"]
    probe = BitsAtFirstBatch(memopt)
    make_trainer(tmp_path, [memopt, probe], max_steps=1).fit(module, loader())
    assert probe.bits == escalated and max(escalated.values()) > 2


def test_stochastic_weight_averaging_copies_the_patched_module(tmp_path):
    """Lightning's SWA deep-copies the LightningModule after memopt patched it: the average is a
    plain model, and training and averaging run to the end."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    memopt = MemOptCallback({"quantize": {"bits": 4}, "drift": {"enabled": False}})
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)
    module = GPT2Module()
    trainer = make_trainer(tmp_path, [memopt, swa], max_steps=-1, max_epochs=2)
    trainer.fit(module, loader(16))
    assert trainer.current_epoch == 2
    average = swa._average_model
    assert average is not None and swa.n_averaged is not None and int(swa.n_averaged) > 0
    # the average computes what an unpatched module with its weights computes, bit for bit
    plain = GPT2Module()
    plain.load_state_dict(average.state_dict())
    (tokens,) = next(iter(loader()))
    grads = []
    for copy in (average, plain):
        copy.train().zero_grad(set_to_none=True)
        copy.loss_fn(copy, tokens).backward()
        grads.append({n: p.grad for n, p in copy.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[1])


class LateGPT2Module(GPT2Module):
    """Builds its model in configure_model (runs after the callbacks' setup)."""

    def __init__(self):
        pl.LightningModule.__init__(self)
        self.lr = 0.01
        self.model = None
        self.log_calls = 0

    def configure_model(self):
        if self.model is None:
            self.model, _, self.loss_fn = hf_gpt2(batch_size=4, seq=32, dim=32, layers=1)


def test_model_built_in_configure_model_is_patched_before_the_first_step(tmp_path):
    memopt = MemOptCallback({"quantize": {"bits": 4}, "drift": {"enabled": False}})
    probe = BitsAtFirstBatch(memopt)
    make_trainer(tmp_path, [memopt, probe], max_steps=1).fit(LateGPT2Module(), loader())
    assert probe.bits and set(probe.bits.values()) == {4}
    assert "model.transformer.h.0.attn.c_attn" in probe.bits


def test_fsdp_checkpointing_policy_with_recompute_section_is_refused(tmp_path):
    # FSDP needs a GPU to build a Trainer; the check only reads trainer.strategy.
    trainer = SimpleNamespace(strategy=FSDPStrategy(activation_checkpointing_policy={nn.Linear}))
    memopt = MemOptCallback({"recompute": {"modules": ["*.mlp"]}})
    with pytest.raises(MisconfigurationException, match="activation_checkpointing_policy"):
        memopt.setup(trainer, GPT2Module(), "fit")
    no_recompute = MemOptCallback({"quantize": {"bits": 8}})
    no_recompute.setup(trainer, module := GPT2Module(), "fit")  # compression alone is fine
    assert no_recompute.session.model is module
    no_recompute.teardown(trainer, module, "fit")


def test_a_model_built_in_configure_model_is_refused_under_fsdp1():
    # FSDP needs a GPU to build a Trainer; the check only reads trainer.strategy.
    trainer = SimpleNamespace(strategy=FSDPStrategy())
    memopt = MemOptCallback({"quantize": {"bits": 8}})
    module = LateGPT2Module()
    memopt.setup(trainer, module, "fit")
    module.configure_model()
    with pytest.raises(MisconfigurationException, match="built in configure_model under FSDP"):
        memopt.on_fit_start(trainer, module)
    assert _hooks(module) == 0


class ManualModule(GPT2Module):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.loss_fn(self, batch[0])
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()


def test_manual_optimization_needs_a_loss_fn_for_the_drift_check(tmp_path):
    memopt = MemOptCallback({"quantize": {"bits": 4}})
    with pytest.raises(MisconfigurationException, match="loss_fn"):
        make_trainer(tmp_path, [memopt], max_steps=1).fit(ManualModule(), loader())

    calls = []

    def loss_fn(module, batch):
        calls.append(batch[0].shape[0])
        return module.loss_fn(module, batch[0])

    memopt = MemOptCallback({"quantize": {"bits": 4}, "drift": {"sample_size": 2}}, loss_fn)
    make_trainer(tmp_path, [memopt], max_steps=2).fit(ManualModule(), loader())
    # the check at step 0 ran the user's loss_fn on its 2-sample slice, in pieces of what the
    # 4-bit step of 4 samples kept (under a quarter of its bytes: pieces of one sample), for
    # each pass (exact, signed halves, compressed rounds)
    assert calls and set(calls) == {1} and len(calls) % 2 == 0
    assert memopt.state_dict()["drift"]["history"][0]["step"] == 0


# --------------------------------------------------------------------------- CLI and DDP
def _cli(tmp_path: Path, config_line: str):
    from lightning.pytorch.cli import LightningCLI

    cli_yaml = tmp_path / "cli.yaml"
    cli_yaml.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        f"  default_root_dir: {tmp_path}\n"
        "  max_steps: 1\n"
        "  logger: false\n"
        "  enable_checkpointing: false\n"
        "  enable_progress_bar: false\n"
        "  callbacks:\n"
        "    - class_path: memopt_plugins.callbacks.MemOptCallback\n"
        "      init_args:\n"
        f"        config: {config_line}\n"
    )
    cli = LightningCLI(
        GPT2Module, run=False, save_config_callback=None, args=["--config", str(cli_yaml)]
    )
    (memopt,) = [c for c in cli.trainer.callbacks if isinstance(c, MemOptCallback)]
    return cli, memopt


def test_lightning_cli_builds_the_callback_from_a_preset_path(tmp_path):
    cli, memopt = _cli(tmp_path, yaml_config(tmp_path))
    assert memopt.config.quantize.bits == 2 and memopt.config.drift.check_every == 3
    cli.trainer.fit(cli.model, loader())
    assert max(memopt.bits.values()) > 2


def test_lightning_cli_builds_the_callback_from_a_preset_name(tmp_path):
    _, memopt = _cli(tmp_path, "int4_drift")
    assert memopt.config.preset == "int4_drift" and memopt.config.quantize.bits == 4


def test_lightning_cli_accepts_an_inline_config_mapping(tmp_path):
    _, memopt = _cli(tmp_path, "{quantize: {bits: 8, exclude: ['*.lm_head']}}")
    assert memopt.config.quantize.bits == 8
    assert memopt.config.quantize.exclude == ("*.lm_head",)


class RecordBits(Callback):
    """Each rank writes its final memopt bits to ``<folder>/bits<rank>.json``."""

    def __init__(self, memopt: MemOptCallback, folder: str):
        self.memopt = memopt
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        path = Path(self.folder) / f"bits{trainer.global_rank}.json"
        path.write_text(json.dumps(self.memopt.state_dict()))


class RankOneExactModule(GPT2Module):
    """Rank 1's loss is zero: its gradients are exact at any bits and its check measures nothing,
    so only the reduce over ranks can make it escalate as rank 0 does."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 0 if self.global_rank == 1 else loss


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_keeps_identical_bits(tmp_path):
    memopt = MemOptCallback(yaml_config(tmp_path))
    trainer = make_trainer(
        tmp_path,
        [memopt, RecordBits(memopt, str(tmp_path))],
        devices=2,
        # fork: the children skip re-importing torch (3x faster); a hung collective fails in
        # 2 minutes instead of the default 30
        strategy=DDPStrategy(start_method="fork", timeout=timedelta(seconds=120)),
        max_steps=2,
        logger=False,
    )
    trainer.fit(RankOneExactModule(), loader())
    states = [json.loads((tmp_path / f"bits{rank}.json").read_text()) for rank in (0, 1)]
    assert states[0]["bits"] == states[1]["bits"]
    assert max(states[0]["bits"].values()) > 2
    assert states[0]["drift"]["escalations"] == states[1]["drift"]["escalations"] > 0


# --------------------------------------------------------------------------- examples
def test_demo_prints_the_plan_memory_drift_checks_and_both_losses(tmp_path, capsys, caplog):
    from examples import demo

    with caplog.at_level(logging.INFO, logger="memopt"):
        args = ["--seconds", "30", "--max-steps", "3", "--batch-size", "4", "--threads", "1"]
        ran = demo.main([*args, "--log-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "model.blocks.0.mlp.fc" in out and "compress" in out  # the plan table
    less = float(out.split("retained memory: ")[1].split("x less")[0])
    assert less > 4.0  # 4-bit activations
    assert "drift check at step 0" in caplog.text
    result = out.split("== result")[1].splitlines()
    rows = {
        line.split()[0]: line.split()
        for line in result
        if line.startswith(("memopt ", "baseline "))
    }
    assert set(rows) == {"memopt", "baseline"}
    assert all(2.0 < float(r[1]) < 6.0 for r in rows.values())  # train losses near ln(128)
    # the picture: written where the output says, from both runs' curves
    png = tmp_path / "demo" / "demo.png"
    assert f"picture: {png}" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000
    for run in (ran.memopt, ran.baseline):
        assert len(run.losses) == 3 and run.val_steps == [0, 3]  # 3 steps, validated at 0 and 3
        assert all(2.0 < loss < 6.0 for loss in run.val_losses)
    assert ran.baseline.kept == [] and len(ran.memopt.kept) == 3  # memory: memopt's hooks
    run = ran.memopt
    ratios = [whole / kept for kept, whole in zip(run.kept, run.uncompressed, strict=True)]
    assert min(ratios) > 4.0  # 4-bit activations, escalated modules at 8 bits
    assert len(run.bits) == 3 and set(run.bits[0].values()) == {4}  # the preset's bits at step 0


def test_digits_example_trains_with_the_convnet_preset(tmp_path):
    from examples import train_digits_lightning

    result = train_digits_lightning.main(
        ["--epochs", "1", "--width", "8", "--log-dir", str(tmp_path)]
    )
    # one epoch (23 steps) of a small ResNet learns something: chance is 10% and ln(10) = 2.30
    assert result["val_acc"] > 0.3 and result["val_loss"] < 2.3


class CompiledBlocksModule(GPT2Module):
    """GPT2Module whose transformer blocks are compiled in ``__init__`` (``block.compile()``)."""

    def __init__(self, lr: float = 0.01):
        super().__init__(lr)
        for block in self.model.transformer.h:
            block.compile()


def test_blocks_compiled_in_the_module_train_compressed(tmp_path):
    """(Nearest rounding: inductor generating the stochastic codec's kernels took ~2 minutes more
    on 2 cores; tests/test_compile_rounding.py compiles that codec.)"""
    torch._dynamo.reset()
    callback = MemOptCallback({"quantize": {"bits": 8, "rounding": "nearest"}})
    trainer = make_trainer(tmp_path, [callback], max_steps=2)
    trainer.fit(CompiledBlocksModule(), loader())
    rows = csv_rows(trainer)
    ratios = [float(r["memopt/compression_ratio"]) for r in rows if r["memopt/compression_ratio"]]
    assert ratios and min(ratios) > 3.0  # what the compiled blocks save is compressed
    torch._dynamo.reset()


INT4_DRIFT = Path(__file__).resolve().parents[1] / "configs" / "int4_drift.yaml"


@pytest.mark.parametrize("per_module", [False, True])
def test_a_preset_fit_logs_a_compact_metric_set(tmp_path, per_module):
    """The int4_drift preset (checks every 2 steps): at most 25 ``memopt/`` CSV columns, among
    them how many times larger a batch fits; ``log.per_module`` adds columns per module."""
    config = MemOptConfig.from_yaml(INT4_DRIFT).with_changes(
        drift={"check_every": 2, "sample_size": 2}, log={"per_module": per_module}
    )
    memopt = MemOptCallback(config)
    trainer = make_trainer(tmp_path, [memopt], max_steps=6)
    trainer.fit(GPT2Module(), loader())
    rows = [r for r in csv_rows(trainer) if r["memopt/kept_bytes"]]
    columns = {k for k in rows[0] if k.startswith("memopt/")}
    per_module_columns = {k for k in columns if k.startswith(("memopt/bits/", "memopt/drift/"))}
    assert bool(per_module_columns) == per_module
    if per_module:
        assert "memopt/bits/model.transformer.h.0.mlp.c_fc" in per_module_columns
    else:
        assert len(columns) <= 25, sorted(columns)
    assert [int(r["step"]) for r in rows] == list(range(6))
    for row in rows:
        assert float(row["memopt/compression_ratio"]) > 4.0 and float(row["memopt/kept_bytes"]) > 0
        assert 1.0 < float(row["memopt/batch_fits_x"]) <= float(row["memopt/compression_ratio"])
        assert float(row["memopt/peak_bytes"]) > 0
    assert float(rows[0]["memopt/bits_modules/4"]) == len(memopt.bits)
    assert [int(r["step"]) for r in rows if r["memopt/drift_max"]] == [0, 2, 4]


CONSOLE_FIT = """
import lightning.pytorch as pl, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from memopt_plugins.callbacks import MemOptCallback

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

torch.manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(32, 16), torch.randn(32, 1)), batch_size=8)
config = {"quantize": {"bits": 2, "min_numel": 1}, "drift": {"check_every": 2, "sample_size": 2}}
pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_progress_bar=False,
           enable_model_summary=False, enable_checkpointing=False,
           callbacks=[MemOptCallback(config)]).fit(Net(), data)
"""


def test_a_fit_without_logging_set_up_shows_memopts_lines_once_each(tmp_path):
    """A script that configures no logging sees the plan, the memory kept and each drift check
    on stderr, each line once."""
    done = subprocess.run(
        [sys.executable, "-c", CONSOLE_FIT], cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("memopt: ")]
    starts = ("memopt: plan for", "memopt: compressing", "memopt: first training step kept")
    for start in starts:
        assert sum(line.startswith(start) for line in lines) == 1, (start, lines)
    checks = [line for line in lines if line.startswith("memopt: drift check at step")]
    assert [c.split()[5].rstrip(":") for c in checks] == ["0", "2"]
    assert len(set(lines)) == len(lines)


class SizedGPT2Module(GPT2Module):
    """GPT2Module whose loader takes ``batch_size`` (which a batch-size finder sets) and which
    records the size of each training batch and how compressed its forward's saved bytes were
    (in a module hook: the finder's trials run without callbacks)."""

    def __init__(self):
        super().__init__()
        self.batch_size = 2
        self.seen: list[tuple[int, float]] = []

    def train_dataloader(self):
        return loader(64, batch_size=self.batch_size)

    def on_train_batch_end(self, outputs, batch, batch_idx):  # a module hook: trials call it
        memopt = patched_by(self)
        ratio = memopt.internal.compression.stats.forward_ratio if memopt is not None else 1.0
        self.seen.append((batch[0].shape[0], ratio))


def test_the_batch_size_finder_tries_its_batches_compressed_and_leaves_the_state(tmp_path):
    """``BatchSizeFinder`` runs its trials after the callback patched the model, with no
    callbacks: every trial batch runs at 4 bits (so on a GPU the batch it settles on is the one
    memopt allows), no drift check runs in a trial, and the fit then starts from the callback's
    state: its checks at steps 0 and 2 and 3 steps counted."""
    memopt = MemOptCallback({"quantize": {"bits": 4}, "drift": {"check_every": 2}})
    finder = BatchSizeFinder(mode="power", init_val=2, max_trials=3, steps_per_trial=1)
    module = SizedGPT2Module()
    make_trainer(tmp_path, [finder, memopt], max_steps=3).fit(module)
    trials = [size for size, _ in module.seen[:3]]
    assert trials == [2, 4, 8] and finder.optimal_batch_size == 8
    assert [size for size, _ in module.seen[3:]] == [8, 8, 8]  # the fit, at the batch found
    assert all(ratio > 4.0 for _, ratio in module.seen)  # trials and training, compressed
    drift = memopt.state_dict()["drift"]
    assert [h["step"] for h in drift["history"]] == [0, 2] and drift["steps"] == 3
