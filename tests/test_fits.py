"""benchmarks/fits.py's rows and tables: the committed fits.json still reads, samples/s shows its
spread between processes, the README table takes the bf16 and compiled rows, and the methods run
under bf16 autocast and in a timing step. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import fits
from benchmarks.fits import (
    BF16_METHODS,
    BY_NAME,
    QUICK_TIMING,
    fits_row,
    markdown,
    prepared,
    speed_child,
)
from benchmarks.harness.records import Row
from benchmarks.plot_fits import METHODS, readme_table
from memopt_plugins.profiler.run import step_memory
from memopt_plugins.tree import batch_size_of

ROOT = Path(__file__).resolve().parents[1]


def _cells(markdown_text: str, method: str) -> list[str]:
    line = next(x for x in markdown_text.splitlines() if f"| {method} |" in x)
    return [c.strip() for c in line.strip("|").split("|")]


def test_the_committed_fits_json_reads_and_shows_each_timed_rows_median_and_range():
    rows = [Row.from_json(r) for r in json.loads((ROOT / "benchmarks" / "fits.json").read_text())]
    text = markdown(rows, QUICK_TIMING, "A run.")
    baseline = rows[0]
    runs = sorted(baseline.batch_fit.samples_per_s_runs)
    assert len(runs) >= 2 and baseline.samples_per_s > 0
    median = f"{baseline.samples_per_s:.1f} ({runs[0]:.1f}–{runs[-1]:.1f})"
    assert _cells(text, baseline.method)[-1] == median
    assert text.count("\n| ") == len(rows) + 1  # the header, a line per row


def test_samples_per_s_is_the_median_of_the_processes_with_their_range():
    timed = fits_row("HF GPT-2", "memopt int4", 1.0, 1.0, peak_at_batch=16)
    timed.batch_fit.samples_per_s_runs = [9.1, 8.7, 8.94]
    untimed = fits_row("HF GPT-2", "memopt int8", 1.0, 1.0, peak_at_batch=16)
    text = markdown([timed, untimed], QUICK_TIMING, "A run.")
    assert _cells(text, "memopt int4")[-1] == "8.9 (8.7–9.1)"
    assert _cells(text, "memopt int8")[-1] == "-"
    assert f"{QUICK_TIMING.repeats} such processes per row" in text


def _fits_rows(extra: list[dict]) -> list[dict]:
    models = ("HF GPT-2", "HF Llama", "ResNet-50-style")
    rows = [
        {"model": model, "method": method, "fits": 2.0 + i, "fits_compiled": None}
        for model in models
        for i, (method, _, _) in enumerate(METHODS)
    ]
    return rows + extra


def test_the_readme_table_shows_bf16_and_compiled_lean_int4_only_where_measured():
    plain = readme_table(_fits_rows([])).splitlines()
    assert len(plain) == 2 + len(METHODS)
    assert plain[2] == f"| {METHODS[0][1]} | 2.00× | 2.00× | 2.00× |"
    extra = [
        {"model": "HF GPT-2", "method": "bf16 autocast memopt lean ops + int4", "fits": 4.5},
        {"model": "HF Llama", "method": "bf16 autocast memopt lean ops + int4", "fits": 4.25},
        {
            "model": "HF GPT-2",
            "method": "torch.compile + memopt lean ops + int4",
            "fits": 6.0,
            "fits_compiled": 4.125,
        },
    ]
    table = readme_table(_fits_rows(extra)).splitlines()
    assert table[: len(plain)] == plain
    assert table[len(plain) :] == [
        "| memopt lean ops + int4, bf16 autocast | 4.50× | 4.25× | – |",
        "| memopt lean ops + int4, torch.compile (vs compiled baseline) | 4.12× | – | – |",
    ]


def test_lean_int4_under_bf16_autocast_keeps_less_than_the_bf16_baseline():
    """The bf16 rows' steps run (the forward under autocast) and read on the timeline."""
    peaks = {}
    for method in BF16_METHODS[:2]:
        p = prepared("gpt2", method, quick=True, n=4)  # the slope between batches 4 and 2
        peaks[method.name] = step_memory(p.model, p.batch, p.loss_fn).per_sample.peak
        if p.optimizer is not None:
            p.optimizer.remove()
    base, lean = (peaks[m.name] for m in BF16_METHODS[:2])
    assert base / lean > 4.0, peaks  # 9.9x measured; the bar at full size is 4x


def test_a_timing_process_gives_the_seconds_of_each_timed_step_at_the_rows_batch():
    assert batch_size_of(prepared("resnet", BY_NAME["baseline"], quick=True, n=3).batch) == 3
    seconds = speed_child("resnet", "baseline", n=3, quick=True, warmup=1, steps=2)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)


def test_compiled_only_merges_its_rows_into_the_committed_fits_json(tmp_path, monkeypatch):
    """``--compiled-only`` reads fits.json into rows, puts the new compiled rows in place of
    the same (model, method) and writes the rest back as it was (the compiling is stubbed)."""
    for name in ("fits.json", "fits.md"):
        (tmp_path / name).write_text((ROOT / "benchmarks" / name).read_text())
    old = json.loads((tmp_path / "fits.json").read_text())
    new = fits_row("HF GPT-2", "torch.compile", 2.0 * fits.MIB, fits.MIB, peak_at_batch=32)
    new.fits, new.batch_fit.batch, new.batch_fit.fits_compiled = 3.0, 48, 1.0
    monkeypatch.setattr(fits, "compiled_rows", lambda names, quick, threads: [new])
    fits.main(["--compiled-only", "--only", "gpt2", "--time", "none", "--out", str(tmp_path)])
    merged = json.loads((tmp_path / "fits.json").read_text())
    assert len(merged) == len(old)
    for before, after in zip(old, merged, strict=True):
        if before["method"] == "torch.compile":
            assert after == new.to_json() and after["peak"] == 32
        else:  # as it was (a row read before the lower slope was kept gains it, unread)
            assert {k: after[k] for k in before} == before
            assert set(after) - set(before) <= {"peak_per_sample_below"}
    assert (
        "| HF GPT-2 | torch.compile | 2.000 MiB | - | 1.000 MiB | 3.00x (1.00x) | 48 | - |"
        in (tmp_path / "fits.md").read_text()
    )
