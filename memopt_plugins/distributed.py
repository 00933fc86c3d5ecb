"""torch.distributed defaults for what the integrations normally inject (a reduce over ranks).

Lightning passes its strategy's reduce, Accelerate its accelerator's; plain PyTorch gets these.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def distributed() -> bool:
    """True inside an initialized process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_rank_zero() -> bool:
    """True on rank 0, and without torch.distributed."""
    return not distributed() or dist.get_rank() == 0


def max_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """Element-wise max of ``values`` over all ranks (``values`` itself without
    torch.distributed); gloo reduces on the CPU."""
    if not distributed():
        return values
    if dist.get_backend() == "gloo":
        values = values.cpu()
    values = values.clone()
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values
