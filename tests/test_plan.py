"""`memopt plan` and `recompute.auto` are one planner: same modules, and the budget is kept."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from zoo import hf_gpt2

from memopt_plugins import MemOptConfig, MemoryOptimizer
from memopt_plugins.cli import main
from memopt_plugins.profiler import profile_model, suggest_config

GPT2 = {"batch_size": 4, "seq": 64, "dim": 256, "layers": 4}  # the 4 blocks x 256


@pytest.fixture(scope="module")
def gpt2_report():
    """The profile of the GPT-2 as it is: what `memopt plan` reads."""
    model, batch, loss_fn = hf_gpt2(**GPT2)
    return profile_model(model, batch, loss_fn)


def _auto_choice(budget: float) -> tuple[str, ...]:
    model, batch, loss_fn = hf_gpt2(**GPT2)
    opt = MemoryOptimizer({"recompute": {"auto": {"budget": budget}}})
    opt.apply(model)
    loss_fn(model, batch).backward()  # the first training forward is the measured one
    chosen = opt.plan.recompute.chosen
    opt.remove()
    return chosen


@pytest.mark.parametrize("budget", [0.5, 0.3])
def test_plan_and_auto_choose_the_same_modules_every_time(gpt2_report, budget):
    """The cost of a replay is counted in operations, not read from a clock: the printed
    config is the same from one run to the next, and recompute.auto picks what it names."""
    model, batch, loss_fn = hf_gpt2(**GPT2)
    suggestion = suggest_config(profile_model(model, batch, loss_fn), budget)
    assert suggestion.to_yaml() == suggest_config(gpt2_report, budget).to_yaml()
    assert suggestion.bits == 32  # recompute alone reaches these budgets: nothing added
    assert suggestion.recompute and suggestion.recompute == _auto_choice(budget)


@pytest.mark.parametrize("budget", [0.5, 0.3])
def test_the_printed_config_applied_keeps_the_budget(gpt2_report, budget):
    suggestion = suggest_config(gpt2_report, budget)
    assert suggestion.estimate <= budget * suggestion.baseline
    model, batch, loss_fn = hf_gpt2(**GPT2)
    applied = profile_model(model, batch, loss_fn, suggestion.config)
    kept = applied.saved_after_total / applied.saved_total
    assert kept <= budget + 0.05, (kept, suggestion.recompute)
    assert abs(applied.saved_after_total - suggestion.estimate) <= 0.05 * suggestion.estimate


def test_plan_adds_compression_only_where_recompute_cannot_reach(gpt2_report):
    report = gpt2_report
    tight = suggest_config(report, 0.03)  # recompute alone reaches ~7.5%
    # Compression is added; with it the planner declines replays that would raise the peak
    # (they come back uncompressed), so 3% itself is not reached: 5.6% is kept, and said so.
    assert tight.bits < 32 and not tight.reached
    assert tight.estimate <= 0.06 * tight.baseline
    forced = suggest_config(report, 0.5, bits=8)
    assert forced.bits == 8 and forced.config.quantize.bits == 8
    assert forced.estimate <= 0.5 * forced.baseline
    # at 8 bits everything is ~4x smaller already: no recompute is needed for half
    assert forced.recompute == ()


# A small GPT-2-style factory, as a user's file would hold it (examples/models.py's GPT, smaller).
GPT_FACTORY = """
import sys
sys.path.insert(0, {examples!r})
import torch
from models import GPT, lm_loss

def gpt():
    torch.manual_seed(0)
    model = GPT(vocab=128, dim=64, depth=2, heads=4, block_size=64)
    tokens = torch.randint(0, 128, (8, 65))
    return model, (tokens[:, :-1], tokens[:, 1:]), lm_loss
"""


# Read as a user reads it, in a fresh interpreter: glibc told to return freed memory at once,
# the resident set before the model is built, then the kernel's high-water mark over four AdamW
# steps of the factory's model at the batch size, under the config, a drift check on every step.
TRAIN_AND_READ = """
import ctypes, gc, sys
import torch, yaml
from memopt_plugins import MemOptConfig, MemoryOptimizer
from memopt_plugins.cli import build, load_factory
from memopt_plugins.profiler.training import resize_batch

def status(field):
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith(field + ":")).split()[1]) * 1024

spec, size, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
libc = ctypes.CDLL("libc.so.6")
libc.mallopt(-3, 4096)  # M_MMAP_THRESHOLD
libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD
torch.set_num_threads(1)
load_factory(spec)  # the factory's imports, as a training script has them before it starts
gc.collect()
libc.malloc_trim(0)
idle = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
model, batch, loss_fn = build(spec)
batch = resize_batch(batch, size)
config = MemOptConfig.from_yaml(path).with_changes(drift={"check_every": 1})
memopt = MemoryOptimizer(config)
memopt.apply(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(4):
    loss_fn(model, batch).backward()
    memopt.check_drift(loss_fn, batch=batch)
    optimizer.step()
    optimizer.zero_grad()
    memopt.count_step()
print(status("VmHWM") - idle)
"""


def test_the_planned_batch_trains_with_drift_checks_within_the_cap(tmp_path, capsys):
    """``memopt plan --memory 160MiB --config int4_drift`` (no ``--bits``) plans at the config's
    4 bits, and the batch it prints, trained for four AdamW steps with a drift check on every
    step in a fresh process, takes 80-100% of the cap above the process's idle memory: the plan
    counts the whole training, checks included, as the user reads it."""
    examples = str(Path(__file__).parents[1] / "examples")
    (tmp_path / "tiny.py").write_text(GPT_FACTORY.format(examples=examples))
    spec, cap = f"{tmp_path}/tiny.py:gpt", 160 << 20
    assert main(["plan", "--model", spec, "--memory", "160MiB", "--config", "int4_drift"]) == 0
    stdout = capsys.readouterr().out
    assert MemOptConfig.from_dict(yaml.safe_load(stdout)).quantize.bits == 4
    size = int(re.search(r"with this config (\d+)", stdout).group(1))
    (tmp_path / "plan.yaml").write_text(stdout)
    read = [sys.executable, "-c", TRAIN_AND_READ, spec, str(size), str(tmp_path / "plan.yaml")]
    done = subprocess.run(read, capture_output=True, text=True, check=True, timeout=300)
    used = int(done.stdout.split()[-1])
    assert 0.8 * cap <= used <= cap, (size, used / 2**20, stdout)


def test_the_plan_keeps_the_configs_own_keys(gpt2_report):
    """A config the plan starts from keeps its keys: its recompute globs (the planner's picks are
    added), its drift section, and its bits unless others are asked for."""
    base = MemOptConfig.from_dict(
        {"recompute": {"modules": ["transformer.h.0.mlp"]}, "drift": {"check_every": 7}}
    )
    suggestion = suggest_config(gpt2_report, 0.3, base=base)
    assert suggestion.config.recompute.modules[0] == "transformer.h.0.mlp"
    assert len(suggestion.config.recompute.modules) > 1  # and the planner's picks
    assert suggestion.config.drift.check_every == 7
