"""State a forward updates: a recompute replay and a drift check see and leave it by slot.

A replay must start from the buffers and tensor attributes the original forward started from
(spectral norm's power iteration, running-scale normalisers updated in place or by reassignment)
and leave the module as the original forward left it; a drift check's passes must leave every
slot holding the tensor it held, with its value.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memopt_plugins import MemoryOptimizer
from memopt_plugins.measure.isolate import isolated
from memopt_plugins.recompute.wrap import RecomputeError

DIM = 8


class InPlaceScale(nn.Module):
    """Divides by a running RMS kept in a buffer updated in place (``mul_``/``add_``)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("avg", torch.ones(DIM))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.avg.mul_(0.9).add_(0.1 * x.pow(2).mean(0))
        return x * self.avg.rsqrt()


class ReassignedScale(nn.Module):
    """The same normaliser written the usual way: the buffer is reassigned every forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("avg", torch.ones(DIM))

    def forward(self, x):
        if self.training:
            self.avg = 0.9 * self.avg + 0.1 * x.detach().pow(2).mean(0)
        return x * self.avg.rsqrt()


class AttributeScale(nn.Module):
    """A running scale kept as a plain tensor attribute (no buffer), updated in place."""

    def __init__(self):
        super().__init__()
        self.avg = torch.ones(DIM)

    def forward(self, x):
        if self.training:
            self.avg.mul_(0.5).add_(0.5 * x.detach().abs().mean(0))
        return x / self.avg


SPECTRAL = {
    None: lambda lin: lin,
    "hook": nn.utils.spectral_norm,  # u, v: buffers updated in place by a forward pre-hook
    "parametrization": nn.utils.parametrizations.spectral_norm,  # u, v: in a child's forward
}


class Block(nn.Module):
    def __init__(self, norm: nn.Module, spectral: str | None = None):
        super().__init__()
        self.lin = SPECTRAL[spectral](nn.Linear(DIM, DIM))
        self.norm = norm

    def forward(self, x):
        return self.norm(self.lin(x)).tanh()


def stateful_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        Block(InPlaceScale(), spectral="hook"),
        Block(ReassignedScale(), spectral="parametrization"),
        Block(AttributeScale(), spectral="hook"),
        Block(nn.BatchNorm1d(DIM)),
        nn.Linear(DIM, 1),
    )


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer and plain tensor attribute, by name (spectral norm's ``weight`` included)."""
    out = {}
    for fqn, m in model.named_modules():
        slots = dict(m._buffers)
        slots.update((k, v) for k, v in vars(m).items() if type(v) is torch.Tensor)
        out.update((f"{fqn}.{k}", v.detach().clone()) for k, v in slots.items())
    return out


def train(model: nn.Module, steps: int, config: dict | None = None, seed: int = 1):
    """Per step: the parameters' gradients; after the last, the model's state."""
    opt = MemoryOptimizer(config) if config is not None else None
    if opt is not None:
        opt.apply(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(seed)
    grads = []
    for _ in range(steps):
        x = torch.randn(16, DIM) * 3
        sgd.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        sgd.step()
    if opt is not None:
        opt.remove()
    return grads, state(model)


def assert_same(got, expected):
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


# --------------------------------------------------------------------------- recompute
@pytest.mark.parametrize(
    "modules",
    [["0", "1", "2", "3"], ["0.lin", "0.norm", "1.lin", "1.norm", "2.norm", "2.lin", "3.norm"]],
    ids=["blocks", "the-stateful-modules"],
)
def test_replay_starts_from_the_state_the_forward_started_from(modules):
    model = stateful_model()
    twin = copy.deepcopy(model)
    exact, exact_state = train(twin, steps=3)
    got, got_state = train(model, steps=3, config={"recompute": {"modules": modules}})
    for step, (g, e) in enumerate(zip(got, exact, strict=True)):
        assert g.keys() == e.keys()
        for name in e:
            assert torch.equal(g[name], e[name]), (step, name)
    assert_same(got_state, exact_state)


def test_a_module_called_twice_keeps_both_updates():
    """Two calls of one recomputed block: each replay starts from its own call's state, and
    the state after backward is the second call's."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block(ReassignedScale(), spectral="hook")
            self.inner = Block(InPlaceScale())

        def forward(self, x):
            return self.inner(self.block(self.inner(self.block(x))))

    torch.manual_seed(0)
    model = Twice()
    twin = copy.deepcopy(model)
    exact, exact_state = train(twin, steps=2)
    got, got_state = train(model, steps=2, config={"recompute": {"modules": ["block", "inner"]}})
    for g, e in zip(got, exact, strict=True):
        assert_same(g, e)
    assert_same(got_state, exact_state)


class Cloned(TorchDispatchMode):
    """Counts the elements ``aten.clone`` copies."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.clone.default:
            self.numel += args[0].numel()
        return func(*args, **(kwargs or {}))


def test_only_the_slots_a_forward_changes_are_copied_after_the_first():
    """The first forward copies every buffer to learn which it changes; later ones copy those
    only: a large buffer that is only read is not copied again (counted in forward)."""

    class Table(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.randn(4096, DIM))
            self.scale = InPlaceScale()

        def forward(self, x):
            return self.scale(x + self.table[:1])

    model = nn.Sequential(Table(), nn.Linear(DIM, 1))
    opt = MemoryOptimizer({"recompute": {"modules": ["0"]}})
    opt.apply(model)
    copied = []
    for _ in range(3):
        with Cloned() as cloned:
            loss = model(torch.randn(4, DIM)).sum()
        loss.backward()
        copied.append(cloned.numel)
    opt.remove()
    assert copied[0] == 4096 * DIM + DIM
    assert copied[1] == copied[2] == DIM  # avg, as the forward started


def test_an_in_place_update_the_first_forward_did_not_make_raises():
    """Only the slots a forward changed are kept for the replay; an in-place change of another
    slot later cannot be replayed from its old value, so it fails in forward, naming both."""

    class Sometimes(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(DIM, DIM)
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))
            self.register_buffer("scale", torch.ones(DIM))

        def forward(self, x):
            self.calls += 1
            if int(self.calls) == 2:
                self.scale.mul_(2)
            return self.lin(x) * self.scale

    model = nn.Sequential(Sometimes(), nn.Linear(DIM, 1))
    opt = MemoryOptimizer({"recompute": {"modules": ["0"]}})
    opt.apply(model)
    x = torch.randn(4, DIM)
    model(x).sum().backward()
    with pytest.raises(RecomputeError, match=r"'0'.*scale"):
        model(x).sum().backward()
    opt.remove()


# --------------------------------------------------------------------------- drift checks
def _train_checked(checks: bool, steps: int = 3):
    model = stateful_model()
    opt = MemoryOptimizer(
        {"quantize": {"bits": 4, "min_numel": 1}, "drift": {"threshold": 1.0, "check_every": 1}}
    )
    opt.apply(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    reports = []
    for _ in range(steps):
        x = torch.randn(16, DIM) * 3
        sgd.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        if checks and opt.internal.should_check():
            reports.append(opt.check_drift(lambda x=x: model(x).square().mean()))
        sgd.step()
        opt.count_step()
    opt.remove()
    return model, reports


def test_checks_leave_reassigned_and_in_place_state_as_the_run_without_them():
    on, reports = _train_checked(checks=True)
    off, _ = _train_checked(checks=False)
    assert len(reports) == 3 and all(r.escalated == {} and r.max > 0 for r in reports)
    assert_same(state(on), state(off))
    assert_same(dict(on.named_parameters()), dict(off.named_parameters()))


def test_isolated_puts_every_slot_back_as_the_object_it_was():
    model = stateful_model()
    model(torch.randn(4, DIM))
    slots = [(m, dict(m._buffers), dict(m._parameters), dict(vars(m))) for m in model.modules()]
    values = state(model)
    with isolated(model) as isolation:
        for _ in range(2):
            with isolation.one_pass():
                model(torch.randn(4, DIM))
                model[1].norm.avg = torch.zeros(DIM)
                model[0].lin.register_parameter("weight_orig", nn.Parameter(torch.zeros(DIM)))
                model[2].norm.extra = torch.zeros(DIM)
    for m, buffers, params, attributes in slots:
        assert (
            all(m._buffers[k] is v for k, v in buffers.items())
            and m._buffers.keys() == buffers.keys()
        )
        assert all(m._parameters[k] is v for k, v in params.items())
        assert all(vars(m)[k] is v for k, v in attributes.items() if isinstance(v, torch.Tensor))
        assert not any(
            isinstance(vars(m).get(k), torch.Tensor) for k in vars(m).keys() - attributes.keys()
        )
    assert_same(state(model), values)
