"""The memory of a whole training run, read as its user reads it: a fresh process's peak above
its idle memory.

:func:`training_peak` runs a few optimizer steps of a model at a batch size -- the model built,
the config applied, the optimizer's state made, a drift check on every step where the config
checks at all -- in a process of its own, and reads the most it held above what it held before
the model was built. On the CPU that is the resident set, with glibc told to return freed
memory at once (:mod:`.meter`), against the kernel's high-water mark; on CUDA the allocator's
``memory_allocated`` / ``max_memory_allocated``. Everything the run holds is counted: the model,
its gradients, the optimizer's state, the batch, the activations, the drift check's passes, and
what a first call pages in.

Each reading is a new interpreter: it imports the factory's module, reads its idle memory, then
builds and trains.
"""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch import nn

from ..config import MemOptConfig
from ..engine import MemoryOptimizer
from ..logs import quiet
from ..measure.process import current_bytes, peak_bytes, reset_peak
from ..tree import map_tensors
from .meter import _glibc, _release_free_heap

#: The optimizers whose state a plan counts: Adam(W) keeps two fp32 tensors per parameter, SGD
#: with momentum one, plain SGD none.
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}

#: Optimizer steps a reading runs: the first makes the optimizer's state, the later ones hold it
#: beside the activations and the drift check, as every later step of training does.
STEPS = 4

Factory = Callable[[], tuple[nn.Module, Any, Callable[[nn.Module, Any], torch.Tensor]]]


def resize_batch(batch: Any, n: int) -> Any:
    """``batch`` with ``n`` samples: its tensors repeated along dim 0 and cut to ``n``."""

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        times = math.ceil(n / t.shape[0])
        return t.repeat(times, *([1] * (t.dim() - 1)))[:n] if times > 1 else t[:n]

    return map_tensors(resize, batch)


@dataclass(frozen=True)
class Training:
    """A training run to read: how to get the model's factory, and how it trains.

    ``loader`` is picklable (a module-level function or a ``functools.partial`` of one) and
    returns the factory, which takes no arguments and returns ``(model, batch, loss_fn)``.
    """

    loader: Callable[[], Factory]
    optimizer: str | None = "adamw"
    device: str | None = None
    steps: int = STEPS


def train_here(factory: Factory, training: Training, config: dict | None, size: int) -> int:
    """In this process, which must have built nothing yet: the most bytes held above its idle
    memory while the factory's model trains ``training.steps`` steps at ``size`` samples under
    ``config`` (``None``: without memopt), a drift check on every step where it checks at all."""
    device = torch.device(training.device or "cpu")
    gc.collect()
    if device.type == "cpu":
        _glibc()
        _release_free_heap()
    idle = current_bytes(device)
    reset_peak(device)
    model, batch, loss_fn = factory()
    batch = resize_batch(batch, size)
    if training.device is not None:
        model.to(device)
        batch = map_tensors(lambda t: t.to(device), batch)
    memopt = None
    if config is not None:
        checked = MemOptConfig.from_dict(config).with_changes(drift={"check_every": 1})
        memopt = MemoryOptimizer(checked)
        with quiet():
            memopt.apply(model)
    name = training.optimizer
    optimizer = OPTIMIZERS[name](model.parameters()) if name else None
    for step in range(training.steps):
        loss_fn(model, batch).backward()
        if memopt is not None:
            with quiet():
                memopt.check_drift(loss_fn, batch=batch, step=step, if_due=True)
        if optimizer is not None:
            optimizer.step()
        model.zero_grad(set_to_none=True)
        if memopt is not None:
            memopt.count_step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return peak_bytes(device) - idle


def _read(read_fd: int, write_fd: int) -> None:
    """A reading's process: receives the request, imports the factory's module, trains."""
    with Connection(read_fd, writable=False) as conn_in:
        training, config, size, threads = conn_in.recv()
    with Connection(write_fd, readable=False) as conn_out:
        torch.set_num_threads(threads)
        try:
            conn_out.send(train_here(training.loader(), training, config, size))
        except Exception as err:  # the caller raises it: a reading that failed has no figure
            conn_out.send(f"training at batch {size} failed: {type(err).__name__}: {err}")


def training_peak(training: Training, config: MemOptConfig | None, size: int) -> int:
    """The whole training's peak above idle at ``size`` samples under ``config``
    (:func:`train_here`), read in a new interpreter started with this one's ``sys.path``.

    Spawned, not forked: a forked process finds the code its parent had paged in unmapped and
    counts it again as it runs; and not a ``multiprocessing`` spawn, which would import the
    caller's main script again.
    """
    to_child, from_child = os.pipe(), os.pipe()
    code = f"from {__name__} import _read; _read({to_child[0]}, {from_child[1]})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", code], pass_fds=(to_child[0], from_child[1]), env=env
    )
    os.close(to_child[0])
    os.close(from_child[1])
    request = (training, None if config is None else config.to_dict(), size)
    with Connection(to_child[1], readable=False) as send:
        send.send((*request, torch.get_num_threads()))
    with Connection(from_child[0], writable=False) as receive:
        try:
            answer = receive.recv()
        except EOFError:
            answer = f"the process reading the training at batch {size} died"
    child.wait()
    if isinstance(answer, str):
        raise RuntimeError(answer)
    return answer
