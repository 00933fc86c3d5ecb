"""Drift under torch.distributed: two CPU processes over gloo always end with the same bits."""

from __future__ import annotations

import copy
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fresh import start_processes
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from memopt_plugins import MemoryOptimizer

WORLD = 2
CONFIG = {"quantize": {"bits": 2, "modules": ["0"], "min_numel": 0}}


def _data(rank: int) -> torch.Tensor:
    """Rank 0: Gaussian inputs (2 bits drift a lot). Rank 1: integers 0..3, which 2-bit codes hold
    exactly, so its compressed gradient equals the exact one."""
    g = torch.Generator().manual_seed(rank)
    if rank == 0:
        return torch.randn(16, 256, generator=g)
    return torch.randint(0, 4, (16, 256), generator=g).float()


@contextmanager
def _group(rank: int, out: str) -> Iterator[None]:
    """A gloo group of WORLD processes through a file store (no port to race for)."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{Path(out) / 'store'}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=30),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _leave() -> None:
    """Leave without interpreter finalization, as a fork-started process does (``os._exit``): a
    spawned process that ran gloo aborted there about 1 run in 100, after its results were
    written and the group destroyed (atexit handlers had run; "terminate called without an
    active exception", no Python frame: a C++ thread torn down at exit, in torch, not memopt)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(worker: Callable[[int, str], None], tmp_path: Path) -> list[dict]:
    """Run ``worker(rank, out)`` on WORLD fresh processes (:mod:`fresh`); what each saved."""
    ctx = start_processes(worker, (str(tmp_path),), WORLD)
    deadline = time.monotonic() + 300  # a hung collective fails sooner: the 30 s group timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {WORLD}-process drift checks did not finish within 300 s")
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


def _worker(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
    x = _data(rank)

    # What this rank's data alone would decide.
    alone_model = copy.deepcopy(model)
    alone = MemoryOptimizer(CONFIG)
    alone.apply(alone_model)
    alone_report = alone.check_drift(lambda: alone_model(x).square().mean())

    with _group(rank, out):
        opt = MemoryOptimizer(CONFIG)
        opt.apply(model)  # before wrapping, as the integrations do
        ddp = DistributedDataParallel(model)
        report = opt.check_drift(lambda: ddp.module(x).square().mean())
        # A DDP step after the check: the reducer was not disturbed and replicas stay equal.
        sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ddp(x).square().mean().backward()
        sgd.step()
        torch.save(
            {
                "alone_drift": alone_report.round_max[0],  # before any escalation
                "alone_escalated": alone_report.escalated,
                "bits": opt.bits,
                "escalated": report.escalated,
                "per_module": report.per_module,
                "params": [p.detach().clone() for p in model.parameters()],
            },
            Path(out) / f"rank{rank}.pt",
        )
    _leave()


@pytest.mark.slow
def test_ranks_agree_on_an_escalation_only_one_rank_would_trigger(tmp_path):
    r0, r1 = _spawn(_worker, tmp_path)

    # alone, only rank 0 would escalate; rank 1's gradients are exact at 2 bits
    assert r0["alone_drift"] > 0.5 and r0["alone_escalated"]["0"][0] == 2
    assert r1["alone_drift"] == 0.0 and r1["alone_escalated"] == {}
    # together, both ranks take the max over ranks and escalate the same way
    assert r0["per_module"] == r1["per_module"] and r1["per_module"]["0"] <= 0.05
    assert r0["escalated"] == r1["escalated"] and r1["escalated"]["0"][0] == 2
    assert r0["bits"] == r1["bits"] and r1["bits"]["0"] >= 4
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"], strict=True))


# --------------------------------------------------------------------------- both ways, budget
LOWER = {
    "quantize": {"bits": 2, "modules": ["0"], "min_numel": 0},
    "drift": {"metric": "rel_l2", "lower": True, "lower_after": 1},
}
BUDGET = {
    "quantize": {"bits": 2, "modules": ["0", "1"], "min_numel": 0, "budget": 0.19},
    "drift": {"metric": "rel_l2"},
}


def _both_ways_worker(rank: int, out: str) -> None:
    """Lowering and the budget, each decided alone on this rank's data and then together."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
    x = _data(rank)

    def run(config: dict) -> tuple[dict, list]:
        m = copy.deepcopy(model)
        opt = MemoryOptimizer(config)
        opt.apply(m)
        m(x).square().mean().backward()  # a training forward, counted
        if config is LOWER:
            opt.set_bits("0", 16)  # as if a noisy moment had raised it
        reports = [opt.check_drift(lambda: m(x).square().mean()) for _ in range(3)]
        return opt.bits, [(r.lowered, r.escalated, r.budget) for r in reports]

    alone = {name: run(config) for name, config in (("lower", LOWER), ("budget", BUDGET))}
    with _group(rank, out):
        together = {name: run(config) for name, config in (("lower", LOWER), ("budget", BUDGET))}
        torch.save({"alone": alone, "together": together}, Path(out) / f"rank{rank}.pt")
    _leave()


@pytest.mark.slow
def test_ranks_agree_on_lowering_and_on_the_budget(tmp_path):
    """Alone, rank 1 (exact at 2 bits) would lower module 0 to 2 bits and spend the budget
    elsewhere than rank 0; together both take the max drift over ranks and decide the same."""
    r0, r1 = _spawn(_both_ways_worker, tmp_path)
    for name in ("lower", "budget"):
        assert r0["together"][name] == r1["together"][name], name
    # alone the ranks differ: rank 1 lowers to the floor, rank 0 cannot go as far
    assert r1["alone"]["lower"][0]["0"] == 2 and r0["alone"]["lower"][0]["0"] > 2
    assert r0["alone"]["lower"][0] != r1["alone"]["lower"][0]
    assert r0["together"]["lower"][0] == r0["alone"]["lower"][0]  # the max is rank 0's drift
    assert r0["alone"]["budget"][0] != r1["alone"]["budget"][0]
    target, kept = r0["together"]["budget"][1][-1][2]
    assert kept <= 1.05 * target or r0["together"]["budget"][0]["0"] > 2
