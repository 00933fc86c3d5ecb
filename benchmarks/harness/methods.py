"""The methods compared: PyTorch's own memory tools and memopt's, each a patch on a fresh model.

PyTorch:

* ``checkpoint every block`` -- ``torch.utils.checkpoint`` (non-reentrant, RNG preserved) around
  every block of the model: keeps only the blocks' inputs, replays each block in backward.
* ``PyTorch SAC (save matmuls)`` -- selective activation checkpointing through
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` around every block: outputs of
  matmuls, convolutions and fused attention are saved, everything else is recomputed (the policy
  torchtitan applies to transformers).
* ``save_on_cpu`` -- ``torch.autograd.graph.save_on_cpu`` around the forward: every saved tensor
  goes to host memory (pinned on CUDA) and comes back in backward. On a CPU run the tensor is
  already in host memory and ``tensor.cpu()`` returns it as it is, so it frees nothing there; it
  is listed for the CUDA tables.

memopt (``memopt_plugins.MemoryOptimizer``): ``int8``/``int4``/``int2`` (every saved activation at
that width, drift check off), ``int4 + drift`` (``configs/int4_drift.yaml``), the recompute
planner at budgets 0.5 and 0.3 (``recompute.auto``, planned on the measurement batch before the
first step), and the workload's combined preset (``configs/gpt_int4_auto.yaml`` for the
transformers, ``configs/convnet.yaml`` for the CNN).

Compiled (:data:`COMPILED_METHODS`, the transformers only, benched by ``compiled.py``): the whole
model under ``model.compile()`` (inductor) -- the compiled baseline; memopt ``int8``, ``int4`` and
the planner at 0.5, applied before compiling (the model root's scope, entered outside the graph,
holds the traceable saved-tensor hooks that AOTAutograd inlines: the graph compresses what it
saves); torch.compile's own knob, ``torch._functorch.config.activation_memory_budget`` at 0.5
and 0.3, set while each model's graphs are compiled (:func:`inductor`); and the two together,
memopt int8 on the graph partitioned at 0.3 (the hooks act on what the partitioner still saves).
"""

from __future__ import annotations

import functools
import re
import statistics
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from memopt_plugins import MemoryOptimizer, plan_recompute
from memopt_plugins.tree import slice_batch

from .workloads import CONFIGS

PYTORCH, MEMOPT = "PyTorch", "memopt"

_aten = torch.ops.aten
#: Ops whose outputs PyTorch SAC keeps: the matmuls, convolutions and fused attention kernels.
SAC_SAVED_OPS = [
    getattr(_aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(_aten, name)
]


@dataclass
class Patched:
    """A model with one method applied: how to run its loss, and what the method holds.

    Attributes:
        model: the patched model.
        optimizer: the memopt optimizer applied to it (``None`` for PyTorch's tools).
        context: entered around every forward (``save_on_cpu``); a no-op for the others.
        detail: what the method chose, for the tables (recomputed modules, bits).
        plan: the modules a recompute planner chose (``None`` without a planner).
        drift_checks: drift checks run so far by :meth:`after_backward`.
        drift_sample: samples of the batch the drift check runs on (``drift.sample_size``).
        backend: the compiled methods' :func:`inductor` backend (its graph count), else ``None``.
    """

    model: nn.Module
    optimizer: MemoryOptimizer | None = None
    context: Callable[[], AbstractContextManager[Any]] = nullcontext
    detail: str = "-"
    plan: list[str] | None = None
    drift_checks: int = 0
    drift_sample: int = 8
    backend: Any = None

    @property
    def batchnorm_frozen(self) -> bool:
        """Whether memopt's BatchNorm running mode has frozen the statistics (warm-up over)."""
        opt = self.optimizer
        if opt is None or opt.config.batchnorm.mode != "running":
            return False
        return opt.internal.steps >= opt.config.batchnorm.warmup_steps

    @property
    def stats(self):
        """The compression hooks' ``SavedStats`` (packed bytes held), or ``None``."""
        return self.optimizer.internal.compression.stats if self.optimizer is not None else None

    def loss(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any) -> torch.Tensor:
        """The training loss of ``batch`` with the method active."""
        with self.context():
            return loss_fn(self.model, batch)

    def after_backward(
        self, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any, step: int
    ) -> None:
        """Between backward and ``optimizer.step()``: the drift check when one is due."""
        if self.optimizer is None:
            return
        sample = slice_batch(batch, self.drift_sample)
        report = self.optimizer.check_drift(
            lambda: loss_fn(self.model, sample), step=step, if_due=True
        )
        self.drift_checks += report is not None

    def after_step(self) -> None:
        """After ``optimizer.step()``: count the step (drift schedule, BatchNorm warm-up)."""
        if self.optimizer is not None:
            self.optimizer.count_step()

    def mean_bits(self) -> float | None:
        """The compressed modules' mean bits now (``None`` without compression)."""
        if self.optimizer is None or not self.optimizer.bits:
            return None
        return statistics.fmean(self.optimizer.bits.values())

    def training_summary(self) -> str:
        """Drift checks, escalations and the bits at the end (modules per width), for a table."""
        if self.optimizer is None or not self.optimizer.bits:
            return "-"
        bits = Counter(self.optimizer.bits.values())
        spread = ", ".join(f"{n} at {b} bits" for b, n in sorted(bits.items()))
        escalations = self.optimizer.state_dict()["drift"]["escalations"]
        if not self.drift_checks:
            return spread
        checks = f"{self.drift_checks} drift check{'' if self.drift_checks == 1 else 's'}"
        return f"{checks}, {escalations} escalated; {spread}"


@dataclass(frozen=True)
class Method:
    """One way of training a model, applied to a fresh copy by :meth:`apply`.

    ``patch(model, workload, batch, steady, adopt)`` returns the :class:`Patched` model;
    ``batch`` is what a planner measures, ``steady`` asks for the method's steady state (past
    any warm-up), ``adopt`` is a recompute plan (fqns) to take instead of planning.
    ``exact``: gradients equal the baseline's by construction (up to float rounding).
    ``applies``: ``applies(workload) -> bool``, the workloads the method has a meaning on
    (``None``: every one).
    """

    name: str
    family: str
    patch: Callable[[nn.Module, Any, Any, bool, list[str] | None], Patched]
    exact: bool = False
    applies: Callable[[Any], bool] | None = None

    def applies_to(self, workload: Any) -> bool:
        """Whether the method has a meaning on ``workload`` (see the class docstring)."""
        return self.applies is None or self.applies(workload)

    def apply(
        self,
        model: nn.Module,
        workload: Any,
        batch: Any,
        steady: bool,
        adopt: list[str] | None = None,
    ) -> Patched:
        """Patch ``model`` (a fresh copy) for ``workload``; see the class docstring."""
        return self.patch(model, workload, batch, steady, adopt)


def summarize(fqns: Iterable[str]) -> str:
    """``blocks.0.mlp, blocks.1.mlp`` -> ``blocks.*.mlp x2`` (numbers in fqns become ``*``)."""
    counts = Counter(re.sub(r"(?<=\.)\d+(?=\.|$)", "*", f) for f in fqns)
    return ", ".join(f"{k} x{n}" if n > 1 else k for k, n in counts.items()) or "-"


def checkpoint_blocks(
    model: nn.Module, block_class: str, context_fn: Callable[[], Any] | None = None
) -> list[str]:
    """Run every module of class ``block_class`` under ``torch.utils.checkpoint``.

    Non-reentrant, RNG state preserved (PyTorch's defaults for ``use_reentrant=False``);
    ``context_fn`` selects SAC. Returns the wrapped fqns; the model is meant to be thrown away
    after (the wrapper is an instance attribute ``forward``).
    """
    blocks = [(f, m) for f, m in model.named_modules() if type(m).__name__ == block_class]
    if not blocks:
        raise ValueError(f"no module of class {block_class!r} in {type(model).__name__}")
    extra = {} if context_fn is None else {"context_fn": context_fn}
    for _, module in blocks:
        module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False, **extra)
    return [f for f, _ in blocks]


def unpatched(
    model: nn.Module, workload: Any, batch: Any, steady: bool, adopt: list[str] | None
) -> Patched:
    return Patched(model)


def checkpoint_every(
    model: nn.Module, workload: Any, batch: Any, steady: bool, adopt: list[str] | None
) -> Patched:
    return Patched(model, detail=summarize(checkpoint_blocks(model, workload.block_class)))


def _sac(
    model: nn.Module, workload: Any, batch: Any, steady: bool, adopt: list[str] | None
) -> Patched:
    policy = functools.partial(create_selective_checkpoint_contexts, SAC_SAVED_OPS)
    blocks = checkpoint_blocks(model, workload.block_class, context_fn=policy)
    return Patched(model, detail=f"{summarize(blocks)}; saves mm/conv/attention outputs")


def _save_on_cpu(
    model: nn.Module, workload: Any, batch: Any, steady: bool, adopt: list[str] | None
) -> Patched:
    device = next(model.parameters()).device
    pin = device.type == "cuda"
    detail = "saved tensors to pinned host memory" if pin else "no-op on CPU (already in host)"
    return Patched(model, context=functools.partial(save_on_cpu, pin_memory=pin), detail=detail)


def memopt(config: Any, name: str) -> Callable[..., Patched]:
    """A patch applying ``MemoryOptimizer(config)``; ``config`` may be a callable of the workload.

    A ``recompute.auto`` planner plans on the given batch before the first step (or adopts a
    given plan; with neither, it plans on the first step, as a user's would); in the steady
    state the step counter is advanced past ``batchnorm.warmup_steps`` (running-statistics mode).
    """

    def patch(
        model: nn.Module, workload: Any, batch: Any, steady: bool, adopt: list[str] | None
    ) -> Patched:
        source = config(workload) if callable(config) else config
        opt = MemoryOptimizer(source)
        planned = opt.config.recompute.auto is not None
        if planned and adopt is not None:
            opt.load_state_dict({"recompute": adopt})
        opt.apply(model)
        details = [Path(source).name] if isinstance(source, Path) else []
        plan = None
        if planned and (adopt is not None or batch is not None):
            if adopt is None:
                plan_recompute(opt, lambda: workload.loss_fn(model, batch))
            plan = list(opt.state_dict().get("recompute", []))
            details.append(f"recomputes {summarize(plan)}")
        if opt.bits:
            widths = sorted({b for b in opt.bits.values()})
            details.append("/".join(map(str, widths)) + " bits")
        if opt.config.batchnorm.mode != "batch":
            details.append(f"BN {opt.config.batchnorm.mode}")
            if steady:
                for _ in range(opt.config.batchnorm.warmup_steps):
                    opt.count_step()
        if opt.config.dropout.mode != "keep":
            details.append(f"dropout {opt.config.dropout.mode}")
        return Patched(
            model,
            optimizer=opt,
            detail="; ".join(details) or name,
            plan=plan,
            drift_sample=opt.config.drift.sample_size,
        )

    return patch


def _bits(bits: int) -> dict[str, Any]:
    return {"quantize": {"bits": bits, "modules": ["*"]}, "drift": {"enabled": False}}


def _drift(metric: str) -> dict[str, Any]:
    """4 bits, drift-checked under ``metric`` (the settings of ``configs/int4_drift.yaml``)."""
    return {
        "quantize": {"bits": 4, "modules": ["*"]},
        "drift": {"metric": metric, "threshold": 0.05, "check_every": 25, "sample_size": 8},
    }


def _budget(budget: float) -> dict[str, Any]:
    return {"recompute": {"auto": {"budget": budget}}}


BASELINE = "baseline"
CHECKPOINT = "checkpoint every block"
INT8, INT4, INT2 = "memopt int8", "memopt int4", "memopt int2"
INT4_DRIFT = "memopt int4 + drift"
#: The drift issue's comparison: the bits each metric settles at, and the loss trained there.
DRIFT_REL_L2, DRIFT_NOISE = "memopt int4 + drift rel_l2", "memopt int4 + drift noise"
PLANNER_05 = "memopt planner 0.5"
#: The methods whose final loss the benchmark issue bounds (within 1% of the baseline's).
LOSS_BARS = (INT8, INT4_DRIFT, DRIFT_NOISE)

METHODS: list[Method] = [
    Method(BASELINE, PYTORCH, unpatched, exact=True),
    Method(CHECKPOINT, PYTORCH, checkpoint_every, exact=True),
    Method("PyTorch SAC (save matmuls)", PYTORCH, _sac, exact=True),
    Method("save_on_cpu", PYTORCH, _save_on_cpu, exact=True),
    Method(INT8, MEMOPT, memopt(_bits(8), "int8")),
    Method(INT4, MEMOPT, memopt(_bits(4), "int4")),
    Method(INT2, MEMOPT, memopt(_bits(2), "int2")),
    Method(INT4_DRIFT, MEMOPT, memopt(CONFIGS / "int4_drift.yaml", "int4 + drift")),
    Method(DRIFT_REL_L2, MEMOPT, memopt(_drift("rel_l2"), "int4 + drift rel_l2")),
    Method(DRIFT_NOISE, MEMOPT, memopt(_drift("noise"), "int4 + drift noise")),
    Method(PLANNER_05, MEMOPT, memopt(_budget(0.5), "planner 0.5"), exact=True),
    Method("memopt planner 0.3", MEMOPT, memopt(_budget(0.3), "planner 0.3"), exact=True),
    Method("memopt combined preset", MEMOPT, memopt(lambda w: w.preset, "preset")),
]


def method_names() -> list[str]:
    """Names of every method, in table order."""
    return [m.name for m in METHODS]


# --------------------------------------------------------------------------- compiled
def inductor(budget: float | None = None) -> Callable[..., Any]:
    """A backend for ``model.compile(backend=...)``: inductor, partitioned at ``budget``.

    ``budget`` is ``torch._functorch.config.activation_memory_budget`` while the graph is
    compiled (``None``: the config as it is, 1.0 by default), so it holds for this model's graphs
    whatever the config says elsewhere. Every call makes a new backend: dynamo never hands one
    model's compiled graph to another compiled with a different backend (its backend-match
    guard), so two copies of the same model compiled at different budgets keep their own graphs.
    ``backend.graphs`` counts the graphs it compiled.
    """

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        backend.graphs += 1
        if budget is None:
            return compile_fx(gm, example_inputs)
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return compile_fx(gm, example_inputs)

    backend.graphs = 0
    return backend


def whole_compiled(
    patch: Callable[..., Patched],
    budget: float | None = None,
    what: str | None = None,
    dynamic: bool | None = None,
) -> Callable[..., Patched]:
    """``patch`` (memopt applied, its planner planned, eagerly), then ``model.compile()``.

    Whole-model compile through :func:`inductor` at ``budget`` (``dynamic``: torch.compile's);
    ``Patched.backend`` keeps the backend (its graph count). ``what`` replaces the inner patch's
    detail.
    """

    def apply(
        model: nn.Module, workload: Any, batch: Any, steady: bool, adopt: list[str] | None
    ) -> Patched:
        patched = patch(model, workload, batch, steady, adopt)
        patched.backend = inductor(budget)
        model.compile(backend=patched.backend, dynamic=dynamic)
        inner = what if what is not None else patched.detail
        patched.detail = "model.compile()" + ("" if inner in ("-", "") else f"; {inner}")
        return patched

    return apply


def under_autocast(method: Method, device_type: str) -> Method:
    """``method`` with every forward under bf16 autocast on ``device_type`` (its context)."""

    def patch(
        model: nn.Module, workload: Any, batch: Any, steady: bool, adopt: list[str] | None
    ) -> Patched:
        patched = method.apply(model, workload, batch, steady, adopt)
        patched.context = functools.partial(torch.autocast, device_type, dtype=torch.bfloat16)
        return patched

    return replace(method, patch=patch)


def _resolved(config: dict[str, Any]) -> Callable[[Any], dict[str, Any]]:
    """``config`` on a workload, drift off; ``"ops": "lean"`` becomes the workload's ``lean``."""

    def on(workload: Any) -> dict[str, Any]:
        resolved = {**config, "drift": {"enabled": False}}
        if resolved.get("ops") == "lean":
            resolved["ops"] = workload.lean
        return resolved

    return on


def declared(
    name: str,
    config: dict[str, Any] | None = None,
    *,
    checkpointed: bool = False,
    bf16: bool = False,
    compiled: bool = False,
    budget: float | None = None,
) -> Method:
    """A method declared by what it sets: memopt's ``config``, drift off (``"ops": "lean"``: the
    workload's ``lean`` section; the method is left out on a workload whose ``lean`` is None),
    or PyTorch's checkpoint around every block; the forward under bf16 autocast (CPU); the
    whole model under ``model.compile`` (inductor, ``dynamic=False``) at
    ``activation_memory_budget`` ``budget`` (None: torch's). A planner plans on the first step
    (no batch is given), as a user's would. For the studies that read one step of a fresh
    model (``fits.py``, ``compile_time.py``, ``nanogpt_fits.py``)."""
    if config is None:
        patch, family = (checkpoint_every if checkpointed else unpatched), PYTORCH
    else:
        patch, family = memopt(_resolved(config), name), MEMOPT
    if compiled:
        patch = whole_compiled(patch, budget, dynamic=False)
    lean = config is not None and config.get("ops") == "lean"
    made = Method(name, family, patch, applies=(lambda m: m.lean is not None) if lean else None)
    return under_autocast(made, "cpu") if bf16 else made


def _eager(
    model: nn.Module, workload: Any, batch: Any, steady: bool, adopt: list[str] | None
) -> Patched:
    return Patched(model, detail="not compiled")


C_BASELINE = "compiled baseline"
C_INT8, C_INT4 = "compiled memopt int8", "compiled memopt int4"
C_PLANNER_05 = "compiled memopt planner 0.5"
C_BUDGET_05 = "compiled activation_memory_budget 0.5"
C_BUDGET_03 = "compiled activation_memory_budget 0.3"
#: memopt's compression on top of torch.compile's knob: the partitioner recomputes what is cheap
#: to recompute, and memopt compresses what it still saves.
C_INT8_BUDGET_03 = "compiled memopt int8 + activation_memory_budget 0.3"
#: The eager baseline again, timed round-robin with the compiled methods: the compile speed-up.
C_EAGER = "eager baseline (for scale)"
#: The workloads that get compiled rows (the CNN is left out to bound the bench's time).
COMPILED_WORKLOADS = ("gpt", "hf-gpt2")

#: Whole-model ``torch.compile`` (inductor): memopt applied before compiling, and torch.compile's
#: own memory knob as peers; every ratio is to the compiled baseline (the first). The last, not
#: compiled, puts the eager baseline on the same clock.
COMPILED_METHODS: list[Method] = [
    Method(C_BASELINE, PYTORCH, whole_compiled(unpatched), exact=True),
    Method(C_INT8, MEMOPT, whole_compiled(memopt(_bits(8), "int8"))),
    Method(C_INT4, MEMOPT, whole_compiled(memopt(_bits(4), "int4"))),
    Method(C_PLANNER_05, MEMOPT, whole_compiled(memopt(_budget(0.5), "planner 0.5")), exact=True),
    # Not exact, though recompute: the budget's partitioner may recompute dropout in backward
    # with fresh random numbers (pytorch/pytorch#190758), which the gradient error shows.
    Method(C_BUDGET_05, PYTORCH, whole_compiled(unpatched, 0.5, "activation_memory_budget 0.5")),
    Method(C_BUDGET_03, PYTORCH, whole_compiled(unpatched, 0.3, "activation_memory_budget 0.3")),
    Method(
        C_INT8_BUDGET_03,
        MEMOPT,
        whole_compiled(memopt(_bits(8), "int8"), 0.3, "8 bits; activation_memory_budget 0.3"),
    ),
    Method(C_EAGER, PYTORCH, _eager),  # eager's own dropout masks: no gradient comparison
]
