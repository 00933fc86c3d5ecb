"""Ranks agree on everything memopt decides (docs/distributed.md): two gloo processes that
see different shapes end with the same recompute plan, compressed set and bits, and round with
noise of their own, although memopt was applied before the process group existed."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fresh import start_processes
from torch.nn.parallel import DistributedDataParallel
from zoo import hf_gpt2

from memopt_plugins import MemoryOptimizer

WORLD = 2
CONFIG = {
    "recompute": {"auto": {"budget": 0.2}},
    "quantize": {"bits": 8, "min_numel": 64},
    "drift": {"check_every": 1},
}
SEQ = {0: 16, 1: 128}  # attention's share of the saved bytes grows with the sequence


def _worker(rank: int, out: str) -> None:
    """Three DDP steps with a drift check at each. memopt is applied first, with no process
    group and no launcher's ``RANK`` (as a script that builds its model before
    ``init_process_group``)."""
    torch.set_num_threads(1)
    os.environ.pop("RANK", None)
    model, _, loss_fn = hf_gpt2(batch_size=4, seq=128, dim=64, layers=2)
    batch = torch.randint(0, 512, (4, SEQ[rank]), generator=torch.Generator().manual_seed(rank))
    opt = MemoryOptimizer(CONFIG)
    opt.apply(model)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out}/store",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    ddp = DistributedDataParallel(model)
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(3):
        loss_fn(ddp, batch).backward()
        opt.check_drift(lambda: loss_fn(model, batch[:2]), step=step, if_due=True)
        sgd.step()
        sgd.zero_grad()
        opt.count_step()
    generator = opt.internal.compression.noise(torch.device("cpu"))
    result = {
        "recomputed": opt.plan.recomputed,
        "bits": opt.bits,
        "checks": len(opt.state_dict()["drift"]["history"]),
        "noise": torch.randint(2**62, (4,), generator=generator).tolist(),
    }
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/test_drift_ddp.py explains: no gloo teardown at interpreter exit


def test_ranks_with_different_shapes_agree_on_plan_and_bits(tmp_path):
    ctx = start_processes(_worker, (str(tmp_path),), WORLD)
    deadline = time.monotonic() + 300
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the 2-process run did not finish within 300 s")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD))
    assert r0["recomputed"] and r0["recomputed"] == r1["recomputed"]
    assert r0["bits"] == r1["bits"] and len(r0["bits"]) > 0
    assert r0["checks"] == r1["checks"] == 3
    assert r0["noise"] != r1["noise"]  # each rank rounds with its own noise
