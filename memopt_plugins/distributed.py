"""torch.distributed defaults for what the integrations normally inject (a reduce over ranks).

Lightning passes its strategy's reduce, Accelerate its accelerator's; plain PyTorch gets these.
The drift check's shares of sharded gradients (:func:`rank_share`, :func:`sum_over_ranks`) always
go through torch.distributed, which FSDP2 runs on.
"""

from __future__ import annotations

import os
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def distributed() -> bool:
    """True inside an initialized process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_rank_zero() -> bool:
    """True on rank 0, and without torch.distributed."""
    return not distributed() or dist.get_rank() == 0


def process_rank() -> int:
    """This process's rank: the process group's, else the launcher's ``RANK`` (torchrun,
    Lightning and Accelerate set it before the group exists), else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def from_rank_zero(value: T) -> T:
    """Rank 0's ``value`` on every rank (``value`` itself without torch.distributed): what one
    rank decided from its own batch, so that all ranks run the same. Every rank must call it."""
    if not distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_reduce(values: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
    if not distributed():
        return values
    if dist.get_backend() == "gloo":
        values = values.cpu()
    values = values.clone()
    dist.all_reduce(values, op=op)
    return values


def max_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """Element-wise max of ``values`` over all ranks (``values`` itself without
    torch.distributed); gloo reduces on the CPU."""
    return _all_reduce(values, dist.ReduceOp.MAX)


def sum_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """Element-wise sum of ``values`` over all ranks (``values`` itself without
    torch.distributed); gloo reduces on the CPU."""
    return _all_reduce(values, dist.ReduceOp.SUM)


def rank_share(n: int) -> slice:
    """This rank's share of ``n`` elements: the ranks' shares split ``range(n)`` into consecutive
    pieces, the first ``n % world_size`` one element longer (``tensor_split``'s cut); all of it
    without torch.distributed."""
    if not distributed():
        return slice(0, n)
    world, rank = dist.get_world_size(), dist.get_rank()
    size, extra = divmod(n, world)
    start = rank * size + min(rank, extra)
    return slice(start, start + size + (rank < extra))
