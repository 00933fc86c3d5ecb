"""The lean ops change a model's numerics nowhere silently: every custom autograd function's
double backward passes ``gradgradcheck`` in float64 or raises an error naming
``once_differentiable``; ``ops.loss: chunked`` keeps what a model adds to its loss (an MoE's
router loss) or leaves the loss as it is, logged; ``ops.fuse`` probes forward and backward on
random parameters, so a zero-initialised projection hides no difference."""

from __future__ import annotations

import copy
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

import memopt_plugins
from memopt_plugins import MemoryOptimizer
from memopt_plugins.batchnorm_ops import _Link
from memopt_plugins.buffers import mark_private
from memopt_plugins.config import OpsConfig
from memopt_plugins.lean.chains import batch_norm, gelu, rms_norm
from memopt_plugins.lean.patch import LeanOps

_D = torch.float64


def _t(*shape, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, dtype=_D, requires_grad=grad)


def _seeded(apply):
    """``apply`` drawing the same randomness at every call (gradcheck calls it many times)."""

    def run(*inputs):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return apply(*inputs)

    return run


def _cases() -> dict[str, tuple]:
    """For each custom Function, by ``module.Class`` (``[variant]`` after it for more cases): a
    function of float64 tensors, and those tensors."""
    target = torch.tensor([1, 4, -100, 0, 6])
    bn_stats = (torch.rand(3, dtype=_D), torch.rand(3, dtype=_D) + 0.5)
    conv_args = ((1, 1), (1, 1), (1, 1), 1)
    ce = "memopt_plugins.lean"
    return {
        f"{ce}.chains._Gelu": (lambda x: gelu(x, "tanh"), (_t(3, 4),)),
        f"{ce}.chains._GeluMlp": (
            lambda x, a, b, c, d: _fn(ce, "chains._GeluMlp").apply(x, a, b, c, d, "tanh"),
            (_t(2, 3, 4), _t(6, 4), _t(6), _t(4, 6), _t(4)),
        ),
        f"{ce}.chains._TiledGeluMlp": (
            lambda x, a, b, c, d: _fn(ce, "chains._TiledGeluMlp").apply(x, a, b, c, d, "none", 2),
            (_t(2, 3, 4), _t(6, 4), _t(6), _t(4, 6), _t(4)),
        ),
        f"{ce}.chains._TiledGatedMlp": (
            lambda x, a, b, c: _fn(ce, "chains._TiledGatedMlp").apply(x, a, b, c, False, 2),
            (_t(2, 3, 4), _t(6, 4), _t(6, 4), _t(4, 6)),
        ),
        f"{ce}.chains._GatedMlp": (
            lambda x, a, b, c: _fn(ce, "chains._GatedMlp").apply(x, a, b, c, False, 2),
            (_t(2, 3, 4), _t(6, 4), _t(6, 4), _t(4, 6)),
        ),
        f"{ce}.chains._GatedMlp[geglu]": (
            lambda x, a, b, c: _fn(ce, "chains._GatedMlp").apply(x, a, b, c, True, 2),
            (_t(2, 3, 4), _t(6, 4), _t(6, 4), _t(4, 6)),
        ),
        f"{ce}.chains._GatedProduct": (
            lambda g, u: _fn(ce, "chains._GatedProduct").apply(g, u, False),
            (_t(3, 4), _t(3, 4)),
        ),
        f"{ce}.chains._GatedProduct[geglu]": (
            lambda g, u: _fn(ce, "chains._GatedProduct").apply(g, u, True),
            (_t(3, 4), _t(3, 4)),
        ),
        f"{ce}.chains._Gelu[exact]": (lambda x: gelu(x), (_t(3, 4),)),
        f"{ce}.chains._GeluMlp[bias-free]": (
            lambda x, a, c: _fn(ce, "chains._GeluMlp").apply(x, a, None, c, None, "none"),
            (_t(2, 3, 4), _t(6, 4), _t(4, 6)),
        ),
        f"{ce}.chains._BatchNorm[not affine]": (
            lambda x: batch_norm(x, None, None, None, None, 0.1, 1e-5),
            (_t(4, 3, 5),),
        ),
        f"{ce}.conv._Conv[the batch, kept as it is]": (
            lambda x, w, b: _fn(ce, "conv._Conv").apply(x, w, b, *conv_args),
            (_t(2, 2, 5, 5, grad=False), _t(3, 2, 3, 3), _t(3)),
        ),
        f"{ce}.conv._Conv[strided, grouped]": (
            lambda x, w: _fn(ce, "conv._Conv").apply(x, w, None, (2, 2), (1, 1), (1, 1), 2),
            (_t(2, 4, 5, 5), _t(4, 2, 3, 3)),
        ),
        f"{ce}.chains._LayerNorm": (
            lambda x, w, b: _fn(ce, "chains._LayerNorm").apply(x, (4,), w, b, 1e-5),
            (_t(3, 4), _t(4), _t(4)),
        ),
        f"{ce}.chains._RMSNorm": (lambda x, w: rms_norm(x, w, 1e-6), (_t(3, 4), _t(4))),
        f"{ce}.chains._BatchNorm": (
            lambda x, w, b: batch_norm(x, w, b, None, None, 0.1, 1e-5),
            (_t(4, 3, 5), _t(3), _t(3)),
        ),
        f"{ce}.conv._Conv": (
            lambda x, w, b: _fn(ce, "conv._Conv").apply(x, w, b, *conv_args),
            (_t(2, 2, 5, 5), _t(3, 2, 3, 3), _t(3)),
        ),
        f"{ce}.conv._ReLU": (lambda x: _fn(ce, "conv._ReLU").apply(x * 1, False), (_t(3, 4),)),
        f"{ce}.conv._MaxPool": (
            lambda x: _fn(ce, "conv._MaxPool").apply(x, 2, 2, 0, 1, False)[0],
            (_t(2, 2, 4, 4),),
        ),
        f"{ce}.entropy._CrossEntropy": (
            lambda z: _fn(ce, "entropy._CrossEntropy").apply(z, target, -100, 0.1, 2, 4),
            (_t(5, 7),),
        ),
        f"{ce}.loss._LinearCrossEntropy": (
            lambda h, w, b: _fn(ce, "loss._LinearCrossEntropy").apply(
                h, w, b, target, _fn(ce, "loss.LossOptions")(-100, 0.0, None, 2), None, None
            ),
            (_t(5, 4), _t(7, 4), _t(7)),
        ),
        f"{ce}.loss._LinearCrossEntropyGradientsFirst": (
            lambda h, w, b: _fn(ce, "loss._LinearCrossEntropyGradientsFirst").apply(
                h, w, b, target, _fn(ce, "loss.LossOptions")(-100, 0.0, None, 2), 4, None
            ),
            (_t(5, 4), _t(7, 4), _t(7)),
        ),
        "memopt_plugins.batchnorm_ops._FusedReLU": (
            lambda z: _fn("memopt_plugins", "batchnorm_ops._FusedReLU").apply(
                z * 1, _Link("probe", None), False
            ),
            (_t(3, 4),),
        ),
        "memopt_plugins.batchnorm_ops._RunningBatchNorm": (
            lambda x, w, b: _fn("memopt_plugins", "batchnorm_ops._RunningBatchNorm").apply(
                x, w, b, *bn_stats, 1e-5, None, None
            ),
            (_t(4, 3, 5), _t(3), _t(3)),
        ),
        "memopt_plugins.dropout._DropoutFunction[regenerated, feature, alpha]": (
            _seeded(
                lambda x: _fn("memopt_plugins", "dropout._DropoutFunction").apply(
                    x * 1, 0.3, True, True, True, True, True
                )
            ),
            (_t(3, 4, 5),),
        ),
        "memopt_plugins.dropout._DropoutFunction": (
            _seeded(
                lambda x: _fn("memopt_plugins", "dropout._DropoutFunction").apply(
                    x, 0.3, False, True, False, False, False
                )
            ),
            (_t(3, 4),),
        ),
    }


def _fn(package: str, name: str) -> type[torch.autograd.Function]:
    module, cls = name.rsplit(".", 1)
    return getattr(importlib.import_module(f"{package}.{module}"), cls)


def _functions() -> set[str]:
    """Every ``torch.autograd.Function`` subclass defined in memopt_plugins' modules."""
    found = set()
    path, prefix = memopt_plugins.__path__, "memopt_plugins."
    for info in pkgutil.walk_packages(path, prefix):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, torch.autograd.Function) and cls.__module__ == info.name:
                found.add(f"{info.name}.{cls.__name__}")
    return found


def test_every_custom_function_has_a_double_backward_case():
    found = _functions()
    assert found == {name.split("[")[0] for name in _cases()}
    # none defined where the module walk cannot see it (inside a function)
    root = Path(memopt_plugins.__file__).parent
    defined = sum(f.read_text().count("(torch.autograd.Function):") for f in root.rglob("*.py"))
    assert defined == len(found)


def _decoded(private: bool):
    """Saved-tensor hooks that hand each node a fresh copy, marked private (as memopt's decoded
    tensors are: a lean backward may write its gradients into them) or not."""
    unpack = (lambda t: mark_private(t.clone())) if private else (lambda t: t.clone())
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), unpack)


@pytest.mark.parametrize("private", [False, True], ids=["saved", "decoded"])
@pytest.mark.parametrize("name", sorted(_cases()))
def test_double_backward_is_right_or_raises(name, private):
    torch.manual_seed(0)
    apply, plain = _cases()[name]

    def apply(*inputs, apply=apply):
        with _decoded(private):
            return apply(*inputs)

    inputs = plain
    try:
        passed = torch.autograd.gradgradcheck(apply, inputs, atol=1e-5, rtol=1e-4)
    except RuntimeError as error:
        if "once_differentiable" not in str(error):
            raise
        passed = False
    if passed:
        return
    # first order only: refused even where the incoming gradient is a constant (the op ends the
    # model) and the second backward asks for some inputs only
    out = apply(*inputs)
    wanted = [t for t in inputs if t.requires_grad]
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grads = torch.autograd.grad(out.sum(), wanted, create_graph=True, allow_unused=True)
        penalty = sum(g.square().sum() for g in grads if g is not None)
        torch.autograd.grad(penalty, wanted[-1:], allow_unused=True)


class _Lean(nn.Module):
    """A small model whose ops the test swaps for the lean ones."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(6, 6, dtype=_D)
        self.bn = nn.BatchNorm1d(6, dtype=_D)
        self.weight = nn.Parameter(torch.rand(6, dtype=_D) + 0.5)
        self.out = nn.Linear(6, 1, dtype=_D)

    def forward(self, x: torch.Tensor, lean: bool) -> torch.Tensor:
        h = self.inp(x)
        if self.kind == "batchnorm":
            h = (
                batch_norm(h, self.bn.weight, self.bn.bias, None, None, 0.1, 1e-5)
                if lean
                else (nn.functional.batch_norm(h, None, None, self.bn.weight, self.bn.bias, True))
            )
        elif self.kind == "rmsnorm":
            h = (
                rms_norm(h, self.weight, 1e-6)
                if lean
                else (self.weight * h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-6))
            )
        else:
            h = gelu(h) if lean else nn.functional.gelu(h)
        return self.out(h)


@pytest.mark.parametrize("kind", ["batchnorm", "rmsnorm", "gelu"])
def test_a_gradient_penalty_equals_torchs_through_lean_ops(kind):
    """An R1-style penalty (the input gradient's squared norm) through a lean BN / RMSNorm /
    GELU whose inputs come back decoded: the parameters' gradients equal plain torch's."""
    torch.manual_seed(0)
    model = _Lean(kind)
    x = torch.randn(8, 6, dtype=_D)

    def grads(lean: bool) -> list[torch.Tensor]:
        model.zero_grad()
        xi = x.clone().requires_grad_()
        with _decoded(private=lean):  # the lean ops' inputs come back decoded, as compressed
            out = model(xi, lean)
        (g,) = torch.autograd.grad(out.square().sum(), xi, create_graph=True)
        g.square().sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    mine, theirs = grads(True), grads(False)
    assert len(mine) == len(theirs) >= 2
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def _twice(kind: str, lean: bool, x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """Two calls of one lean op with the same parameters (a shared block), the second call's
    input made from the first's output; or plain torch's ops (``lean`` False)."""
    gelu_mlp = _fn("memopt_plugins.lean", "chains._GeluMlp")
    for _ in range(2):
        if kind == "rmsnorm":
            (w,) = params
            x = (
                rms_norm(x, w, 1e-6)
                if lean
                else w * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
            )
        elif kind == "batchnorm":
            w, b = params
            x = (
                batch_norm(x, w, b, None, None, 0.1, 1e-5)
                if lean
                else nn.functional.batch_norm(x, None, None, w, b, True)
            )
        else:
            a, b, c, d = params
            plain = nn.functional
            x = (
                gelu_mlp.apply(x, a, b, c, d, "tanh")
                if lean
                else plain.linear(plain.gelu(plain.linear(x, a, b), approximate="tanh"), c, d)
            )
    return x


@pytest.mark.parametrize("kind", ["batchnorm", "rmsnorm", "mlp"])
def test_a_gradient_penalty_through_a_lean_op_called_twice_equals_torchs(kind):
    """A lean op whose parameters also made its input (one module called twice): in a backward
    that builds a graph, each call's gradients are its own partial derivatives, not ones that
    also count the path through the other call, so first and second derivatives are torch's."""
    torch.manual_seed(0)
    shapes = {"rmsnorm": [(6,)], "batchnorm": [(6,), (6,)], "mlp": [(9, 6), (9,), (6, 9), (6,)]}
    params = [(torch.rand(*s, dtype=_D) + 0.5).requires_grad_() for s in shapes[kind]]
    x = torch.randn(8, 6, dtype=_D)

    def grads(lean: bool) -> list[torch.Tensor]:
        xi = x.clone().requires_grad_()
        out = _twice(kind, lean, xi, params).sin().sum()
        first = torch.autograd.grad(out, [xi, *params], create_graph=True)
        penalty = sum(g.square().sum() for g in first)
        return [g.detach() for g in first] + list(torch.autograd.grad(penalty, params))

    for a, b in zip(grads(True), grads(False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def _mixtral():
    """A tiny Mixtral training with its router load-balancing loss (output_router_logits)."""
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.5, max_position_embeddings=32,
    )  # fmt: skip
    return MixtralForCausalLM(config)


def _llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _with_an_extra_term():
    """A causal LM whose own forward adds a term (a penalty on its head) to the loss."""
    model = _llama()
    plain = type(model).forward

    def forward(*args, **kwargs):
        out = plain(model, *args, **kwargs)
        if out.loss is not None:
            out.loss = out.loss + 0.1 * model.lm_head.weight.square().sum()
        return out

    model.forward = forward
    return model


def _step(model, ids):
    model.train()
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("build", [_mixtral, _with_an_extra_term])
def test_the_chunked_loss_keeps_what_the_model_adds_to_its_loss_or_refuses(build, caplog):
    """An MoE's router load-balancing loss (Mixtral, output_router_logits) and a term a model's
    own forward adds: with ops.loss chunked the loss, its aux_loss and every gradient (the
    router's too) equal the model's own."""
    model = build()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    theirs, their_grads = _step(model, ids)
    ops = LeanOps(OpsConfig(loss="chunked"))
    with caplog.at_level("INFO", logger="memopt"):
        actions = ops.apply(model)
    mine, my_grads = _step(model, ids)
    ops.remove()
    torch.testing.assert_close(mine.loss, theirs.loss, rtol=1e-5, atol=1e-6)
    assert my_grads.keys() == their_grads.keys()
    for name, grad in their_grads.items():
        torch.testing.assert_close(my_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    if getattr(theirs, "aux_loss", None) is not None:
        torch.testing.assert_close(mine.aux_loss, theirs.aux_loss)
    if "lean loss" not in actions.values():
        refusals = [r for r in caplog.records if "ops.loss chunked left" in r.getMessage()]
        assert len(refusals) == 1
        assert type(model).__name__ in refusals[0].getMessage()


def test_the_chunked_loss_still_acts_on_a_plain_causal_lm():
    model = _llama()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    theirs, their_grads = _step(model, ids)
    ops = LeanOps(OpsConfig(loss="chunked"))
    assert ops.apply(model) == {"": "lean loss"}
    mine, my_grads = _step(model, ids)
    ops.remove()
    assert mine.logits is None
    torch.testing.assert_close(mine.loss, theirs.loss, rtol=1e-5, atol=1e-6)
    for name, grad in their_grads.items():
        torch.testing.assert_close(my_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_router_loss_asked_for_in_the_call_runs_the_models_own_forward():
    """Mixtral with output_router_logits off in its config gets the chunked loss; a call that
    turns it on gets the model's own output, aux_loss included."""
    model = _mixtral()
    model.config.output_router_logits = False
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    model.train()
    torch.manual_seed(0)
    theirs = model(input_ids=ids, labels=ids, output_router_logits=True)
    ops = LeanOps(OpsConfig(loss="chunked"))
    assert ops.apply(model) == {"": "lean loss"}
    torch.manual_seed(0)
    mine = model(input_ids=ids, labels=ids, output_router_logits=True)
    assert model(input_ids=ids, labels=ids).logits is None  # the chunked loss acts otherwise
    ops.remove()
    assert float(theirs.aux_loss.detach()) > 0
    torch.testing.assert_close(mine.aux_loss, theirs.aux_loss)
    torch.testing.assert_close(mine.loss, theirs.loss)


class _ReluSquaredMlp(nn.Module):
    """modded-nanoGPT's MLP (ReLU squared), its output projection zero at init; the GELU module
    it was built with stays, unused."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(0.0)
        nn.init.zeros_(self.c_proj.weight)

    def forward(self, x):
        return self.dropout(self.c_proj(torch.relu(self.c_fc(x)).square()))


class _ClampedGatedMlp(nn.Module):
    """A SwiGLU MLP whose gate is clamped, its down projection zero at init."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.gate_proj = nn.Linear(width, 2 * width, bias=False)
        self.up_proj = nn.Linear(width, 2 * width, bias=False)
        self.down_proj = nn.Linear(2 * width, width, bias=False)
        self.act_fn = nn.SiLU()
        nn.init.zeros_(self.down_proj.weight)

    def forward(self, x):
        gate = self.act_fn(self.gate_proj(x)).clamp(max=1.0)
        return self.down_proj(gate * self.up_proj(x))


class _Residual(nn.Module):
    def __init__(self, mlp: nn.Module, width: int = 16):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.mlp = mlp
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.mlp(h))


@pytest.mark.parametrize("mlp", [_ReluSquaredMlp, _ClampedGatedMlp])
def test_a_zero_output_projection_hides_nothing_from_the_probe(mlp, caplog):
    """An MLP whose forward is not the lean op's, behind a projection initialised to zero (its
    output is zero either way at init): refused, one logged line, and the gradients equal the
    model's own."""
    torch.manual_seed(0)
    model = _Residual(mlp())
    x = torch.randn(4, 6, 16)

    def grads():
        model.zero_grad()
        model(x).square().sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    theirs = grads()
    assert (
        theirs["mlp." + ("c_proj" if mlp is _ReluSquaredMlp else "down_proj") + ".weight"]
        .abs()
        .sum()
        > 0
    )
    ops = LeanOps(OpsConfig(fuse=["all"]))
    randomness = torch.get_rng_state()
    with caplog.at_level("WARNING", logger="memopt"):
        actions = ops.apply(model)
    assert torch.equal(torch.get_rng_state(), randomness)
    mine = grads()
    ops.remove()
    assert "mlp" not in actions
    refusals = [r.getMessage() for r in caplog.records if "left" in r.getMessage()]
    assert any("mlp" in m for m in refusals)
    for name, grad in theirs.items():
        assert torch.equal(mine[name], grad), name


class _GeluMlp(_ReluSquaredMlp):
    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class _SwiGluMlp(_ClampedGatedMlp):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("mlp", [_GeluMlp, _SwiGluMlp])
@pytest.mark.parametrize("zero", [False, True])
def test_a_standard_mlp_is_swapped_whatever_its_projection_starts_at(mlp, zero):
    torch.manual_seed(0)
    module = mlp()
    if not zero:
        for p in module.parameters():
            nn.init.normal_(p)
    assert LeanOps(OpsConfig(fuse=["mlp"])).apply(_Residual(module)) == {"mlp": "lean mlp"}


class _RMSNorm(nn.Module):
    """Llama's RMSNorm, by the names the rmsnorm chain matches."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)
        self.variance_epsilon = 1e-6

    def forward(self, x):
        rstd = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * (x.float() * rstd).to(x.dtype)


def test_a_gradient_penalty_through_memopts_lean_ops_equals_torchs():
    """The issue's repro through MemoryOptimizer: an R1 penalty on a model with batch norm, GELU
    and RMSNorm swapped for the lean ops gives plain torch's gradients (BN's second derivative
    was off by a quarter; RMSNorm's backward raised)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.BatchNorm1d(32), nn.GELU(), nn.Linear(32, 32), _RMSNorm(32),
        nn.Linear(32, 1),
    )  # fmt: skip
    x = torch.randn(64, 16)

    def grads(lean: bool) -> list[torch.Tensor | None]:
        net = copy.deepcopy(model)
        opt = MemoryOptimizer({"ops": {"fuse": ["batchnorm", "gelu", "rmsnorm"]}})
        if lean:
            opt.apply(net)
            actions = {opt.plan[f].lean for f in ("1", "2", "4")}
            assert actions == {"lean batchnorm", "lean gelu", "lean rmsnorm"}
        xi = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(net(xi).sum(), xi, create_graph=True)
        penalty = g.square().sum()
        grads = torch.autograd.grad(penalty, list(net.parameters()), allow_unused=True)
        if lean:
            opt.remove()
        return grads

    mine, theirs = grads(True), grads(False)
    scale = max(float(t.abs().max()) for t in theirs if t is not None)
    for a, b in zip(mine, theirs, strict=True):
        assert (a is None) == (b is None)
        if b is not None:  # the first bias's gradient is zero but for rounding (BN removes it)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * scale)


@pytest.mark.parametrize(
    "build, chain, swapped",
    [
        (_SwiGluMlp, "mlp", True),
        (_GeluMlp, "mlp", True),
        (_ReluSquaredMlp, "mlp", False),
        (_ClampedGatedMlp, "mlp", False),
        (lambda: nn.BatchNorm1d(16), "batchnorm", True),
        (lambda: _RMSNorm(16), "rmsnorm", True),
    ],
)
def test_a_meta_device_module_is_probed_by_its_shapes(build, chain, swapped):
    """A model on the meta device (materialized after sharding) is probed on a CPU twin: the
    same decisions as for real parameters."""
    with torch.device("meta"):
        model = _Residual(build())
    actions = LeanOps(OpsConfig(fuse=[chain])).apply(model)
    assert (actions.get("mlp") == f"lean {chain}") == swapped
