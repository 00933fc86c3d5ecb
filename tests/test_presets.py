"""Presets are package data loaded by name: in every integration, from the CLI, and from a wheel
installed outside the repository (where configs/ does not exist)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from memopt_plugins import ConfigError, MemOptConfig, MemoryOptimizer, presets
from memopt_plugins.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def test_every_preset_file_loads_by_its_name():
    files = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    assert presets.names() == files
    for name in files:
        by_name = MemOptConfig.from_preset(name)
        assert by_name == MemOptConfig.from_yaml(CONFIGS / f"{name}.yaml")
        assert by_name.preset == name
        assert presets.describe(name)  # `memopt presets` has a line to show


def test_every_integration_takes_a_preset_name():
    from memopt_plugins.callbacks import MemOptCallback

    from memopt_plugins.accelerate import MemOptPlugin
    from memopt_plugins.transformers import MemOptTrainerCallback

    expected = MemOptConfig.from_yaml(CONFIGS / "int4_drift.yaml")
    for built in (
        MemoryOptimizer("int4_drift"),
        MemOptCallback("int4_drift"),
        MemOptPlugin("int4_drift"),
        MemOptTrainerCallback("int4_drift"),
    ):
        assert built.config == expected
        assert built.config.preset == "int4_drift"


def test_a_user_config_is_no_preset(tmp_path):
    path = tmp_path / "mine.yaml"
    shutil.copy(CONFIGS / "int8.yaml", path)
    mine = MemOptConfig.from_yaml(path)
    assert mine == MemOptConfig.from_preset("int8")  # the same settings compare equal
    assert mine.preset is None and MemOptConfig.from_preset("int8").preset == "int8"
    changed = MemOptConfig.from_preset("lean").with_changes(quantize={"exclude": ["head"]})
    assert changed.preset == "lean"  # the name is kept for display; the settings decide


# Each preset that names a part of a model some models lack, and the section that says so (lean's
# loss: chunked needs none: its cross_entropy: lean takes the loss over where no head is reached).
OPTIONAL_SECTIONS = {"transformer_selective_recompute": {"recompute"}}


def test_a_preset_that_names_what_a_model_may_lack_says_so_in_its_settings():
    for name in presets.names():
        config = MemOptConfig.from_preset(name)
        marked = {s for s in ("recompute", "quantize", "ops") if getattr(config, s).optional}
        assert marked == OPTIONAL_SECTIONS.get(name, set()), name
        text = (CONFIGS / f"{name}.yaml").read_text()
        for section in marked:  # written in the file's section, with a comment saying why
            written = rf"^{section}:\n(?:[ #].*\n)*?  optional: true +# \S"
            assert re.search(written, text, flags=re.M), name


def test_every_preset_applies_to_a_model_it_does_not_fully_match(caplog):
    """A plain MLP has no attention, no loss head and no BatchNorm: every preset applies to it,
    and what it names that the MLP lacks is skipped in an INFO line, never silently."""
    for name in presets.names():
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
        caplog.clear()
        with caplog.at_level("INFO", logger="memopt"):
            opt = MemoryOptimizer(name)
            opt.apply(model)
        skipped = [r.getMessage() for r in caplog.records if "optional is true" in r.getMessage()]
        assert len(skipped) == len(OPTIONAL_SECTIONS.get(name, ())), (name, skipped)
        model(torch.randn(4, 64)).square().mean().backward()
        opt.remove()


def test_an_unknown_name_suggests_the_closest_preset():
    with pytest.raises(ConfigError, match=r"no memopt preset named 'int4drift'.*'int4_drift'"):
        MemoryOptimizer("int4drift")


def test_a_missing_preset_path_points_to_the_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the repository: configs/ is not there
    with pytest.raises(ConfigError, match=r"not found: configs/lean.yaml.*pass 'lean'"):
        MemoryOptimizer("configs/lean.yaml")


def test_cli_lists_the_presets_and_which_to_start_with(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in presets.names():
        line = next(row for row in out.splitlines() if row.startswith(name + " "))
        assert presets.describe(name) in line
    assert "Start with int4_drift" in out
    assert main(["presets", "lean"]) == 0
    assert capsys.readouterr().out == (CONFIGS / "lean.yaml").read_text()
    assert main(["presets", "leen"]) == 2
    assert "Did you mean 'lean'?" in capsys.readouterr().err


def test_cli_config_takes_a_preset_name(tmp_path, capsys):
    factory = tmp_path / "toy.py"
    factory.write_text(
        "import torch\nfrom torch import nn\n"
        "def build():\n"
        "    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))\n"
        "    return model, torch.randn(128, 64), lambda m, b: m(b).square().mean()\n"
    )
    out = tmp_path / "report"
    argv = ["profile", "--model", f"{factory}:build", "--config", "int8", "--out", str(out)]
    assert main(argv) == 0
    assert "compress" in (out / "report.md").read_text()  # int8's plan was measured


def _wheel(tmp_path: Path) -> Path:
    """A wheel built from a copy of the repository's sources (the checkout stays clean)."""
    source = _mkdir(tmp_path / "src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    for folder in ("memopt_plugins", "callbacks", "configs"):
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(source)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("memopt_plugins-*.whl")
    return wheel


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def test_the_wheel_holds_the_presets_loads_them_by_name_and_never_cites_design(tmp_path):
    wheel = _wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        files = archive.namelist()
        packed = {Path(f).stem for f in files if f.startswith("memopt_plugins/presets/")}
        assert set(presets.names()) <= packed
        citing = [f for f in files if b"DESIGN" + b".md" in archive.read(f)]
        archive.extractall(tmp_path / "site")
    assert citing == []
    # Outside the repository, the wheel's files first on the path: the preset loads by name.
    elsewhere = _mkdir(tmp_path / "elsewhere")
    script = (
        "import memopt_plugins as m; from memopt_plugins import MemoryOptimizer\n"
        "print(m.__file__); print(MemoryOptimizer('lean').config.ops.loss)"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=elsewhere, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    where, loss = run.stdout.split()
    assert Path(where).is_relative_to(tmp_path / "site") and loss == "chunked"
