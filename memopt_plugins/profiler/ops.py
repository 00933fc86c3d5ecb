"""The ``ops`` entries (memory-lean ops, :mod:`memopt_plugins.lean`) that act where a profiled
step's memory peaks: ``memopt profile`` prints them under its summary.

A chain is suggested when one of the modules it would replace sits in the parent of the module
the peak sits in (or around it); ``loss: chunked`` when the peak sits in the loss (the head, or the
loss computed after the model) of a Hugging Face causal LM. Each comes with the bytes its modules
saved for backward in the profiled step, largest first.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..lean.patch import _WHAT, _any, _has_head, _lean_forward, _outermost
from .report import LOSS_ROW, ProfileReport
from .units import human_bytes

#: Autograd nodes of a loss: a peak in their backward is the loss's.
_LOSS_NODES = ("NllLoss", "LogSoftmax", "CrossEntropy")


@dataclass(frozen=True)
class OpsEntry:
    """One suggested ``ops`` entry: ``fuse: [chain]`` or ``loss: chunked``."""

    key: str  # "fuse" or "loss"
    value: str  # the chain, or "chunked"
    modules: tuple[str, ...]  # the modules it replaces
    saved: int  # what they saved for backward in the profiled step

    def __str__(self) -> str:
        entry = f"ops: {{fuse: [{self.value}]}}" if self.key == "fuse" else "ops: {loss: chunked}"
        return (
            f"{entry}  # {len(self.modules)} module(s), {human_bytes(self.saved)} saved for "
            "backward in this step"
        )


def _near(fqn: str, peak: str) -> bool:
    """``fqn`` is in the module around the peak's (its parent: the backward of a Linear peaks
    while the GELU before it still holds its input), or around that one."""
    region = peak.rpartition(".")[0]
    return (
        not region or fqn == region or fqn.startswith(f"{region}.") or region.startswith(f"{fqn}.")
    )


def _acted_on(model: nn.Module, chain: str) -> tuple[str, ...]:
    """The modules ``ops.fuse: [chain]`` would replace (attention: those of an eager model)."""
    if chain == "attention":
        if not _any(model, chain):
            return ()
        return tuple(f for f, m in model.named_modules() if type(m).__name__.endswith("Attention"))
    return tuple(f for f, m in model.named_modules() if _lean_forward(chain, m) is not None)


def suggest_ops(model: nn.Module, report: ProfileReport) -> list[OpsEntry]:
    """The ``ops`` entries acting where ``report``'s step peaks on ``model``, largest first."""
    site = report.step.timeline.site
    saved = {row.fqn: row.saved for row in report.modules}
    found: list[OpsEntry] = []
    if site.module:  # none, or the root: the peak is in no module a chain would replace
        for chain in _WHAT:
            modules = _acted_on(model, chain)
            if any(_near(f, site.module) for f in modules):
                total = sum(saved.get(f, 0) for f in modules)
                found.append(OpsEntry("fuse", chain, modules, total))
    in_loss = site.module in (None, LOSS_ROW) or any(n in (site.node or "") for n in _LOSS_NODES)
    heads = [(f, m) for f, m in _outermost(model, _has_head) if _has_head(m)]
    if heads and (in_loss or any(site.module == f"{f}.lm_head".lstrip(".") for f, _ in heads)):
        modules = tuple(f"{f}.lm_head".lstrip(".") for f, _ in heads)
        # the head's, and what the model saved itself (its loss) or loss_fn after it
        own = {row.fqn: row.self_saved for row in report.modules}
        loss = sum(saved.get(f, 0) for f in modules) + sum(own.get(f, 0) for f, _ in heads)
        loss += saved.get(LOSS_ROW, 0)
        found.append(OpsEntry("loss", "chunked", modules, loss))
    return sorted(found, key=lambda e: -e.saved)
