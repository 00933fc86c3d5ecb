"""Per-module memory report: counted bytes match the meter, roll-up, plan measured, state kept."""

from __future__ import annotations

import sys

import pytest
import torch
import yaml
from torch import nn
from torch.utils.checkpoint import checkpoint
from zoo import hf_bert

from memopt_plugins import MemOptConfig
from memopt_plugins.profiler import profile_model, suggest_config
from memopt_plugins.profiler.plan import compact_globs, estimate_saved
from memopt_plugins.profiler.report import LOSS_ROW, ROOT
from memopt_plugins.profiler.units import human_bytes
from memopt_plugins.recompute.planner import choose
from memopt_plugins.select import fqn_matches, parent_fqns

Q8 = {"quantize": {"bits": 8}}


@pytest.fixture(scope="module")
def bert_report():
    """HF BERT (dropout on), measured as is and with 8-bit compression."""
    model, batch, loss_fn = hf_bert()
    return profile_model(model, batch, loss_fn, Q8)


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class Toy(nn.Module):
    """Linear -> tanh -> LayerNorm -> dropout -> residual MLP -> Linear; ``checkpointed`` names
    children run under torch.utils.checkpoint (what a recompute plan does)."""

    def __init__(self, dim: int = 64, checkpointed: tuple[str, ...] = ()):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.ln = nn.LayerNorm(dim)
        self.drop = nn.Dropout(0.1)
        self.mlp = MLP(dim)
        self.out = nn.Linear(dim, dim)
        self.checkpointed = checkpointed

    def _run(self, name: str, x):
        module = getattr(self, name)
        if name in self.checkpointed:
            return checkpoint(module, x, use_reentrant=False)
        return module(x)

    def forward(self, x):
        h = self._run("drop", self._run("ln", torch.tanh(self.inp(x))))
        return self.out(h + self._run("mlp", h))


def toy_loss(model, x):
    return model(x).square().mean()  # square() saves the output outside the model


ROWS, DIM = 256, 64
TENSOR = ROWS * DIM * 4  # bytes of one (256, 64) float32 activation


# --------------------------------------------------------------------------- the bar
def test_bert_saved_bytes_sum_to_the_measured_retained_memory(bert_report):
    retained = bert_report.reading.retained
    assert abs(bert_report.saved_total - retained) <= 0.10 * retained, (
        bert_report.saved_total,
        retained,
    )


def test_bert_modules_are_named_with_their_bytes(bert_report):
    # GELU saves its input: (8, 64, 256) float32 = 512 KiB, attributed to the activation module
    act = bert_report["bert.encoder.layer.0.intermediate.intermediate_act_fn"]
    assert act.self_saved == 8 * 64 * 256 * 4
    assert act.kind == "activation"
    # key and value save the same input as query: counted once, at query
    assert bert_report["bert.encoder.layer.0.attention.self.query"].self_saved == 8 * 64 * 64 * 4
    assert bert_report["bert.encoder.layer.0.attention.self.key"].self_saved == 0
    table = bert_report.table()
    assert "bert.encoder.layer.0.intermediate.intermediate_act_fn" in table
    assert "512.0 KiB" in table


def test_nested_modules_roll_up_to_their_parents(bert_report):
    model, _, _ = hf_bert()
    own_params: dict[str, int] = {}
    for name, p in model.named_parameters():  # a tied weight belongs to its first owner
        owner = name.rpartition(".")[0]
        own_params[owner] = own_params.get(owner, 0) + p.nbytes
    rows = {row.fqn: row for row in bert_report.modules if row.fqn != LOSS_ROW}
    for fqn, row in rows.items():
        children = [r for f, r in rows.items() if f and parent_fqns(f)[0] == fqn]
        assert row.saved == row.self_saved + sum(c.saved for c in children), fqn
        assert row.params == own_params.get(fqn, 0) + sum(c.params for c in children), fqn
    assert rows[""].params == sum(p.nbytes for p in model.parameters())
    loss_row = bert_report.modules[-1].saved if bert_report.modules[-1].fqn == LOSS_ROW else 0
    assert rows[""].saved + loss_row == bert_report.saved_total


def test_after_is_measured_under_the_plan(bert_report):
    before, after = bert_report.saved_total, bert_report.saved_after_total
    # 8 bits of 32 plus per-group scales (3.95x), and dropout's masks a bit an element (about
    # 30x): over 4.1x, under 8x
    assert 4.1 < before / after < 8
    act = bert_report["bert.encoder.layer.0.intermediate.intermediate_act_fn"]
    assert act.action_text == "compress 8"
    assert 3.8 <= act.self_saved / act.self_saved_after <= 4.0
    assert bert_report.after.packed > 0
    # the codec formula the planner uses agrees with the measurement
    estimate = estimate_saved(bert_report, set(), 8)
    assert abs(estimate - after) <= 0.05 * after


# --------------------------------------------------------------------------- recompute regions
@pytest.mark.parametrize("region", ["mlp", "drop"])
def test_recompute_estimate_equals_the_count_with_checkpointing(region):
    """A checkpointed region holds nothing inside and keeps its inputs: the estimate from the
    plain run equals the bytes counted when the region really runs under checkpoint."""
    x = torch.randn(ROWS, DIM)
    torch.manual_seed(0)
    plain = profile_model(Toy(), x, toy_loss)
    torch.manual_seed(0)
    wrapped = profile_model(Toy(checkpointed=(region,)), x, toy_loss)
    assert wrapped[region].saved == 0
    assert estimate_saved(plain, {region}, 32) == wrapped.saved_total


def test_recompute_frees_what_is_saved_inside_less_the_inputs_it_keeps():
    torch.manual_seed(0)
    report = profile_model(Toy(), torch.randn(ROWS, DIM), toy_loss)
    # MLP: fc output and GELU output (4x wide each) are freed; its input h stays (fc saves it)
    assert report["mlp"].freeable == 2 * 4 * TENSOR
    # dropout frees its mask but must keep its input, which nothing else holds: frees nothing
    assert report["drop"].self_saved == TENSOR
    assert report["drop"].kept_inputs == TENSOR
    assert report["drop"].freeable == 0
    # the loss computed outside the model is its own row
    assert report[LOSS_ROW].self_saved == TENSOR


# --------------------------------------------------------------------------- state and RNG
def test_model_gradients_optimizer_and_rng_are_left_as_they_were():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Dropout(0.5), nn.Linear(64, 4))
    x = torch.randn(128, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    params = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    report = profile_model(model, x, lambda m, b: m(b).sum(), Q8, optimizer)
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert len(optimizer.state) == 0
    assert torch.equal(torch.get_rng_state(), rng)
    n_params = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    assert report[""].params == 4 * n_params
    assert report[""].grads == 4 * n_params
    # AdamW: exp_avg and exp_avg_sq per parameter, plus a float32 step counter each
    assert report[""].optimizer_state == 2 * 4 * n_params + 4 * tensors
    assert "optim" in report.table()


# --------------------------------------------------------------------------- presentation
def test_human_units():
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 2**20 - 1, 5 * 2**30)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 KiB",
        "1.0 MiB",
        "5.0 GiB",
    ]


def test_table_is_aligned_and_cut_to_whole_branches(bert_report):
    lines = bert_report.table(top=8).splitlines()
    assert len(lines) == 2 + 8
    rule = lines[1]
    edges = [
        i for i, c in enumerate(rule) if c == "-" and (i + 1 == len(rule) or rule[i + 1] == " ")
    ]
    header = lines[0].split()
    assert header[:2] == ["module", "kind"]
    # every numeric cell ends exactly at its column's edge (right-aligned)
    saved_edge = edges[header.index("saved")]
    for line in lines[2:]:
        assert line[saved_edge] in "BiK", line
        assert line[saved_edge + 1] == " "
    shown = [line.split()[0] for line in lines[2:]]
    assert shown[0] == ROOT
    fqns = {"" if s == ROOT else s for s in shown}
    assert all(parent_fqns(f)[0] in fqns for f in fqns if f)  # every parent is shown too


def test_markdown_json_and_png(bert_report, tmp_path):
    md = bert_report.to_markdown(top=5, image="memory.png")
    assert "![saved activations by module](memory.png)" in md
    assert md.count("\n| `") == 5
    data = yaml.safe_load(bert_report.to_json())  # JSON is YAML
    assert data["totals"]["saved"] == bert_report.saved_total
    assert len(data["modules"]) == len(bert_report.modules)
    path = bert_report.plot(tmp_path / "sub" / "memory.png", top=12)
    png = path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(png) > 20_000


def test_plot_without_matplotlib_says_how_to_install(bert_report, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"memopt-plugins\[plot\]"):
        bert_report.plot(tmp_path / "memory.png")


# --------------------------------------------------------------------------- plan
def test_plan_recomputes_what_the_planner_picks_and_round_trips(bert_report, tmp_path):
    suggestion = suggest_config(bert_report, 0.4)
    assert suggestion.estimate <= 0.4 * bert_report.saved_total
    assert suggestion.reached and suggestion.bits == 32  # recompute alone reaches 40%
    plan = choose(bert_report.measurement, 0.4)  # the recompute.auto planner, same measurement
    assert suggestion.recompute == plan.chosen and suggestion.estimate == plan.kept_bytes
    path = tmp_path / "plan.yaml"
    path.write_text(suggestion.to_yaml())
    loaded = MemOptConfig.from_yaml(path)
    assert loaded == suggestion.config
    named = {r.fqn for r in bert_report.modules if fqn_matches(r.fqn, loaded.recompute.modules)}
    assert named == set(suggestion.recompute)  # the globs name exactly the chosen modules


def test_plan_extremes(bert_report):
    everything = suggest_config(bert_report, 1.0)
    assert everything.recompute == () and everything.bits == 32
    assert everything.to_yaml().splitlines()[-1] == "{}"
    impossible = suggest_config(bert_report, 0.001)
    assert impossible.bits == 2 and not impossible.reached
    assert "out of reach" in impossible.to_yaml()
    with pytest.raises(ValueError, match="budget"):
        suggest_config(bert_report, 1.5)


def test_compact_globs_only_when_exact():
    names = ["", "h", "h.0", "h.0.mlp", "h.1", "h.1.mlp", "h.2", "h.2.mlp"]
    assert compact_globs(["h.0.mlp", "h.1.mlp", "h.2.mlp"], names) == ["h.*.mlp"]
    assert compact_globs(["h.0.mlp", "h.2.mlp"], names) == ["h.0.mlp", "h.2.mlp"]


def test_plan_estimate_agrees_with_the_engine_running_it(bert_report):
    """Run the suggested config (recompute + compression) through the engine and count again."""
    pytest.importorskip("memopt_plugins.recompute", reason="the engine runs recompute from there")
    suggestion = suggest_config(bert_report, 0.4)
    model, batch, loss_fn = hf_bert()
    report = profile_model(model, batch, loss_fn, suggestion.config)
    assert abs(report.saved_after_total - suggestion.estimate) <= 0.10 * suggestion.estimate
    containers = 0
    for fqn in suggestion.recompute:
        assert report[fqn].action == "recompute"
        inside = [r for r in report.modules if r.fqn.startswith(fqn + ".")]
        assert all(r.action == "in-recompute" for r in inside)
        assert all(r.self_saved_after == 0 for r in inside)  # a region holds nothing inside
        containers += bool(inside)
    assert containers >= 2  # BERT's attention blocks (and leaves: LayerNorms, cheap to replay)


def test_a_patched_model_is_refused():
    from memopt_plugins import MemoryOptimizer

    model = nn.Linear(4, 4)
    opt = MemoryOptimizer(Q8)
    opt.apply(model)
    with pytest.raises(RuntimeError, match="before MemoryOptimizer.apply"):
        profile_model(model, torch.randn(2, 4), lambda m, x: m(x).sum())
    opt.remove()
