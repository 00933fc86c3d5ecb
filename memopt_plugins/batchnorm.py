"""Running-statistics BatchNorm mode: training-mode BN as a fixed per-channel affine map.

``batchnorm.mode: running``: :class:`BatchNormPatch` lets a model train with batch statistics for
``warmup_steps`` optimizer steps, then makes every BatchNorm layer in training normalize with its
running statistics, exactly as in eval mode, through
:func:`~memopt_plugins.batchnorm_ops.running_batch_norm` (no BN-specific tensor kept when a ReLU
follows, only BN's input otherwise). The patch collects which layers ran fused and, on
accelerators, reads the op's escape check at the next forward rather than with a sync per layer.

The running statistics are frozen in this mode: updating them while normalizing with them forms a
feedback loop the gradient does not see, which diverged in training (benchmarks/batchnorm.md).
Frozen statistics are what ``freeze_bn_stats`` and ``FrozenBatchNorm2d`` use too, make training and
eval normalize identically, and leave a recompute nothing to update twice. A layer without running
statistics (``track_running_stats=False``) keeps batch statistics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .batchnorm_ops import BatchNormObserver, running_batch_norm, stray_message
from .patching import InstanceForward, forward_pre_hook

log = logging.getLogger("memopt")


class BatchNormPatch(BatchNormObserver):
    """Makes the BatchNorm layers of a model normalize with running statistics after warmup.

    Args:
        warmup_steps: optimizer steps with ordinary (batch-statistics) BatchNorm first.
        steps: returns the optimizer steps counted so far (read at every forward).
    """

    def __init__(self, warmup_steps: int, steps: Callable[[], int]) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0; got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self.steps = steps
        self._patched: dict[str, nn.Module] = {}
        self._previous: dict[str, Any] = {}  # fqn -> instance ``forward`` before the patch
        self._handles: list[RemovableHandle] = []
        self._pending: list[tuple[str, torch.Tensor]] = []
        self.fused_layers: set[str] = set()  # BN layers that ran fused in the latest forward

    @property
    def active(self) -> bool:
        """Whether running statistics are used now (warmup is over)."""
        return self.steps() >= self.warmup_steps

    @property
    def patched(self) -> list[str]:
        """Fqns of the BatchNorm layers this patch handles."""
        return list(self._patched)

    def apply(self, model: nn.Module) -> None:
        """Patch every BatchNorm with running statistics in ``model`` (instance ``forward``)."""
        for fqn, module in model.named_modules():
            if not isinstance(module, nn.modules.batchnorm._BatchNorm):
                continue
            if module.running_mean is None or module.running_var is None:
                continue
            if isinstance(module, nn.modules.lazy.LazyModuleMixin):
                if module.has_uninitialized_params():
                    continue
            self._previous[fqn] = module.__dict__.get("forward")
            module.forward = self._forward_of(module, fqn)
            self._patched[fqn] = module
        self._handles.append(forward_pre_hook(model, self._next_forward))
        if not self._patched:
            log.warning(
                "memopt: batchnorm.mode is running but the model has no BatchNorm layer with "
                "running statistics; nothing changes"
            )
            return
        log.info(
            "memopt: %d BatchNorm layers normalize with running statistics %s",
            len(self._patched),
            f"after {self.warmup_steps} steps" if self.warmup_steps else "from the first step",
        )
        if self.warmup_steps == 0:
            fresh = [fqn for fqn, m in self._patched.items() if _at_initial_values(m)]
            if fresh:
                log.warning(
                    "memopt: batchnorm.mode is running with warmup_steps 0, but %d of %d "
                    "BatchNorm layers (e.g. %r) still have their initial running statistics "
                    "(mean 0, variance 1): training will normalize with those. Set "
                    "batchnorm.warmup_steps, or load trained statistics first.",
                    len(fresh),
                    len(self._patched),
                    fresh[0],
                )

    def remove(self) -> None:
        """Restore every patched layer's ``forward``."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for fqn, module in self._patched.items():
            previous = self._previous[fqn]
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self._patched.clear()
        self._previous.clear()
        self._check_pending()

    def _forward_of(self, module: nn.modules.batchnorm._BatchNorm, fqn: str) -> Callable:
        return _RunningForward(self, module, fqn)

    def fused(self, name: str) -> None:
        self.fused_layers.add(name)

    def stray(self, name: str, value: torch.Tensor) -> None:
        if value.device.type == "cpu":
            super().stray(name, value)  # raise at once
        else:
            self._pending.append((name, value))  # read at the next forward: no sync per layer

    def _next_forward(self, module: nn.Module, args: object) -> None:
        self._check_pending()
        self.fused_layers = set()

    def _check_pending(self) -> None:
        pending, self._pending = self._pending, []
        if pending and bool(torch.stack([s.to(pending[0][1].device) for _, s in pending]).any()):
            name = next(n for n, s in pending if float(s) != 0)
            raise RuntimeError(stray_message(name))


def _at_initial_values(module: nn.modules.batchnorm._BatchNorm) -> bool:
    with torch.no_grad():
        return bool((module.running_mean == 0).all() and (module.running_var == 1).all())


class _RunningForward(InstanceForward):
    """The ``forward`` of a patched BatchNorm layer: running statistics while the patch is active
    and the layer trains, its own ``forward`` otherwise (a copy of the model gets that one)."""

    def __init__(self, patch: BatchNormPatch, module: nn.modules.batchnorm._BatchNorm, fqn: str):
        self.patch = patch
        self.module = module
        self.fqn = fqn
        self.previous = module.__dict__.get("forward")

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        bn = self.module
        if not (bn.training and self.patch.active):
            if self.previous is not None:
                return self.previous(input)
            return type(bn).forward(bn, input)
        bn._check_input_dim(input)
        return running_batch_norm(input, bn, name=self.fqn, observer=self.patch)
