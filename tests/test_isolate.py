"""measure.isolated: a pass leaves every RNG stream, buffer, .grad, mode and optimizer as it was."""

import random

import numpy as np
import pytest
import torch
from torch import nn

from memopt_plugins.measure.isolate import accelerator_devices, isolated


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3))


def _draws(generator: torch.Generator) -> dict[str, object]:
    """The next values of every stream a pass may draw from."""
    return {
        "torch": torch.rand(4).tolist(),
        "numpy": np.random.rand(4).tolist(),
        "python": [random.random() for _ in range(4)],
        "generator": torch.rand(4, generator=generator).tolist(),
    }


def _seed(generator: torch.Generator) -> None:
    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    generator.manual_seed(1)


def test_rng_streams_continue_as_without_the_pass():
    model = _model()
    g = torch.Generator()
    _seed(g)
    without = _draws(g)
    _seed(g)
    with isolated(model, generators=[g]):
        inside = _draws(g)  # the pass draws from every stream
        model(torch.randn(5, 6))  # and dropout from torch's
    after = _draws(g)
    assert inside == without  # the pass started where training was
    for stream in without:
        assert after[stream] == without[stream], stream  # and training continues from there
    _seed(g)
    _draws(g)
    assert _draws(g) != without  # a stream advances when nothing restores it


def test_each_pass_starts_from_the_same_state():
    model = _model()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 6)
    with isolated(model, generators=[g]) as isolation:
        outs = []
        for _ in range(2):
            with isolation.one_pass():
                outs.append((model(x), _draws(g), model[1].running_mean.clone()))
    (y1, d1, m1), (y2, d2, m2) = outs
    assert torch.equal(y1, y2)  # the same dropout mask and the same batch statistics
    assert d1 == d2
    assert torch.equal(m1, m2)


def test_buffers_restored_in_place():
    model = _model()
    bn = model[1]
    before = {name: (b, b.clone()) for name, b in model.named_buffers()}
    with isolated(model):
        model(torch.randn(5, 6) * 3 + 2)
        assert not torch.equal(bn.running_mean, before["1.running_mean"][1])
        assert int(bn.num_batches_tracked) == 1
    for name, b in model.named_buffers():
        tensor, value = before[name]
        assert b is tensor  # the tensors training holds
        assert torch.equal(b, value), name


def test_grads_kept_and_a_backward_in_the_pass_never_adds_to_them():
    model = _model()
    model(torch.randn(5, 6)).sum().backward()
    grads = {name: (p.grad, p.grad.clone()) for name, p in model.named_parameters()}
    with isolated(model, clear_grads=True):
        assert all(p.grad is None for p in model.parameters())
        model(torch.randn(5, 6)).sum().backward()
    for name, p in model.named_parameters():
        grad, value = grads[name]
        assert p.grad is grad
        assert torch.equal(p.grad, value), name


def test_grads_put_back_when_the_pass_replaced_them():
    model = _model()
    model(torch.randn(5, 6)).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    with isolated(model):
        assert all(p.grad is grads[n] for n, p in model.named_parameters())  # left in place
        model.zero_grad(set_to_none=True)
    assert all(p.grad is grads[n] for n, p in model.named_parameters())


def test_modes_restored_module_by_module():
    model = _model()
    model[1].eval()  # a mixed model: the pass must not make it all-train or all-eval
    modes = [m.training for m in model.modules()]
    with isolated(model):
        model.eval()
    assert [m.training for m in model.modules()] == modes
    with isolated(model):
        model.train()
    assert [m.training for m in model.modules()] == modes


def test_optimizer_step_undone():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 6)).sum().backward()
    opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    with isolated(model, opt, clear_grads=True):
        model(torch.randn(5, 6)).sum().backward()
        opt.step()
        assert not torch.equal(model[0].weight, params[0])
    for p, value in zip(model.parameters(), params, strict=True):
        assert torch.equal(p, value)
    after = opt.state[model[0].weight]
    assert int(after["step"]) == 1
    for k, v in state.items():
        assert torch.equal(after[k], v), k


def test_accelerator_devices(monkeypatch):
    model = _model()
    assert accelerator_devices(model) == {}  # a CPU model on an uninitialized accelerator
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is initialized in this process")
    assert accelerator_devices(model, [torch.device("cuda", 1)]) == {"cuda": [1]}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert accelerator_devices(model) == {"cuda": [0, 1]}  # any device may draw noise


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stream_continues_as_without_the_pass():
    model = _model().cuda()
    torch.cuda.manual_seed_all(1)
    without = torch.rand(4, device="cuda")
    torch.cuda.manual_seed_all(1)
    with isolated(model):
        model(torch.randn(5, 6, device="cuda"))  # dropout draws on the device
        torch.rand(4, device="cuda")
    assert torch.equal(torch.rand(4, device="cuda"), without)
