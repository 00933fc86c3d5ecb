"""Fresh processes for the tests, forked by a server that imported what they need once.

A spawned process imports torch, transformers and memopt again: seconds of CPU, paid by every
memory measurement and every 2-process run (dozens per run of the suite). Python's fork server
(one per test process, started at its first child) imports :data:`PRELOAD` once and forks each
child from that state. It never runs a tensor operation or starts a thread, so a child's heap
holds the imports only, as a spawned process's does once it has imported them: memory read in
it is a fresh process's (tests/memory.py says why that matters).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from multiprocessing.context import BaseContext

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessContext

#: What the fork server imports (a module that fails to import is skipped, and the child imports
#: it itself): torch, the libraries and models the tests build, memopt, and the tests' helpers.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "memopt_plugins",
    "lightning.pytorch",
    "zoo",
    "memory",
    "ranks",
    "frozen_imports",  # last
]


def context() -> BaseContext:
    """The multiprocessing context whose processes the fork server starts (its preload set)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_processes(fn: Callable[..., None], args: tuple, nprocs: int) -> ProcessContext:
    """``torch.multiprocessing.start_processes`` (not joined) on the fork server's processes."""
    context()
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")
