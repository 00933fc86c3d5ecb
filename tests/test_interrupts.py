"""An interrupt (KeyboardInterrupt, SystemExit) inside a patched forward leaves nothing of memopt
on the thread: torch runs ``always_call`` hooks only for an ``Exception``."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from memopt_plugins import MemoryOptimizer

pytestmark = pytest.mark.usefixtures("one_thread")

#: Every module a scope at 2 bits (nearest rounding: a step draws no noise), functional dropout
#: routed through a TorchFunctionMode.
CONFIG = {
    "quantize": {"bits": 2, "modules": ["*"], "min_numel": 1, "rounding": "nearest"},
    "dropout": {"mode": "bitmask"},
    "drift": {"enabled": False},
}
INTERRUPTS = [KeyboardInterrupt, SystemExit]


class Interrupter(nn.Module):
    """Raises ``interrupt`` at its ``at``-th call (counted from 1), else passes its input on."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupt: type[BaseException] | None = None
        self.at = 0
        self.calls = 0

    def arm(self, interrupt: type[BaseException], at: int = 1) -> None:
        self.interrupt, self.at, self.calls = interrupt, at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        interrupt = self.interrupt
        if interrupt is not None and self.calls == self.at:
            self.interrupt, self.calls = None, 0
            raise interrupt()
        return x


class Net(nn.Module):
    """The interrupter three modules deep, in a block with dropout and a GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.body = nn.Sequential(
            nn.Linear(32, 32),
            nn.Sequential(nn.GELU(), Interrupter(), nn.Dropout(0.25)),
            nn.Linear(32, 32),
        )
        self.out = nn.Linear(32, 4)

    @property
    def interrupter(self) -> Interrupter:
        return self.body[1][1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.nn.functional.dropout(self.body(self.inp(x)), 0.1))


def _pair() -> tuple[Net, Net]:
    torch.manual_seed(0)
    model = Net()
    return model, copy.deepcopy(model)


def _step(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    model(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _lone_linear_input_grad() -> torch.Tensor:
    torch.manual_seed(2)
    lin, x = nn.Linear(64, 64), torch.randn(16, 64, requires_grad=True)
    lin(x).square().sum().backward()
    return x.grad


def _nothing_left_on_the_thread() -> None:
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert torch.overrides._get_current_function_mode_stack() == []


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("removed", [False, True], ids=["patched", "removed"])
@pytest.mark.parametrize("interrupt", INTERRUPTS, ids=lambda e: e.__name__)
def test_an_interrupt_in_a_forward_leaves_no_hooks_nor_modes_and_the_next_step_is_exact(
    interrupt, removed
):
    exact_lone = _lone_linear_input_grad()
    model, twin = _pair()
    opt = MemoryOptimizer(CONFIG)
    opt.apply(model)
    x = torch.randn(8, 16)
    model.interrupter.arm(interrupt)
    with pytest.raises(interrupt):
        model(x).square().mean().backward()
    if removed:
        opt.remove()
    _nothing_left_on_the_thread()
    # A model memopt never saw computes as without memopt, bit for bit ...
    assert torch.equal(_lone_linear_input_grad(), exact_lone)
    # ... and the interrupted model's next step is a fresh one's (patched alike, or plain).
    if not removed:
        MemoryOptimizer(CONFIG).apply(twin)
    _assert_equal(_step(model, x), _step(twin, x))
    _nothing_left_on_the_thread()


@pytest.mark.parametrize("interrupt", INTERRUPTS, ids=lambda e: e.__name__)
def test_scopes_a_call_of_a_submodule_abandoned_are_left_at_the_next_call(interrupt):
    """A submodule called on its own (a LightningModule's ``training_step`` calling
    ``self.model``) has no guard: the next call of it, or of the model, finds the scopes it
    abandoned and leaves them before entering its own."""
    model, twin = _pair()
    opt = MemoryOptimizer(CONFIG)
    opt.apply(model)
    MemoryOptimizer(CONFIG).apply(twin)
    h = torch.randn(8, 32)
    for again in (model.body, model):
        model.interrupter.arm(interrupt)
        with pytest.raises(interrupt):
            model.body(h)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        again(h if again is model.body else torch.randn(8, 16))
        _nothing_left_on_the_thread()
    x = torch.randn(8, 16)
    _assert_equal(_step(model, x), _step(twin, x))
    # And remove() leaves what the thread holds when no call comes before it.
    model.interrupter.arm(interrupt)
    with pytest.raises(interrupt):
        model.body(h)
    opt.remove()
    _nothing_left_on_the_thread()
    assert opt.internal.hooks is None


@pytest.mark.parametrize("outside", [False, True], ids=["model", "submodule"])
@pytest.mark.parametrize("interrupt", INTERRUPTS, ids=lambda e: e.__name__)
def test_an_interrupt_in_a_drift_checks_compressed_pass_leaves_nothing(interrupt, outside):
    """The check's first pass is exact, its second compressed: interrupted there, through the
    model's call or a submodule's (where only the pass itself can leave the scopes)."""
    exact_lone = _lone_linear_input_grad()
    model, twin = _pair()
    opt = MemoryOptimizer(CONFIG)
    opt.apply(model)
    MemoryOptimizer(CONFIG).apply(twin)
    x = torch.randn(8, 16)

    def loss_fn() -> torch.Tensor:
        if outside:
            return model.out(model.body(model.inp(x))).square().mean()
        return model(x).square().mean()

    model.interrupter.arm(interrupt, at=2)
    with pytest.raises(interrupt):
        opt.check_drift(loss_fn)
    assert opt.internal.hooks._local.scopes == [] and not opt.internal.hooks.suspended
    _nothing_left_on_the_thread()
    assert torch.equal(_lone_linear_input_grad(), exact_lone)
    _assert_equal(_step(model, x), _step(twin, x))
    opt.check_drift(loss_fn)  # and the check runs again
    _nothing_left_on_the_thread()


def test_hooks_of_two_models_on_one_module_are_each_left_and_the_thread_holds_none():
    """A module inside two hooked models (the model and a submodule measured on its own) carries
    two hook pairs, whose exits torch runs in the order of their entries: each is left."""
    from memopt_plugins.measure.scopes import ScopeTracker

    inner = nn.Linear(4, 4)
    outer = nn.Sequential(inner)
    told = []

    class Told:
        def __init__(self, name: str) -> None:
            self.name = name

        def enter(self, fqn, module, args, kwargs) -> None:
            told.append(("enter", self.name, fqn))

        def exit(self, fqn, module, args, output) -> None:
            told.append(("exit", self.name, fqn))

    watches = [
        ScopeTracker.of(outer).watch(Told("outer")),
        ScopeTracker.of(inner).watch(Told("inner")),
    ]
    outer(torch.randn(2, 4))
    for watch in watches:
        watch.remove()
    assert told == [
        ("enter", "outer", ""),
        ("enter", "outer", "0"),
        ("enter", "inner", ""),
        ("exit", "outer", "0"),
        ("exit", "inner", ""),
        ("exit", "outer", ""),
    ]
    assert ScopeTracker.depth() == 0


def _root_pre_hook(model: nn.Module, interrupt: type[BaseException]) -> None:
    """A user's pre-hook on the model, registered after apply: it runs after memopt's."""

    def raise_once(module, args):
        handle.remove()
        raise interrupt()

    handle = model.register_forward_pre_hook(raise_once)


def _root_hook(model: nn.Module, interrupt: type[BaseException]) -> None:
    """A user's forward hook on the model, registered before apply: it runs before memopt's."""

    def raise_once(module, args, output):
        if module.armed:
            module.armed = False
            raise interrupt()

    model.armed = False
    model.register_forward_hook(raise_once)


@pytest.mark.parametrize("where", ["pre-hook", "hook"])
@pytest.mark.parametrize("interrupt", INTERRUPTS, ids=lambda e: e.__name__)
def test_an_interrupt_in_a_users_hook_on_the_model_leaves_nothing(interrupt, where):
    """The model's own scope is entered and left around its forward by the guard, not by
    memopt's hooks: a user's pre-hook runs after memopt's pre-hook and a hook registered before
    apply before memopt's hook, so an interrupt there left the model's compression hooks and
    routing mode on the thread, quantizing a never-patched model run next."""
    exact_lone = _lone_linear_input_grad()
    model, twin = _pair()
    if where == "hook":
        _root_hook(model, interrupt)
    opt = MemoryOptimizer(CONFIG)
    opt.apply(model)
    MemoryOptimizer(CONFIG).apply(twin)
    x = torch.randn(8, 16)
    if where == "hook":
        model.armed = True
    else:
        _root_pre_hook(model, interrupt)
    with pytest.raises(interrupt):
        model(x).square().mean().backward()
    _nothing_left_on_the_thread()
    assert torch.equal(_lone_linear_input_grad(), exact_lone)
    _assert_equal(_step(model, x), _step(twin, x))
    _nothing_left_on_the_thread()
    opt.remove()
    assert "forward" not in vars(model)


class LossNet(Net):
    """Net with its loss, ``F.cross_entropy``, in its forward (routed by the lean ops)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        target = torch.arange(x.shape[0]) % 4
        return nn.functional.cross_entropy(super().forward(x), target)


#: The block around the interrupter recomputed; lean ops: the GELU runs as a lean op (a forward
#: instance attribute of its own, in the recomputed block) and F.cross_entropy is routed through
#: a second TorchFunctionMode.
LAYERED = {
    "recompute": {**CONFIG, "recompute": {"modules": ["body"]}},
    "lean": {**CONFIG, "ops": {"cross_entropy": "lean", "fuse": ["all"]}},
    "both": {
        **CONFIG,
        "recompute": {"modules": ["body"]},
        "ops": {"cross_entropy": "lean", "fuse": ["all"]},
    },
}


@pytest.mark.parametrize("where", ["block", "pre-hook"])
@pytest.mark.parametrize("layers", sorted(LAYERED))
def test_an_interrupt_under_recompute_and_lean_ops_leaves_nothing(layers, where):
    """Inside a recomputed block the scopes' entries saw the checkpoint's saved-tensor hooks as
    innermost; once the checkpoint unwound, the guard refused to leave them (and every scope
    beneath, the model's own). A scope that entered no context of its own is left whatever is
    innermost now; the lean ops' forwards and routing modes are left with the rest."""
    config = LAYERED[layers]
    exact_lone = _lone_linear_input_grad()
    torch.manual_seed(0)
    model = LossNet()
    twin = copy.deepcopy(model)
    opt = MemoryOptimizer(config)
    opt.apply(model)
    MemoryOptimizer(config).apply(twin)
    x = torch.randn(8, 16)
    if where == "block":
        model.interrupter.arm(KeyboardInterrupt)
    else:
        _root_pre_hook(model, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        model(x).backward()
    _nothing_left_on_the_thread()
    assert torch.equal(_lone_linear_input_grad(), exact_lone)

    def step(m: nn.Module) -> dict[str, torch.Tensor]:
        m.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        m(x).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    _assert_equal(step(model), step(twin))
    _nothing_left_on_the_thread()


def test_the_guard_holds_nothing_of_a_forward_once_it_returned():
    """The guard's frame keeps the model's scope alive; a reference cycle through it (its frame
    in a local of its own) kept the forward's output and graph alive until a garbage collection,
    a logits-sized tensor more at the step's peak."""
    model, _ = _pair()
    opt = MemoryOptimizer(CONFIG)
    opt.apply(model)
    enabled = gc.isenabled()
    gc.disable()
    try:
        out = model(torch.randn(8, 16))
        ref = weakref.ref(out)
        del out
        assert ref() is None
    finally:
        if enabled:
            gc.enable()
    opt.remove()
