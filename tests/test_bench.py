"""The benchmark keeps working: `python -m benchmarks.run --quick` runs and writes complete results.

One quick run (tiny models, a few steps, one thread) in a subprocess, shared by the tests below.
Timings are never asserted; memory, gradient and loss figures are, where they are deterministic.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness.methods import BASELINE, LOSS_BARS, METHODS, Patched, method_names
from benchmarks.harness.stats import Paired
from benchmarks.harness.tables import MEASURE_COLUMNS, loss_verdict
from benchmarks.harness.workloads import precise_batchnorm
from benchmarks.report import main as redraw_pareto
from memopt_plugins import MemoryOptimizer

ROOT = Path(__file__).resolve().parents[1]

WORKLOADS = ("gpt", "hf-gpt2", "cnn")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        # the compiled rows cost minutes of compiling: tests/test_compile.py covers compile
        [sys.executable, "-m", "benchmarks.run", "--quick", "--no-compile"] + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    rows = {w["key"]: {r["method"]: r for r in w["rows"]} for w in data["workloads"]}
    return out, (out / "results.md").read_text(), data, rows


def tables(markdown: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """``(heading, header cells, body rows)`` of every markdown table, under its last heading."""
    found, heading, lines = [], "", markdown.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|-"):
            header = [c.strip() for c in line.strip("|").split("|")]
            body = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                body.append([c.strip() for c in lines[i].strip("|").split("|")])
                i += 1
            found.append((heading, header, body))
            continue
        i += 1
    return found


def test_every_workload_table_has_every_method_and_column(quick):
    _, markdown, _, _ = quick
    measured = [t for t in tables(markdown) if t[1] == MEASURE_COLUMNS]
    assert len(measured) == len(WORKLOADS)
    for heading, header, body in measured:
        assert [row[0] for row in body] == method_names(), heading
        assert all(len(row) == len(header) for row in body), heading


def test_headline_has_a_row_per_method_with_ratios_for_all_three_models(quick):
    _, markdown, _, _ = quick
    heading, header, body = tables(markdown)[0]
    assert heading == "Headline"
    assert header[:7] == [
        "method",
        "GPT memory",
        "GPT time",
        "HF GPT-2 memory",
        "HF GPT-2 time",
        "CNN memory",
        "CNN time",
    ]
    assert header[-2:] == ["GPT loss vs baseline", "CNN loss vs baseline"]
    assert [row[0] for row in body[: len(METHODS)]] == method_names()
    assert body[0][1:7] == ["1.00x"] * 6  # the baseline against itself


def test_convergence_tables_cover_every_method_and_the_seed_spread(quick):
    _, markdown, data, _ = quick
    convergence = [t for t in tables(markdown) if t[0].startswith("Convergence")]
    assert len(convergence) == 2  # the GPT on text, the CNN on digits
    for _, header, body in convergence:
        assert header[:3] == ["method", "held-out loss", "vs baseline"]
        assert [row[0] for row in body] == method_names() + ["baseline, other seeds"]
    steps = {w["key"]: w["train_steps"] for w in data["workloads"]}
    assert steps == {"gpt": 4, "hf-gpt2": 0, "cnn": 4}


def test_the_cnn_short_run_is_compared_seed_by_seed_with_the_baseline(quick):
    _, markdown, data, rows = quick
    cnn = next(w for w in data["workloads"] if w["key"] == "cnn")
    assert cnn["short_steps"] == 2 and cnn["short_seeds"] == 3 and cnn["bar_seeds"] == 4
    base = rows["cnn"]["baseline"]
    assert base["short_paired"] == {"change": 0.0, "ci": 0.0, "worse": 0, "seeds": 4}
    assert base["paired"] == {"change": 0.0, "ci": 0.0, "worse": 0, "seeds": 2}
    for name in method_names():
        row = rows["cnn"][name]
        short_seeds = 4 if name in (BASELINE, *LOSS_BARS) else 3  # more for the bars
        for paired, seeds in ((row["short_paired"], short_seeds), (row["paired"], 2)):
            assert paired["seeds"] == seeds and 0 <= paired["worse"] <= seeds, name
            assert paired["ci"] >= 0 and math.isfinite(paired["change"]), name
        assert row["short_loss"] is not None
    assert "2-step run, paired" in markdown


def test_every_table_names_its_device(quick):
    _, markdown, data, _ = quick
    device = data["meta"]["device"]
    assert device.startswith("cpu (1 thread")
    assert markdown.count(f"Device: **{device}**") == len(WORKLOADS) + 2  # + 2 convergence


def test_exact_methods_reproduce_the_baseline_gradient(quick):
    _, _, _, rows = quick
    exact = [m.name for m in METHODS if m.exact]
    assert len(exact) == 6
    for key in WORKLOADS:
        for name in exact:
            assert rows[key][name]["error"] is None, (key, name)
            assert rows[key][name]["grad_error"] < 1e-5, (key, name)


def test_gradient_error_grows_as_bits_shrink(quick):
    _, _, _, rows = quick
    for key in WORKLOADS:
        r = rows[key]
        errors = [r[f"memopt int{b}"]["grad_error"] for b in (8, 4, 2)]
        # measured at 8 bits in the quick run: gpt 0.70%, hf-gpt2 0.37%, cnn 0.61%
        assert 0 < errors[0] < 0.009, key
        assert errors[0] < errors[1] < errors[2], key


def test_packed_bytes_halve_with_each_halving_of_bits_and_bound_retained(quick):
    _, _, _, rows = quick
    for key in WORKLOADS:
        r = rows[key]
        packed = [r[f"memopt int{b}"]["packed"] for b in (8, 4, 2)]
        assert 0.4 < packed[1] / packed[0] < 0.6, key
        assert 0.4 < packed[2] / packed[1] < 0.65, key
        for b in (8, 4, 2):
            row = r[f"memopt int{b}"]
            assert row["retained"] == max(row["meter_retained"], row["packed"])
        assert r["baseline"]["packed"] == 0
        assert r["baseline"]["retained"] > packed[0]  # 8 bits keep under a third of float32


def test_every_method_trains_to_the_end_including_drift_checks(quick):
    """The drift check runs at step 0 under every drift-enabled config, the planner's regions
    included (the combined GPT preset: planner + 4 bits + drift)."""
    _, _, _, rows = quick
    for key in ("gpt", "cnn"):
        for name, row in rows[key].items():
            assert row["val_loss"] is not None, (key, name, row["training"])
        assert rows[key]["memopt int4 + drift"]["training"].startswith("1 drift check,"), key
        assert rows[key]["memopt combined preset"]["training"].startswith("1 drift check,"), key


def test_interleaved_training_runs_equal_standalone_seeded_runs(quick):
    """Exact methods end at the baseline's loss: each run's RNG stream is its own even though the
    runs step in turn, recompute replays the same dropout masks, and on the CNN the BatchNorm
    statistics are re-estimated before evaluation (PyTorch's checkpoint updates the training
    averages twice a step, which moved the held-out loss with gradients equal to the baseline's)."""
    _, _, _, rows = quick
    exact = [m.name for m in METHODS if m.exact and m.name != BASELINE]
    for key in ("gpt", "cnn"):
        r = rows[key]
        base = r["baseline"]["val_loss"]
        for name in exact:
            assert abs(r[name]["val_loss"] - base) <= 1e-5 * base, (key, name)
        assert r["baseline, other seeds"]["val_loss"] != base, key


def test_precise_batchnorm_averages_the_training_batches_for_the_current_weights():
    torch.manual_seed(0)
    conv, norm = nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3, momentum=0.3)
    model = nn.Sequential(conv, norm, nn.ReLU(), nn.Dropout(0.5), nn.Flatten(), nn.LazyLinear(2))
    batches = [
        (torch.randn(8, 1, 6, 6) * (k + 1), torch.zeros(8, dtype=torch.long)) for k in range(3)
    ]
    workload = SimpleNamespace(
        calibration=batches, loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1])
    )
    model(batches[0][0])  # materialize the lazy layer
    norm.running_mean.fill_(5.0)  # stale statistics from "training"
    model.eval()
    rng = torch.get_rng_state()
    precise_batchnorm(model, workload)
    with torch.no_grad():
        inputs = [conv(x) for x, _ in batches]
    mean = torch.stack([x.mean((0, 2, 3)) for x in inputs]).mean(0)
    var = torch.stack([x.transpose(0, 1).flatten(1).var(1) for x in inputs]).mean(0)
    torch.testing.assert_close(norm.running_mean, mean)
    torch.testing.assert_close(norm.running_var, var)
    assert norm.momentum == 0.3 and not model.training
    assert torch.equal(torch.get_rng_state(), rng)  # its dropout draws leave the stream alone


def test_pareto_png_is_written(quick):
    out, markdown, _, _ = quick
    png = (out / "pareto.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width = int.from_bytes(png[16:20], "big")
    assert width >= 1500  # three panels side by side
    assert "![memory vs step time](pareto.png)" in markdown


def test_pareto_png_is_redrawn_from_a_results_json(tmp_path):
    results = tmp_path / "results.json"
    results.write_text((ROOT / "benchmarks" / "results.json").read_text())
    path = redraw_pareto([str(results)])
    png = path.read_bytes()
    assert path == tmp_path / "pareto.png" and png[:8] == b"\x89PNG\r\n\x1a\n"
    workloads = len(json.loads(results.read_text())["workloads"])
    assert int.from_bytes(png[16:20], "big") >= 500 * workloads  # a panel per workload


def test_a_later_run_of_the_compiled_methods_replaces_the_compiled_rows(tmp_path):
    whole = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    whole["meta"].pop("compiled_rerun", None)
    later = json.loads(json.dumps(whole))
    later["meta"]["seconds"] = 600.0
    for w in later["workloads"]:
        for row in w["compiled"]:
            row["compile_seconds"] = 12345.6
    results, rerun = tmp_path / "results.json", tmp_path / "later" / "results.json"
    rerun.parent.mkdir()
    results.write_text(json.dumps(whole))
    rerun.write_text(json.dumps(later))
    markdown = redraw_pareto([str(results), "--compiled-from", str(rerun)]).read_text()
    merged = json.loads(results.read_text())
    compiled = [row for w in merged["workloads"] for row in w["compiled"]]
    assert compiled and all(row["compile_seconds"] == 12345.6 for row in compiled)
    assert merged["meta"]["compiled_rerun"]["seconds"] == 600.0
    assert markdown.count("| 12345.6 |") == len(compiled)  # the first-step column, every row
    assert "from a later run of the compiled methods alone" in markdown
    assert (tmp_path / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_paired_change_has_a_student_t_interval():
    # changes +10%, -10%, +30%: mean +10%, stdev 20%, t(0.975, 2) = 4.303
    paired = Paired.of([(1.1, 1.0), (0.9, 1.0), (2.6, 2.0)])
    assert paired.change == pytest.approx(0.10)
    assert paired.ci == pytest.approx(4.3027 * 0.20 / math.sqrt(3), rel=1e-4)
    assert (paired.worse, paired.seeds) == (2, 3)


@pytest.mark.parametrize(
    ("change", "ci", "expected"),
    [
        (0.0, 0.005, "met"),
        (0.005, 0.005, "met"),
        (0.03, 0.01, "**not met**"),
        (0.0, 0.02, "unresolved"),
    ],
)
def test_loss_verdict_says_when_the_interval_cannot_tell(change, ci, expected):
    verdict = loss_verdict(None, Paired(change, ci, 0, 10))
    assert verdict.startswith(expected)
    assert loss_verdict(0.009) == "met" and loss_verdict(0.011) == "**not met**"  # one seed


def test_statistics_frozen_by_running_mode_are_kept_for_evaluation():
    """memopt's BatchNorm running mode past its warm-up trained with fixed statistics: they are
    part of the model, so the evaluation must not re-estimate them (before the warm-up ends, and
    for every other method, it does)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    optimizer = MemoryOptimizer({"batchnorm": {"mode": "running", "warmup_steps": 2}})
    optimizer.apply(model)
    patched = Patched(model, optimizer)
    assert not Patched(nn.Sequential(nn.BatchNorm1d(4))).batchnorm_frozen
    frozen = []
    for _ in range(3):
        frozen.append(patched.batchnorm_frozen)
        patched.after_step()
    assert frozen == [False, False, True]


def test_paired_steps_rotate_and_divide_by_the_baseline_of_the_same_round(monkeypatch):
    """``benchmarks/harness/paired.py``: each round times every step once, the first rotating
    per round, and a step's ratio is taken against the baseline step of the same round."""
    from benchmarks.harness import paired

    order = []
    seconds = {"base": iter([1.0, 2.0, 4.0]), "mem": iter([1.5, 2.2, 4.4])}

    def timed(step):
        order.append(step)
        s = next(seconds[step])
        return s, 2 * s

    monkeypatch.setattr(paired, "timed", timed)
    times = paired.interleaved(["base", "mem"], 3)
    assert order == ["base", "mem", "mem", "base", "base", "mem"]
    r = paired.ratios(times, 1)
    assert r["cpu"] == [1.5, 1.1, 1.1] and r["wall"] == r["cpu"]
    assert paired.quartiles([1.0, 1.2, 1.4]).startswith("1.200×")


def test_step_time_reports_the_ratio_to_the_baseline_of_the_same_round():
    """``benchmarks/step_time.py``: a method's figure is the median of its per-round ratios to
    that round's baseline step, in CPU and wall time (load that drifts between rounds cancels)."""
    from benchmarks.step_time import report

    base = [1.0, 2.0, 1.0, 4.0]
    int8 = [1.1, 2.4, 1.15, 4.4]
    times = [[(b, b), (m, 2 * m), (b, b)] for b, m in zip(base, int8, strict=True)]
    args = SimpleNamespace(command="python -m benchmarks.step_time", warmup=1, rounds=4)
    text = report({"gpt2": {"times": times}}, args, (0.0, 0.0))
    assert "| HF GPT-2 | memopt int8 | 1775 | 1.125× (1.100–1.188) | 2.250× (2.200–2.375) |" in text
    assert "| HF GPT-2 | memopt int4 | 1500 | 1.000× (1.000–1.000) |" in text
