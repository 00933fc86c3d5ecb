"""Helpers shared by the FSDP2 tests: sharding as torchtitan does, a short training loop, and one
2-process gloo run (:mod:`fresh`) per test module whose workers run every case and hand their
results to the tests."""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fresh import start_processes
from torch import nn
from torch.distributed.fsdp import fully_shard

WORLD = 2
TIMEOUT = timedelta(seconds=120)  # a hung collective fails the run in minutes, not hours

Cases = Callable[[Path], dict[str, Callable[[int], object]]]


def shard(model: nn.Module, blocks: list[nn.Module] | None = None, **kwargs) -> nn.Module:
    """``fully_shard`` every block (default: a Hugging Face model's transformer blocks), then the
    root, as torchtitan does."""
    if blocks is None:
        gpt2 = hasattr(model, "transformer")
        blocks = list(model.transformer.h if gpt2 else model.model.layers)
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def train(model, loss_fn, batch, steps=3, opt=None, check=None, seed=1):
    """``steps`` SGD steps; the losses. ``check(step)`` runs after each backward."""
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(seed)
    losses = []
    for step in range(steps):
        loss = loss_fn(model, batch)
        loss.backward()
        if check is not None:
            check(step)
        sgd.step()
        sgd.zero_grad()
        if opt is not None:
            opt.count_step()
        losses.append(loss.item())
    return losses


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def tokens(rank: int, n: int = 8) -> torch.Tensor:
    """A rank's own batch of ``n`` sequences of 32 tokens (vocabulary 512)."""
    return torch.randint(0, 512, (n, 32), generator=torch.Generator().manual_seed(rank))


def _worker(rank: int, out: str, cases: Cases) -> None:
    torch.set_num_threads(1)
    # What a launcher sets: Lightning then takes the processes as created for it. The group
    # meets in a file (no port to race for); Lightning finds it initialized and uses it.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",  # read by Lightning's environment, never bound
        WORLD_SIZE=str(WORLD),
        NODE_RANK="0",
        LOCAL_RANK=str(rank),
        RANK=str(rank),
    )
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD, timeout=TIMEOUT
    )
    gc.freeze()  # the meter's gc.collect() would walk every object of the imports (0.6 s a call)
    results: dict = {}
    try:
        for name, run in cases(Path(out)).items():
            start = time.monotonic()
            results[name] = run(rank)
            results[name + " seconds"] = time.monotonic() - start
    finally:
        torch.save(results, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()
    # Leave without interpreter finalization, as tests/test_drift_ddp.py explains (a gloo
    # teardown abort at exit, after the results are written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_two_ranks(cases: Cases, out: Path, seconds: int = 300) -> list[dict]:
    """One 2-process gloo run (:mod:`fresh`) of ``cases(out)`` (name -> ``run(rank)``, a
    module-level function so that the processes can import it); each rank's results by name."""
    ctx = start_processes(_worker, (str(out), cases), WORLD)
    deadline = time.monotonic() + seconds
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the 2-process run did not finish within {seconds} s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
