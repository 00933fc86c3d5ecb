"""The one benchmark Row: every committed result file reads into it and writes back what it holds,
each study's row carries only its own group, and depth.md shows the committed depth.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.depth import markdown as depth_markdown
from benchmarks.harness.records import (
    GROUPS,
    BatchFit,
    Depth,
    Row,
    harness_row,
    load_results,
)
from benchmarks.harness.stats import Paired

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _groups(row: Row) -> set[str]:
    return {name for name in GROUPS if getattr(row, name) is not None}


def test_results_json_reads_into_rows_and_writes_back_the_same_payload():
    payload = json.loads((BENCHMARKS / "results.json").read_text())
    meta, workloads = load_results(BENCHMARKS / "results.json")
    assert {"meta": meta, "workloads": [w.to_json() for w in workloads]} == payload
    rows = [r for w in workloads for r in w.rows + w.compiled]
    assert rows and all(_groups(r) == {"bench", "trained"} and r.model is None for r in rows)
    assert any(isinstance(r.trained.paired, Paired) for r in rows)  # a dict again is a Paired


@pytest.mark.parametrize(("name", "group"), [("fits.json", "batch_fit"), ("depth.json", "depth")])
def test_a_studys_json_reads_into_rows_with_its_own_group_and_keeps_every_value(name, group):
    data = json.loads((BENCHMARKS / name).read_text())
    rows = [Row.from_json(r) for r in data]
    assert rows and all(_groups(r) == {group} and r.model and r.fits for r in rows)
    for written, read in zip(data, rows, strict=True):
        again = read.to_json()
        assert {k: again[k] for k in written} == written
        # written before the slopes were kept: they are the only keys added
        added = {"peak_slopes", "retained_slopes", "peak_per_sample_below"}
        assert set(again) - set(written) <= added


def test_a_row_writes_only_what_is_set_and_each_group_whole():
    row = Row("memopt int4", "HF GPT-2", peak=7, peak_per_sample=1.5, batch_fit=BatchFit(batch=3))
    assert row.to_json() == {
        "method": "memopt int4",
        "model": "HF GPT-2",
        "peak": 7,
        "peak_per_sample": 1.5,
        "batch": 3,
        "fits_compiled": None,
        "peak_per_sample_below": None,
        "samples_per_s_runs": [],
    }
    assert Row.from_json(row.to_json()) == row
    assert set(harness_row("baseline", "PyTorch").to_json()) >= {"error", "val_loss", "peak"}


def test_an_unknown_field_does_not_read_silently():
    with pytest.raises(TypeError):
        Row.from_json({"method": "baseline", "model": "HF GPT-2", "peak_per_sampel": 1.0})


def test_depth_md_shows_a_line_per_row_and_no_slope_where_none_was_kept():
    rows = [Row.from_json(r) for r in json.loads((BENCHMARKS / "depth.json").read_text())]
    slope = Depth(4, "here", {}, peak_slopes=[2.0 * (1 << 20), 3.0], retained_slopes=[1.0, 1.0])
    none = Depth(4, "here", {})
    per_sample = {"peak_per_sample": 1.0, "retained_per_sample": 1.0}
    with_slopes = Row("lean ops + int4", "GPT-2-style", **per_sample, fits=2.0, depth=slope)
    without = Row("lean ops + int2", "GPT-2-style", **per_sample, fits=2.0, depth=none)
    text = depth_markdown([*rows, with_slopes, without], quick=False)
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(lines) == len(rows) + 3  # the header, a line per row
    assert lines[-2].split(" | ")[4] == "2.000 MiB"
    assert lines[-1].split(" | ")[4] == "-"
