"""The whole model compiled, at 2 and 4 bits with the default rounding (stochastic): the gradient
errs no more than 1.2x what eager memopt's does at the same bits (issue 30's bar).

Inside a graph the noise is hashed from a seed drawn on the host at every run of the graph, so
one compiled model gives a fresh draw per step without recompiling; the error is averaged over a
few batches, each a fresh draw, in both modes, so the bar compares the codecs and not one draw.
"""

from __future__ import annotations

import pytest
import torch
from memory import rel_error
from zoo import hf_gpt2

from memopt_plugins import MemoryOptimizer
from memopt_plugins.config import MemOptConfig

pytestmark = pytest.mark.usefixtures("one_thread")

BATCHES = 4


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (8, 128), generator=generator) for _ in range(BATCHES)]


def _grads(model, loss_fn, batch, run=None) -> dict[str, torch.Tensor]:
    """The gradients of ``model``'s parameters after one step of ``run`` (default: ``model``)."""
    model.zero_grad(set_to_none=True)
    loss_fn(model if run is None else run, batch).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _mean_error(bits: int, compiled: bool) -> float:
    """Mean over the batches of the gradient's relative error at ``bits`` (default rounding)
    against the unpatched model's, eager or the whole model under ``torch.compile``."""
    torch._dynamo.reset()  # a fresh model's hooks would count against the recompile limit
    # One block: the bar is the codec's, and inductor generating the stochastic codec's kernels
    # for each block is most of the test's time (2 blocks: ~290 s a test on 2 cores, 1: ~210 s).
    model, _, loss_fn = hf_gpt2(layers=1)
    exact = [_grads(model, loss_fn, batch) for batch in _batches()]
    opt = MemoryOptimizer({"quantize": {"bits": bits}, "drift": {"enabled": False}})
    opt.apply(model)
    run = torch.compile(model) if compiled else model
    errors = [
        rel_error(_grads(model, loss_fn, batch, run), want)
        for batch, want in zip(_batches(), exact, strict=True)
    ]
    if compiled:
        # every batch ran inside the graphs: nothing reached the eager hooks
        assert (
            opt.internal.compression.stats.forward_tensors == 0
            and opt.internal.compression.stats.compiled
        )
    opt.remove()
    torch._dynamo.reset()
    return sum(errors) / len(errors)


@pytest.mark.parametrize("bits", [4, 2])
def test_compiled_stochastic_rounding_errs_within_1_2x_of_eager(bits):
    """Measured (mean of 4 batches, one block): int4 15.28% compiled against 14.99% eager
    (1.019x), int2 273.6% against 249.5% (1.096x); with two blocks 1.001x and 1.044x."""
    assert MemOptConfig().quantize.rounding == "stochastic"  # the default this bar is about
    eager = _mean_error(bits, compiled=False)
    compiled = _mean_error(bits, compiled=True)
    assert compiled <= 1.2 * eager, (bits, compiled, eager)
