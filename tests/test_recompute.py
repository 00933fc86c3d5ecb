"""Selective recompute: exact gradients, buffers once per step, memory freed, planner, refusals."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from memory import gradients, measure, rel_error
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import ResNetConfig, ResNetForImageClassification
from zoo import hf_gpt2, hf_resnet

from memopt_plugins import ConfigError, MemoryOptimizer, plan_recompute
from memopt_plugins.measure.step import Measurement, ModuleCost
from memopt_plugins.recompute.planner import choose, estimated_peak
from memopt_plugins.recompute.wrap import RecomputeError, existing_checkpointing
from memopt_plugins.select import layer_kind, outermost, within


def rc(**section) -> dict:
    return {"recompute": section}


def small_gpt(dropout: float = 0.1):
    return hf_gpt2(batch_size=2, seq=32, dim=64, dropout=dropout)


def small_resnet():
    return hf_resnet(batch_size=4, size=32)


def resnet50_style(batch_size: int = 8, size: int = 64, seed: int = 0):
    """A Hugging Face ResNet with ResNet-50's proportions (stage widths 4x the stem), scaled
    down. The zoo's hf_resnet keeps its stages as narrow as its stem, so there the stem alone
    holds ~60% of the activations and no block-level recompute reaches 2x."""
    torch.manual_seed(seed)
    cfg = ResNetConfig(
        embedding_size=16,
        hidden_sizes=[64, 128, 256, 512],
        depths=[2, 2, 2, 2],
        layer_type="bottleneck",
        num_labels=10,
    )
    batch = (torch.randn(batch_size, 3, size, size), torch.randint(0, 10, (batch_size,)))
    return ResNetForImageClassification(cfg), batch, _image_loss


def _image_loss(model, batch):
    return F.cross_entropy(model(pixel_values=batch[0]).logits, batch[1])


def planned_gradients(model, batch, loss_fn, budget: float, seed: int = 0):
    """Gradients of one step after ``plan_recompute`` on the same batch; returns (grads, opt)."""
    opt = MemoryOptimizer(rc(auto={"budget": budget}))
    opt.apply(model)
    plan_recompute(opt, lambda: loss_fn(model, batch))
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss_fn(model, batch).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    recomputed = opt.plan.recomputed
    opt.remove()
    model.zero_grad(set_to_none=True)
    return grads, recomputed


def instance_forwards(model: nn.Module) -> list[str]:
    return [fqn for fqn, m in model.named_modules() if "forward" in m.__dict__]


def hook_counts(model: nn.Module) -> dict[str, tuple[int, int]]:
    return {n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()}


# --------------------------------------------------------------------------- the bar: gradients
GPT_SELECTIONS = [
    ("globs", rc(modules=["transformer.h.*.mlp", "transformer.h.1"])),
    ("types", rc(types=["GPT2Block"])),
    ("planner", 0.3),
]
RESNET_SELECTIONS = [
    ("globs", rc(modules=["resnet.encoder.stages.*.layers.*"])),
    ("types", rc(types=["ResNetConvLayer"])),
    ("planner", 0.3),
]


@pytest.mark.parametrize(
    "build, how, selection",
    [(small_gpt, how, sel) for how, sel in GPT_SELECTIONS]
    + [(small_resnet, how, sel) for how, sel in RESNET_SELECTIONS],
    ids=[f"gpt2-{h}" for h, _ in GPT_SELECTIONS] + [f"resnet-{h}" for h, _ in RESNET_SELECTIONS],
)
def test_gradients_equal_the_exact_run(build, how, selection):
    model, batch, loss_fn = build()
    exact = gradients(model, batch, loss_fn)
    if how == "planner":
        got, recomputed = planned_gradients(model, batch, loss_fn, selection)
    else:
        opt = MemoryOptimizer(selection)
        opt.apply(model)
        recomputed = opt.plan.recomputed
        opt.remove()
        got = gradients(model, batch, loss_fn, selection)
    assert recomputed, "something is recomputed"
    assert set(got) == set(exact)
    assert rel_error(got, exact) <= 1e-5


def test_dropout_masks_are_replayed_bit_for_bit():
    model, batch, loss_fn = small_gpt(dropout=0.1)
    exact = gradients(model, batch, loss_fn, seed=3)
    other_seed = gradients(model, batch, loss_fn, seed=4)
    assert rel_error(other_seed, exact) > 1e-3, "dropout is active (premise)"
    cfg = rc(modules=["transformer.h.*"])
    torch.manual_seed(3)
    got = gradients(model, batch, loss_fn, cfg, seed=3)
    assert all(torch.equal(got[k], exact[k]) for k in exact)
    # the global RNG stream after the step is the one of the exact run
    torch.manual_seed(3)
    loss_fn(model, batch).backward()
    after_exact = torch.get_rng_state()
    opt = MemoryOptimizer(cfg)
    opt.apply(model)
    torch.manual_seed(3)
    loss_fn(model, batch).backward()
    opt.remove()
    assert torch.equal(torch.get_rng_state(), after_exact)


# --------------------------------------------------------------------------- the bar: memory
def gpt_for_memory():
    return hf_gpt2(batch_size=4, seq=128, dim=128)


@pytest.fixture(scope="module")
def gpt_baseline():
    return measure(gpt_for_memory, repeats=1)


@pytest.mark.parametrize(
    "globs, floor",
    [(["transformer.h.*.mlp"], 1.2), (["transformer.h.*"], 3.0)],
    ids=["mlp", "block"],
)
def test_gpt_retained_memory_ratio(gpt_baseline, globs, floor):
    reading = measure(gpt_for_memory, rc(modules=globs), repeats=1)
    ratio = gpt_baseline.retained / reading.retained
    assert ratio >= floor, f"{globs}: {ratio:.2f}x < {floor}x ({reading})"
    assert reading.peak < gpt_baseline.peak


def test_resnet_bottleneck_blocks_retained_memory_ratio():
    baseline = measure(resnet50_style, repeats=1)
    reading = measure(resnet50_style, rc(types=["ResNetBottleNeckLayer"]), repeats=1)
    ratio = baseline.retained / reading.retained
    assert ratio >= 2.0, f"{ratio:.2f}x < 2x ({reading} vs {baseline})"
    assert reading.peak < baseline.peak


def test_planner_budget_holds_in_measured_memory(gpt_baseline):
    # measure() takes a warm-up step first: recompute.auto plans on it, the readings follow
    reading = measure(gpt_for_memory, rc(auto={"budget": 0.3}), repeats=1)
    kept = reading.retained / gpt_baseline.retained
    assert kept <= 0.3 + 0.05, f"kept {kept:.0%} of the baseline at budget 30%"
    assert reading.peak < gpt_baseline.peak  # no region so large that its replay is the peak


# --------------------------------------------------------------------------- buffers
def test_batchnorm_buffers_move_once_per_step():
    model, batch, loss_fn = small_resnet()
    twin = copy.deepcopy(model)
    loss_fn(twin, batch).backward()
    opt = MemoryOptimizer(rc(types=["ResNetBottleNeckLayer"], modules=["resnet.embedder"]))
    opt.apply(model)
    loss_fn(model, batch).backward()
    opt.remove()
    buffers, expected = dict(model.named_buffers()), dict(twin.named_buffers())
    assert any(n.endswith("num_batches_tracked") for n in buffers)
    assert all(torch.equal(buffers[n], expected[n]) for n in expected)
    assert all(int(b) == 1 for n, b in buffers.items() if n.endswith("num_batches_tracked"))


def test_plain_torch_checkpoint_would_move_batchnorm_twice():
    """The trap the test above guards against (pytorch#96136): the control run."""
    bn = nn.BatchNorm1d(8)
    x = torch.randn(16, 8, requires_grad=True)
    checkpoint(bn, x, use_reentrant=False).square().sum().backward()
    assert int(bn.num_batches_tracked) == 2


def test_a_buffer_the_forward_updates_is_updated_once():
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("seen", torch.zeros((), dtype=torch.long))
            self.register_buffer("ema", torch.zeros(8))

        def forward(self, x):
            self.seen += 1
            with torch.no_grad():
                self.ema.mul_(0.5).add_(x.mean(0))
            return self.lin(x).tanh()

    model = nn.Sequential(Counting(), nn.Linear(8, 1))
    twin = copy.deepcopy(model)
    x = torch.randn(4, 8)
    twin(x).sum().backward()
    opt = MemoryOptimizer(rc(modules=["0"]))
    opt.apply(model)
    model(x).sum().backward()
    opt.remove()
    assert int(model[0].seen) == 1
    assert torch.equal(model[0].ema, twin[0].ema)


# --------------------------------------------------------------------------- compression
def test_nothing_is_compressed_inside_a_recomputed_module():
    model, batch, loss_fn = small_gpt(dropout=0.0)
    squeeze = {"quantize": {"bits": 2, "modules": ["transformer.h.*.mlp"], "min_numel": 1}}
    exact = gradients(model, batch, loss_fn)
    compressed = gradients(model, batch, loss_fn, squeeze)
    assert rel_error(compressed, exact) > 0.05, "2-bit compression alone is visible (premise)"
    both = {**squeeze, **rc(modules=["transformer.h.*"])}
    assert rel_error(gradients(model, batch, loss_fn, both), exact) <= 1e-5
    opt = MemoryOptimizer(both)
    opt.apply(model)
    assert opt.bits == {}
    entry = opt.plan["transformer.h.0"]
    assert (entry.kind, entry.action, entry.bits) == ("container", "recompute", 32)
    assert opt.plan["transformer.h.0.mlp.c_fc"].action == "in-recompute"
    assert "in-recompute" in str(opt.plan)
    opt.remove()


class TwoStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.block = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))

    def forward(self, x):
        return self.block(self.lin(x)).sum()


@pytest.mark.parametrize("how", ["config", "planner"])
def test_only_the_boundary_input_is_compressed(how):
    model, x = TwoStage(), torch.randn(32, 64)
    squeeze = {"quantize": {"bits": 8, "min_numel": 1}}
    if how == "config":
        opt = MemoryOptimizer({**squeeze, **rc(modules=["block"])})
        opt.apply(model)
    else:  # a planner's pick: the block and its children keep their compression scopes
        opt = MemoryOptimizer({**squeeze, **rc(auto={"budget": 0.5})})
        opt.apply(model)
        opt.load_state_dict({"recompute": ["block"]})
    # the block's own scope packs its boundary input only: a compressed module, drift-checked
    assert opt.plan.recomputed == ("block",) and opt.bits == {"": 8, "lin": 8, "block": 8}
    packed: list[tuple[tuple[int, ...], int]] = []
    compress = opt.internal.hooks._compress
    opt.internal.hooks._compress = lambda t, b: (
        packed.append((tuple(t.shape), b)),
        compress(t, b),
    )[1]
    model(x).backward()
    opt.remove()
    # x (saved by lin) and the block's input (saved by the checkpoint) in 8-bit scopes outside
    # the block; none of the three tensors saved inside it, in forward or in the replay
    assert packed == [((32, 64), 8), ((32, 64), 8)]


class Headed(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.mark.parametrize("how", ["exclude", "override", "set_bits"])
def test_a_recomputed_module_kept_exact_keeps_its_boundary_input_exact(how):
    """A recomputed head that is excluded, overridden to 32 bits or set to 32 by set_bits keeps
    its boundary input as it is, so its gradients are exact: the boundary input is kept at the
    more precise of the head's bits and its enclosing scope's (it was at the enclosing 4 bits)."""
    torch.manual_seed(0)
    model, x = Headed(), torch.randn(32, 64)
    exact = copy.deepcopy(model)
    exact(x).square().mean().backward()  # the loss outside every scope: its gradient is exact
    q: dict = {"bits": 4, "min_numel": 1}
    if how == "exclude":
        q["exclude"] = ["head"]
    elif how == "override":
        q["overrides"] = {"head": 32}
    opt = MemoryOptimizer({"quantize": q, **rc(types=["Linear"])})
    opt.apply(model)
    assert "head" in opt.plan.recomputed
    if how == "set_bits":
        assert opt.bits["head"] == 4  # the recomputed head is a compressed module: its input
        opt.set_bits("head", 32)
    model(x).square().mean().backward()
    opt.remove()
    for name in ("head.weight", "head.bias"):
        got, want = model.get_parameter(name).grad, exact.get_parameter(name).grad
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "head, expected", [(2, 8), (16, 16), (8, 8)], ids=["below", "above", "equal"]
)
def test_the_boundary_input_is_kept_at_the_more_precise_of_its_bits_and_the_enclosing(
    head, expected
):
    """The boundary input of a recomputed module at ``head`` bits inside an 8-bit scope is
    packed at the more precise of the two, and a change of either's bits reaches it."""
    model, x = Headed(), torch.randn(32, 64)
    opt = MemoryOptimizer(
        {
            "quantize": {"bits": 8, "min_numel": 1, "overrides": {"head": head}},
            **rc(modules=["head"]),
        }
    )
    opt.apply(model)
    packed: list[tuple[tuple[int, ...], int]] = []
    compress = opt.internal.hooks._compress
    opt.internal.hooks._compress = lambda t, b: (
        packed.append((tuple(t.shape), b)),
        compress(t, b),
    )[1]

    def boundary_bits() -> int:
        packed.clear()
        model(x).sum().backward()
        # x by body.0, its output by the GELU, the GELU's output by the head's checkpoint (the
        # boundary input)
        assert [shape for shape, _ in packed] == [(32, 64)] * 3
        return packed[2][1]

    assert boundary_bits() == expected
    opt.set_bits("", 16)  # the enclosing scope escalated: the boundary input follows
    assert boundary_bits() == max(head, 16)
    opt.set_bits("head", 32)
    assert boundary_bits() == 32
    opt.remove()


def test_planner_parks_bits_of_modules_it_recomputes():
    model, batch, loss_fn = small_gpt(dropout=0.0)
    opt = MemoryOptimizer({"quantize": {"bits": 8}, **rc(auto={"budget": 0.15})})
    opt.apply(model)
    before = opt.bits
    plan_recompute(opt, lambda: loss_fn(model, batch))
    inside = {f for f, p in opt.plan.items() if p.action == "in-recompute"}
    recomputed = {f for f, p in opt.plan.items() if p.action == "recompute"}
    assert inside and not inside & set(opt.bits)
    assert recomputed <= set(opt.bits)  # their scopes keep their boundary inputs
    assert set(opt.bits) | inside >= set(before)
    loss_fn(model, batch).backward()  # compression around, recompute inside: runs
    opt.remove()


# --------------------------------------------------------------------------- in-place ops
class Inner(nn.Module):
    def __init__(self, in_place: bool):
        super().__init__()
        self.in_place = in_place

    def forward(self, x):
        if self.in_place:
            x.mul_(2)
        return (3 * x).sin()  # saves 3 * x, not x: only a replay needs x


class Outer(nn.Module):
    def __init__(self, in_place_inside: bool = False, in_place_after: bool = False):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.inner = Inner(in_place_inside)
        self.in_place_after = in_place_after

    def forward(self, x):
        h = self.lin(x)
        y = self.inner(h)
        if self.in_place_after:
            h.add_(1)  # Linear saved its input, not h: only the recompute of inner needs h
        return y.sum()


def test_in_place_change_of_an_input_inside_fails_in_forward_naming_the_module():
    model = Outer(in_place_inside=True)
    opt = MemoryOptimizer(rc(modules=["inner"]))
    opt.apply(model)
    with pytest.raises(RecomputeError, match=r"'inner' \(Inner\) modified its input"):
        model(torch.randn(4, 16))
    opt.remove()


def test_in_place_change_of_an_input_after_fails_in_backward_naming_the_module():
    model = Outer(in_place_after=True)
    model(torch.randn(4, 16)).backward()  # fine without recompute
    opt = MemoryOptimizer(rc(modules=["inner"]))
    opt.apply(model)
    loss = model(torch.randn(4, 16))
    with pytest.raises(RecomputeError, match=r"input of 'inner' \(Inner\).*after its forward"):
        loss.backward()
    opt.remove()


def test_a_failing_replay_names_the_module():
    class Consuming(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.scales = [2.0]

        def forward(self, x):
            scale = self.scales.pop()  # state the forward uses up: a replay cannot run
            return self.lin(x).sin() * scale

    model = nn.Sequential(nn.Linear(16, 16), Consuming())
    opt = MemoryOptimizer(rc(modules=["1"]))
    opt.apply(model)
    loss = model(torch.randn(4, 16)).sum()
    with pytest.raises(RecomputeError, match=r"replaying '1' \(Consuming\)") as err:
        loss.backward()
    assert isinstance(err.value.__cause__, IndexError)
    opt.remove()


# --------------------------------------------------------------------------- planner
def measured(*costs: ModuleCost, baseline: int = 100, unsafe=()) -> Measurement:
    return Measurement(baseline, {c.fqn: c for c in costs}, frozenset(unsafe))


def cost(fqn, saved, flops, before=0, start=0, end=0) -> ModuleCost:
    return ModuleCost(fqn, "container", saved, flops, before, start, end)


# A stem, then a stage of two blocks; the stage also frees the tensor between its blocks (5).
# Order of saves: stem 20 | block 0: 25 | between: 5 | block 1: 25 | head: 25 (kept).
STAGED = (
    cost("stem", 20, 1.0, before=0, start=0, end=1),
    cost("stage", 55, 2.0, before=20, start=1, end=4),
    cost("stage.0", 25, 1.0, before=20, start=1, end=2),
    cost("stage.1", 25, 1.0, before=50, start=3, end=4),
)


def test_planner_prefers_blocks_to_a_stage_whose_replay_is_the_peak():
    plan = choose(measured(*STAGED), budget=0.3)
    assert plan.chosen == ("stem", "stage.0", "stage.1")
    assert plan.kept_bytes == 30 and plan.peak_bytes == 30
    # by freed bytes per operation alone the stage (27.5) beats a block (25); but its replay
    # would hold 55 bytes on top of what is kept before it, a peak of 55 instead of 30
    assert STAGED[1].bytes_per_flop > STAGED[2].bytes_per_flop


def test_replays_count_at_full_precision_beside_compressed_bytes():
    """Under compression the planner counts what is kept compressed (int8: a quarter), but a
    replay re-creates its region uncompressed: block 1 (25 bytes, 6 kept) replays 25 bytes on
    top of the 12 held before it, a peak of 37 where the kept 25 were the peak; and the
    backward's start holds the largest storage decoded beside what is kept."""
    compressed = {c.fqn: dataclasses.replace(c, saved_bytes=c.saved_bytes // 4) for c in STAGED}
    block = dataclasses.replace(compressed["stage.1"], before_bytes=50 // 4)
    full = {c.fqn: c for c in STAGED}
    assert estimated_peak([block], kept=25) == 25  # counted compressed: no peak above kept
    assert estimated_peak([block], kept=25, replayed=full) == 12 + 25
    assert estimated_peak([], kept=25, transient=25) == 50


def test_planner_upgrades_to_a_container_and_drops_the_picks_inside():
    act = cost("mlp.act", 10, 0.1, before=40, start=4, end=5)
    mlp = cost("mlp", 40, 1.0, before=30, start=3, end=6)
    plan = choose(measured(act, mlp), budget=0.6)
    assert plan.chosen == ("mlp",) and plan.kept_bytes == 60


def test_planner_takes_the_cheapest_pick_that_meets_the_budget():
    big = cost("big", 40, 1.0, before=0, start=0, end=1)
    small = cost("small", 12, 0.5, before=50, start=2, end=3)
    plan = choose(measured(big, small), budget=0.9)
    assert plan.chosen == ("small",) and plan.kept_bytes == 88


def test_planner_skips_unsafe_oversized_and_fixed_modules():
    costs = (
        cost("a", 30, 0.1, start=0, end=1),  # changed its input in place
        cost("b", 60, 0.1, start=1, end=2),  # frees more than half the baseline
        cost("c", 20, 0.1, start=2, end=3),
        cost("c.x", 10, 0.01, start=2, end=3),  # inside a module the config recomputes
        cost("d", 10, 1.0, start=3, end=4),
    )
    plan = choose(measured(*costs, unsafe={"a"}), budget=0.1, fixed=("c",))
    assert plan.chosen == ("d",) and plan.fixed == ("c",)
    assert plan.kept_bytes == 70 and not plan.met
    assert "budget not reachable" in str(plan)
    with pytest.raises(ConfigError, match="recompute.auto.budget"):
        choose(measured(*costs), budget=1.5)


def test_planner_meets_the_budget_without_nesting(caplog):
    model, batch, loss_fn = small_gpt()
    opt = MemoryOptimizer(rc(auto={"budget": 0.3}))
    opt.apply(model)
    with caplog.at_level(logging.INFO, logger="memopt"):
        plan = plan_recompute(opt, lambda: loss_fn(model, batch))
    assert plan.met and plan.kept_bytes <= 0.3 * plan.baseline_bytes
    assert opt.plan.recompute is plan and opt.plan.recomputed == plan.chosen
    assert outermost(plan.chosen) == list(plan.chosen)
    by_fqn = {c.fqn: c for c in plan.candidates}
    freed = sum(by_fqn[f].saved_bytes for f in plan.chosen)
    assert plan.kept_bytes == plan.baseline_bytes - freed
    table = str(plan)
    assert all(f in table for f in plan.chosen) and "recompute plan" in caplog.text
    for fqn, cost in by_fqn.items():  # nothing picked that would free nothing
        assert cost.saved_bytes > 0, fqn
    opt.remove()


def test_auto_planner_measures_the_first_training_forward_then_recomputes():
    model, batch, loss_fn = small_gpt()
    exact = gradients(model, batch, loss_fn, seed=5)
    opt = MemoryOptimizer(rc(auto={"budget": 0.5}))
    opt.apply(model)
    with torch.no_grad():
        loss_fn(model, batch)  # evaluation: not measured
    model.eval()
    loss_fn(model, batch)
    model.train()
    assert opt.plan.recomputed == () and opt.plan.recompute is None
    loss_fn(model, batch).backward()  # measured step: plain
    plan = opt.plan.recompute
    assert plan is not None and opt.plan.recomputed == plan.chosen != ()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    loss_fn(model, batch).backward()  # recomputing step
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert all(torch.equal(got[k], exact[k]) for k in exact)
    state = opt.state_dict()
    opt.remove()
    assert state["recompute"] == list(plan.chosen)

    resumed = MemoryOptimizer(rc(auto={"budget": 0.5}))
    resumed.load_state_dict(state)  # before apply, as Lightning restores callbacks
    resumed.apply(model)
    assert resumed.plan.recomputed == plan.chosen  # at once, without a measured step
    loss_fn(model, batch).backward()
    assert resumed.plan.recompute is None and resumed.plan.recomputed == plan.chosen
    resumed.remove()


def test_planner_never_picks_a_module_that_changes_its_input_in_place():
    class Doubling(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            x.mul_(2)
            return self.lin(x).sigmoid()

    class Branches(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = nn.Linear(64, 64)
            self.doubling = Doubling()
            self.act = nn.Sequential(nn.Linear(64, 64), nn.GELU())

        def forward(self, x):
            h = self.pre(x)
            return (self.doubling(h) + self.act(self.pre(x))).sum()

    model = Branches()
    opt = MemoryOptimizer(rc(auto={"budget": 0.5}))
    opt.apply(model)
    plan = plan_recompute(opt, lambda: model(torch.randn(256, 64)))
    candidates = {c.fqn for c in plan.candidates}
    assert "act" in candidates and "doubling" not in candidates
    assert "doubling" not in opt.plan.recomputed
    opt.remove()


def test_plan_recompute_leaves_rng_and_buffers_as_they_were():
    model, batch, loss_fn = small_resnet()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    opt = MemoryOptimizer(rc(auto={"budget": 0.5}))
    opt.apply(model)
    torch.manual_seed(7)
    state = torch.get_rng_state()
    plan_recompute(opt, lambda: loss_fn(model, batch))
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    opt.remove()


# --------------------------------------------------------------------------- refusals, config
def hf_checkpointing(model, on: bool) -> None:
    """transformers >= 5 names it activation checkpointing; 4.x gradient checkpointing."""
    name = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    getattr(model, f"{name}_checkpointing_{'enable' if on else 'disable'}")()


def test_hugging_face_gradient_checkpointing_is_refused():
    model, _, _ = small_gpt()
    hf_checkpointing(model, True)
    hooks = hook_counts(model)
    with pytest.raises(ConfigError, match=r"gradient_checkpointing is on.*_checkpointing_disable"):
        MemoryOptimizer(rc(auto={"budget": 0.5})).apply(model)
    assert instance_forwards(model) == [] and hook_counts(model) == hooks  # untouched
    hf_checkpointing(model, False)
    opt = MemoryOptimizer(rc(types=["GPT2Block"]))
    opt.apply(model)
    opt.remove()


def test_timm_and_torch_checkpoint_wrappers_are_refused():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.GELU()))
    model[1].grad_checkpointing = True  # what timm's set_grad_checkpointing() sets
    assert "1.grad_checkpointing" in existing_checkpointing(model)[0]
    with pytest.raises(ConfigError, match="timm set_grad_checkpointing"):
        MemoryOptimizer(rc(modules=["0"])).apply(model)
    model[1].grad_checkpointing = False
    model[1] = checkpoint_wrapper(model[1])
    with pytest.raises(ConfigError, match="CheckpointWrapper"):
        MemoryOptimizer(rc(modules=["0"])).apply(model)
    assert instance_forwards(model) == []


def test_compression_alone_acts_beside_hf_checkpointing():
    model, batch, loss_fn = small_gpt()
    hf_checkpointing(model, True)
    exact = gradients(model, batch, loss_fn)
    err = rel_error(gradients(model, batch, loss_fn, {"quantize": {"bits": 8}}), exact)
    assert 0 < err < 0.009  # compressed beside the checkpointing, 8 bits: measured 0.73%


@pytest.mark.parametrize(
    "section, message",
    [
        ({"modules": ["transformer.h.*.mpl"]}, "Did you mean 'transformer.h.1.mlp'"),
        ({"types": ["GPT2MLPP"]}, "recompute.types: 'GPT2MLPP' matches no module class"),
        ({"modules": ["*"]}, "whole model"),
        ({"modules": ["transformer.h"]}, "ModuleList, which is never called"),
    ],
)
def test_bad_selections_are_config_errors(section, message):
    model, _, _ = small_gpt()
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("*", r"\*")):
        MemoryOptimizer(rc(**section)).apply(model)
    assert instance_forwards(model) == []


def test_nested_selection_recomputes_the_outer_module_only():
    model, _, _ = small_gpt()
    opt = MemoryOptimizer(rc(modules=["transformer.h.0", "transformer.h.*.mlp"]))
    opt.apply(model)
    assert opt.plan.recomputed == ("transformer.h.0", "transformer.h.1.mlp")
    opt.remove()


# --------------------------------------------------------------------------- lifecycle
def test_state_dict_keys_unchanged_and_remove_restores_exactly():
    model, batch, loss_fn = small_gpt()
    keys, hooks = list(model.state_dict()), hook_counts(model)
    special = model.transformer.h[1].mlp
    own_forward = special.forward  # an instance attribute that was there before memopt
    special.forward = own_forward
    opt = MemoryOptimizer(rc(modules=["transformer.h.*.mlp"], auto={"budget": 0.3}))
    opt.apply(model)
    assert list(model.state_dict()) == keys
    loss_fn(model, batch).backward()  # planner measures
    loss_fn(model, batch).backward()  # planner's choice recomputes
    assert len(opt.plan.recomputed) > 2
    saved = copy.deepcopy(model.state_dict())
    opt.remove()
    assert instance_forwards(model) == ["transformer.h.1.mlp"]
    assert special.__dict__["forward"] is own_forward
    assert hook_counts(model) == hooks and list(model.state_dict()) == keys
    plain, _, _ = small_gpt()
    plain.load_state_dict(saved)  # saved with the plugin, loads without it (strict)
    patched, _, _ = small_gpt()
    opt = MemoryOptimizer(rc(types=["GPT2Block"]))
    opt.apply(patched)
    patched.load_state_dict(plain.state_dict())  # and the reverse
    opt.remove()


def test_layer_kinds():
    assert layer_kind(nn.RMSNorm(8)) == "norm" and layer_kind(nn.BatchNorm2d(8)) == "norm"
    assert layer_kind(nn.PReLU()) == "activation" and layer_kind(nn.SiLU()) == "activation"
    assert layer_kind(nn.Conv2d(3, 3, 3)) == "compute" and layer_kind(nn.Dropout()) == "dropout"
    assert layer_kind(nn.Sequential(nn.Linear(2, 2))) == "container"
    assert within("a.b.c", "a.b") and within("a", "") and not within("a.bc", "a.b")
    assert not within("a", "a") and outermost(["a.b", "a", "c.d", "a.b.c"]) == ["a", "c.d"]


def test_a_forward_replaced_after_wrap_is_left_with_a_warning(caplog):
    model, _, _ = small_gpt()
    mlp = model.transformer.h[0].mlp
    opt = MemoryOptimizer(rc(modules=["transformer.h.0.mlp"]))
    opt.apply(model)
    mine = mlp.forward = lambda *a, **k: None  # someone else patches after memopt
    with caplog.at_level(logging.WARNING, logger="memopt"):
        opt.remove()
    assert "transformer.h.0.mlp.forward was replaced after memopt wrapped it" in caplog.text
    assert mlp.__dict__["forward"] is mine  # left as is
