"""The `memopt` command: profile a held-out model from a file, plan a config, clear errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from fresh import context

from memopt_plugins import MemOptConfig, cli
from memopt_plugins.cli import main
from memopt_plugins.measure.process import batch_fits

# A BERT-style factory this repository does not contain (built from a config, no download).
BERT_FACTORY = textwrap.dedent(
    """
    import torch
    from transformers import BertConfig, BertForMaskedLM

    def build():
        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=256,
                         max_position_embeddings=64)
        cfg._attn_implementation = "eager"
        model = BertForMaskedLM(cfg)
        batch = torch.randint(0, 256, (8, 64))
        return model, batch, lambda m, b: m(input_ids=b, labels=b).loss
    """
)

TOY_FACTORY = textwrap.dedent(
    """
    import torch
    from torch import nn

    def mlp():
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(32, 64), nn.LayerNorm(64),
            nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)),
            nn.Linear(64, 8),
        )
        return model, torch.randn(512, 32), lambda m, x: m(x).square().mean()

    def wide():  # parameters, gradients and AdamW's state take 24 MiB
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
            nn.Linear(1024, 256),
        )
        return model, torch.randn(64, 256), lambda m, x: m(x).square().mean()

    def pair():
        return nn.Linear(2, 2), None

    def not_a_model():
        return "model", None, lambda m, b: 0

    def boom():
        raise ValueError("no data here")

    def bad_loss():
        return nn.Linear(4, 4), torch.randn(2, 3), lambda m, x: m(x).sum()

    answer = 42
    """
)

BOOM_LINE = 1 + next(i for i, s in enumerate(TOY_FACTORY.splitlines()) if "raise ValueError" in s)


@pytest.fixture
def factories(tmp_path: Path) -> Path:
    (tmp_path / "bert_factory.py").write_text(BERT_FACTORY)
    (tmp_path / "toy.py").write_text(TOY_FACTORY)
    (tmp_path / "broken.py").write_text("import torch\n\ndef f():\n    return 1\n\n1 / 0\n")
    return tmp_path


def test_profile_held_out_bert_writes_report_and_png(factories, tmp_path, capsys):
    out = tmp_path / "report"
    rc = main(["profile", "--model", f"{factories}/bert_factory.py:build", "--out", str(out)])
    stdout = capsys.readouterr().out
    assert rc == 0
    line = next(s for s in stdout.splitlines() if s.startswith("bert.encoder.layer.0.output "))
    assert "KiB" in line  # named, with byte sizes in human units
    assert (out / "memory.png").read_bytes()[:4] == b"\x89PNG"
    assert "bert.encoder.layer.0" in (out / "report.md").read_text()
    data = json.loads((out / "report.json").read_text())
    saved, retained = data["totals"]["saved"], data["totals"]["measured"]["retained"]
    assert abs(saved - retained) <= 0.10 * retained
    assert sum(m["self_saved"] for m in data["modules"]) == saved


GPT2_FACTORY = textwrap.dedent(
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    def build():
        torch.manual_seed(0)
        cfg = GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=1, n_head=4)
        batch = torch.randint(0, 512, (8, 64))
        return GPT2LMHeadModel(cfg), batch, lambda m, b: m(input_ids=b, labels=b).loss
    """
)


@pytest.mark.parametrize(
    "spec, entry, modules",
    [("toy.py:mlp", "ops: {fuse: [gelu]}", 1), ("gpt2.py:build", "ops: {loss: chunked}", 1)],
)
def test_profile_suggests_the_lean_op_where_the_peak_is(
    factories, tmp_path, capsys, spec, entry, modules
):
    """The MLP peaks in the backward of the Linear after its GELU: the gelu chain; GPT-2 in
    the backward of its loss's log-softmax: the chunked loss. The entry is a valid config."""
    (factories / "gpt2.py").write_text(GPT2_FACTORY)
    assert main(["profile", "--model", f"{factories}/{spec}", "--out", str(tmp_path / "r")]) == 0
    stdout = capsys.readouterr().out
    suggested = [s.strip() for s in stdout.splitlines() if s.startswith("  ops: ")]
    assert [s.split("  #")[0] for s in suggested] == [entry]
    assert f"# {modules} module(s)" in suggested[0]
    assert MemOptConfig.from_dict(yaml.safe_load(entry)).ops != MemOptConfig().ops
    if spec.startswith("toy"):
        assert "peak in the backward of 2.2" in stdout  # the Linear after the GELU (2.1)


def test_profile_with_config_top_and_suggest(factories, tmp_path, capsys):
    config = tmp_path / "q8.yaml"
    config.write_text("quantize:\n  bits: 8\n")
    out = tmp_path / "r"
    argv = ["profile", "--model", f"{factories}/toy.py:mlp", "--config", str(config)]
    rc = main([*argv, "--out", str(out), "--top", "3", "--suggest", "0.5", "--optimizer", "adam"])
    stdout = capsys.readouterr().out
    assert rc == 0
    table = stdout[stdout.index("module ") :].split("\n\n")[0].splitlines()
    assert len(table) == 2 + 3
    assert "compress 8" in table[2] and "optim" in table[0] and "after" in table[0]
    suggested = MemOptConfig.from_yaml(out / "suggested.yaml")
    assert suggested.quantize.bits <= 16 or suggested.recompute.modules


def test_plan_prints_yaml_that_loads(factories, tmp_path, capsys):
    """The budget is on the step's peak, and the header reports the peak measured running it."""
    target = tmp_path / "plan.yaml"
    argv = ["plan", "--model", f"{factories}/toy.py:mlp", "--budget", "0.85", "-o", str(target)]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert stdout == target.read_text()
    config = MemOptConfig.from_yaml(target)
    # only the Linear-GELU-Linear block "2" would free bytes, and it frees more than half of them
    # on its own, which the planner never picks: compression reaches the budget
    assert config.recompute.modules == ()
    assert config.quantize.bits in (4, 8, 16)
    measured = re.search(r"# measured with this config: peak .* \((\d+)%\)", stdout)
    assert int(measured.group(1)) <= 85 + 5


def test_plan_prints_the_batch_fits_figure_of_its_measurements(
    factories, tmp_path, capsys, monkeypatch
):
    """The plan's "a batch Nx as large fits" is :func:`batch_fits` of the per-sample peaks it
    measured without and with its config, and the profile report of that config prints the
    same figure (one figure, computed one way)."""
    plans, plan_peak = [], cli.plan_peak

    def recorded(*args, **kwargs):
        plans.append(plan_peak(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(cli, "plan_peak", recorded)
    target = tmp_path / "plan.yaml"
    spec = f"{factories}/toy.py:mlp"
    assert main(["plan", "--model", spec, "--budget", "0.5", "--bits", "4", "-o", str(target)]) == 0
    printed = re.search(r"# a batch ([0-9.]+)x as large fits", capsys.readouterr().out)
    (plan,) = plans
    expected = batch_fits(plan.step_without.per_sample.peak, plan.step_with.per_sample.peak)
    assert expected is not None and printed[1] == f"{expected:.1f}"
    rc = main(["profile", "--model", spec, "--config", str(target), "--out", str(tmp_path / "r")])
    assert rc == 0
    profiled = re.search(r"a batch ([0-9.]+)x as large fits", capsys.readouterr().out)
    assert profiled[1] == printed[1]


def test_plan_under_a_memory_cap_prints_the_largest_batch_that_fits(factories, capsys):
    """The whole training is read in a fresh process (torch's first optimizer step alone loads
    tens of MiB), and the batch printed is read within the cap."""
    assert main(["plan", "--model", f"{factories}/toy.py:mlp", "--memory", "160MiB"]) == 0
    stdout = capsys.readouterr().out
    found = re.search(r"measured ([0-9.]+) MiB at batch (\d+) \((\d+)% of the cap\)", stdout)
    assert int(found.group(2)) > 512  # the factory's batch fits with room to spare
    assert float(found.group(1)) <= 160 and 80 <= int(found.group(3)) <= 100
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", f"{factories}/toy.py:mlp", "--memory", "lots"])
    assert exit_info.value.code == 2
    assert "is not an amount of memory" in capsys.readouterr().err
    assert main(["plan", "--model", f"{factories}/toy.py:mlp"]) == 2
    assert "give --budget" in capsys.readouterr().err


def _adamw_step_peak(spec: str, config: str, size: int) -> int:
    """In this (fresh) process: the most CPU tensor memory held while the factory of ``spec``
    builds the model and its batch (resized to ``size``) and two AdamW steps run under ``config``
    (YAML text): the second with the state the first made, as every later step of training
    does. The allocator's own count, from the profiler's memory events."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    from memopt_plugins import MemoryOptimizer
    from memopt_plugins.cli import build
    from memopt_plugins.profiler.fit import resize_batch

    torch.set_num_threads(1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model, batch, loss_fn = build(spec)
        batch = resize_batch(batch, size)
        MemoryOptimizer(yaml.safe_load(config)).apply(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            loss_fn(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
    events, totals = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while events:
        event = events.pop()
        events.extend(event.children)
        if event.tag == _EventType.Allocation:
            totals.append(event.extra_fields.total_allocated)
    return max(totals)


def test_the_planned_batch_takes_adamw_steps_under_the_cap_in_a_fresh_process(factories, capsys):
    """``memopt plan --memory 160MiB`` counts AdamW's state (the default; 12 MiB here): the
    batch it prints, run with its config for AdamW steps in a fresh process, holds under 160 MiB
    of tensors, and is larger than the largest batch it prints without memopt."""
    spec = f"{factories}/toy.py:wide"
    assert main(["plan", "--model", spec, "--memory", "160MiB", "--bits", "4"]) == 0
    stdout = capsys.readouterr().out
    found = re.search(r"largest batch without memopt (\d+), with this config (\d+)", stdout)
    baseline, size = int(found.group(1)), int(found.group(2))
    assert size > baseline and "adamw state counted" in stdout
    with context().Pool(1) as pool:
        peak = pool.apply(_adamw_step_peak, (spec, stdout, size))
    assert peak <= 160 << 20, peak / 2**20


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("missing.py:build", "file not found: {dir}/missing.py"),
        ("toy.py", "expected FILE.py:factory"),
        ("toy.py:mpl", "toy.py has no factory 'mpl'. Did you mean 'mlp'?"),
        ("toy.py:answer", "toy.py:answer is a int, not a callable"),
        ("toy.py:pair", "returned a tuple of 2: (Linear, NoneType); expected a factory"),
        ("toy.py:not_a_model", "returned a tuple of 3: (str, NoneType, function)"),
        ("toy.py:boom", f"raised ValueError: no data here (toy.py, line {BOOM_LINE})"),
        ("toy.py:bad_loss", "one training step of {dir}/toy.py:bad_loss failed: RuntimeError"),
        ("broken.py:f", "importing {dir}/broken.py failed: ZeroDivisionError"),
    ],
)
def test_bad_factory_is_a_clear_error_with_exit_2(factories, capsys, spec, expected):
    rc = main(["profile", "--model", f"{factories}/{spec}", "--out", str(factories / "o")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("memopt: error: ")
    assert expected.format(dir=factories) in err
    assert "Traceback" not in err


def test_bad_config_and_budget(factories, tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("quantize:\n  bits: 3\n")
    rc = main(["profile", "--model", f"{factories}/toy.py:mlp", "--config", str(config)])
    assert rc == 2
    assert "quantize.bits: got 3" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", f"{factories}/toy.py:mlp", "--budget", "1.5"])
    assert exit_info.value.code == 2
    assert "outside (0, 1]" in capsys.readouterr().err


def test_console_script_exit_status_without_traceback(factories):
    script = Path(sys.executable).with_name("memopt")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "memopt_plugins.cli"]
    done = subprocess.run(
        [*command, "plan", "--model", f"{factories}/toy.py:boom", "--budget", "0.5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "raised ValueError: no data here" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_reader_that_leaves_gives_exit_1_without_a_traceback(factories, monkeypatch, capsys):
    """``memopt plan ... | head``: the pipe closes under the output, the command exits 1."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    with open(write, "w", buffering=1) as gone:  # line-buffered: the first print hits the pipe
        monkeypatch.setattr(sys, "stdout", gone)
        rc = main(["plan", "--model", f"{factories}/toy.py:mlp", "--budget", "0.5"])
        monkeypatch.undo()
    assert rc == 1
    assert "Traceback" not in capsys.readouterr().err
