"""Gradient drift: compare compressed and exact gradients on a small batch, escalate bit widths.

One check runs the user's ``loss_fn`` exactly (compression suspended) and compressed, each pass
under the same forked RNG state (dropout draws the same masks, and the global stream is left where
it was), restores every buffer after each pass (BatchNorm running statistics) and the private
generators it is given (stochastic rounding), and takes gradients with
:func:`torch.autograd.grad`, so neither ``.grad``, the optimizer nor a DDP reducer sees anything.
The exact gradients are computed once; every round of escalation costs one more compressed pass.

What judges a module (the drift of which gradient):

* a module with parameters of its own (``recurse=False``: ``Linear``, norms, embeddings) — those
  parameters, all together, so a bias whose exact gradient is ~0 (the key bias of attention) cannot
  blow up the ratio on its own;
* a parameter-free module — the gradient of its inputs (every call), which is computed from what
  it saved and from the gradient flowing into it. DESIGN.md's first plan judged such modules by
  their parent's parameters; that counts the children's own compression error as the parent's (a
  2-bit ``down_proj`` pushed its whole MLP block, the activation and every enclosing container up
  the ladder with it), whereas a ``Linear``'s saved input only affects its own weight gradient,
  never the input gradient. A parameter-free module whose inputs need no gradient (a model root
  fed token ids) is judged by the gradient of its direct children's outputs, which its own ops
  consume (the logits a root feeds to its loss); with neither, by the parameters of its nearest
  ancestor that has any.

A module has no measurable drift, and is never escalated, when its own scope saved nothing that
compression touches (a ``ModuleList``, a decoder layer whose only ops are residual adds, a rotary
table computed without grad, a dropout whose mask is a bool tensor), or when the exact gradient
judging it is negligible: below :data:`NEGLIGIBLE` of the whole model's (parameter gradients for
parameter judges, recorded activation gradients for the others).

Drift by ``metric``: ``rel_l2`` = ‖g_q − g‖ / ‖g‖, ``cosine`` = 1 − cos(g_q, g). A gradient also
carries the compression error of the nonlinear modules downstream of it, so a module whose drift
is only inherited can climb a rung with the module it inherits from; each round escalates every
module over the threshold by one rung, and by default the check re-runs the compressed pass until
no module is over (or all are at 32). Cost: one exact and one compressed forward/backward on the
sample when nothing escalates, plus one compressed pass per extra round (from 2 bits on a
transformer: 2 -> 4 -> 8 and a settling round, i.e. 4 passes, once). ``max_rounds=1`` gives one
rung per call instead.

Under torch.distributed every rank measures its own sample, the drifts are max-reduced over ranks
(``all_reduce``) before any decision, so all ranks escalate the same modules and always run the
same bits; the check is then a collective, run by every rank at the same step. The INFO line of
an escalation is written by rank 0 only. Under ``DistributedDataParallel`` let ``loss_fn`` call
the wrapped module (``ddp.module``). Going through the wrapper also works (no gradient reaches its
reducer; checked with ``find_unused_parameters=True`` and an unused parameter too), but each of
its forwards broadcasts buffers and prepares the reducer for a backward that never comes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.hooks import RemovableHandle

from .config import DriftConfig
from .patching import forward_hook, forward_pre_hook

__all__ = [
    "HISTORY_LIMIT",
    "NEGLIGIBLE",
    "DriftMonitor",
    "DriftReport",
    "next_rung",
    "slice_batch",
]

log = logging.getLogger("memopt")

#: A judged gradient whose exact norm is below this fraction of the model's has no drift.
NEGLIGIBLE = 1e-6
#: Checks kept in the history (the oldest are dropped first).
HISTORY_LIMIT = 100
#: Bits at which a module is not compressed at all: the top of every ladder.
TOP_BITS = 32

# Reasons in DriftReport.unmeasured.
SAVES_NOTHING = "saves nothing compression touches"
NEGLIGIBLE_GRADIENT = "negligible exact gradient"
NOTHING_TO_JUDGE = "no gradient to judge it by"
CALLS_DIFFER = "ran differently in the exact and compressed passes"

_UNMEASURED = -1.0  # drift slot of a module without measurable drift (max over ranks ignores it)
_PARAMS, _TENSORS = "parameters", "tensors"


# --------------------------------------------------------------------------- batches


def slice_batch(batch: Any, n: int) -> Any:
    """The first ``n`` samples of ``batch``: tensors are cut along dim 0, containers rebuilt.

    Handles tensors, mappings (``dict``, ``BatchEncoding``), tuples (named ones too), lists and
    dataclasses, nested; anything else (ints, strings, ``None``, 0-dim tensors) is kept as it is.
    A batch of fewer than ``n`` samples is returned whole. Integrations take a ``slicer`` argument
    for batches this cannot cut.
    """
    if isinstance(batch, torch.Tensor):
        return batch[:n] if batch.dim() > 0 else batch
    if isinstance(batch, Mapping):
        items = {k: slice_batch(v, n) for k, v in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:
            return items
    if isinstance(batch, tuple):
        items = [slice_batch(v, n) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    if isinstance(batch, list):
        return [slice_batch(v, n) for v in batch]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            f.name: slice_batch(getattr(batch, f.name), n)
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **changes)
    return batch


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class DriftReport:
    """The outcome of one drift check.

    Attributes:
        step: the optimizer step the check ran at.
        per_module: ``{fqn: drift}`` of every compressed module with measurable drift, after the
            last round (the max over ranks under torch.distributed).
        unmeasured: ``{fqn: reason}`` of the compressed modules without measurable drift.
        escalated: ``{fqn: (old bits, new bits)}`` over all rounds of this check.
        round_max: the max drift of each round (one compressed pass each): the first is the drift
            training had before this check, the last the drift it has after it.
        threshold, metric: what the drifts were judged by.
    """

    step: int
    per_module: dict[str, float] = field(default_factory=dict)
    unmeasured: dict[str, str] = field(default_factory=dict)
    escalated: dict[str, tuple[int, int]] = field(default_factory=dict)
    round_max: tuple[float, ...] = ()
    threshold: float = 0.05
    metric: str = "rel_l2"

    @property
    def max(self) -> float:
        """The largest drift after the last round (0.0 when nothing was measurable)."""
        return max(self.per_module.values(), default=0.0)

    @property
    def rounds(self) -> int:
        """Compressed passes this check ran."""
        return len(self.round_max)

    def __str__(self) -> str:
        moved = ", ".join(f"{k or '<root>'} {a}->{b}" for k, (a, b) in self.escalated.items())
        return (
            f"DriftReport(step={self.step}, max={self.max:.4f} ({self.metric}, threshold "
            f"{self.threshold}), rounds={self.rounds}, escalated: {moved or 'none'})"
        )


def next_rung(ladder: Sequence[int], bits: int) -> int:
    """The first ladder rung above ``bits`` (32 when none is)."""
    return next((b for b in ladder if b > bits), TOP_BITS)


# --------------------------------------------------------------------------- one pass


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)


def _own(module: nn.Module, recurse: bool = False) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=recurse) if p.requires_grad]


class _Recorder:
    """Hooks for one forward pass of the check.

    Records the tensors whose gradients judge parameter-free modules (their inputs, and their
    direct children's outputs) and, when ``scopes`` is given, counts per scope the saved tensors
    compression would touch (floating, ``min_numel`` or more, not a parameter or buffer) — each
    attributed to the innermost scope, as the compression hooks do.
    """

    def __init__(
        self,
        modules: Mapping[str, nn.Module],
        param_free: Iterable[str],
        scopes: Sequence[str] = (),
        min_numel: int = 0,
    ):
        self.modules = modules
        self.param_free = sorted(param_free)
        self.scopes = list(scopes)
        self.min_numel = min_numel
        self.tensors: list[torch.Tensor] = []
        self.inputs: dict[str, list[int]] = {f: [] for f in self.param_free}
        self.outputs: dict[str, list[int]] = {f: [] for f in self.param_free}
        self.saved: dict[str, int] = dict.fromkeys(self.scopes, 0)
        self._index: dict[int, int] = {}
        self._handles: list[RemovableHandle] = []
        self._stack: list[saved_tensors_hooks] = []
        self._skip: frozenset[int] = frozenset()

    def layout(self) -> tuple:
        """Shapes of what was recorded per module: equal layouts line two passes up."""
        shape = [tuple(t.shape) for t in self.tensors]
        return tuple(
            (f, tuple(shape[i] for i in self.inputs[f]), tuple(shape[i] for i in self.outputs[f]))
            for f in self.param_free
        )

    def _add(self, into: list[int], value: Any) -> None:
        for t in _tensors(value):
            if t.requires_grad and t.is_floating_point():
                i = self._index.setdefault(id(t), len(self.tensors))
                if i == len(self.tensors):
                    self.tensors.append(t)
                into.append(i)

    def __enter__(self) -> _Recorder:
        root = self.modules[""]
        self._skip = frozenset(
            t.untyped_storage().data_ptr()
            for t in (*root.parameters(), *root.buffers())
            if t.numel() > 0
        )
        for fqn in self.param_free:
            module = self.modules[fqn]
            self._handles.append(forward_pre_hook(module, self._input_hook(fqn), with_kwargs=True))
            for child in module.children():
                self._handles.append(forward_hook(child, self._output_hook(fqn)))
        for fqn in self.scopes:
            module = self.modules[fqn]
            self._handles.append(forward_pre_hook(module, self._enter_hook(fqn)))
            self._handles.append(forward_hook(module, self._exit_hook, always_call=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        while self._stack:  # only after an exception inside a forward
            self._stack.pop().__exit__(None, None, None)

    def _input_hook(self, fqn: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._add(self.inputs[fqn], (args, kwargs))

        return hook

    def _output_hook(self, fqn: str) -> Callable:
        def hook(module: nn.Module, args: object, output: object) -> None:
            self._add(self.outputs[fqn], output)

        return hook

    def _enter_hook(self, fqn: str) -> Callable:
        def count(t: torch.Tensor) -> torch.Tensor:
            if (
                t.is_floating_point()
                and t.numel() >= self.min_numel
                and t.untyped_storage().data_ptr() not in self._skip
            ):
                self.saved[fqn] += 1
            return t

        def enter(module: nn.Module, args: object) -> None:
            scope = saved_tensors_hooks(count, _identity)
            scope.__enter__()
            self._stack.append(scope)

        return enter

    def _exit_hook(self, module: nn.Module, args: object, output: object) -> None:
        if self._stack:
            self._stack.pop().__exit__(None, None, None)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@contextmanager
def _preserved_state(
    model: nn.Module, generators: Sequence[torch.Generator]
) -> Iterator[Callable[[], AbstractContextManager]]:
    """Everything a pass may change is put back on exit: buffers, global RNG, ``generators``.

    Yields a factory of per-pass contexts: each pass starts from the same RNG states (global and
    ``generators``) and buffers, so dropout draws the same masks in every pass.
    """
    buffers = list(model.buffers())
    saved_buffers = [b.detach().clone() for b in buffers]
    saved_generators = [g.get_state() for g in generators]
    devices = {p.device for p in model.parameters()} | {b.device for b in buffers}
    accel = sorted({d.type for d in devices} - {"cpu", "meta"})
    device_type = accel[0] if accel else "cuda"
    indices = sorted({d.index or 0 for d in devices if d.type == device_type})

    def restore() -> None:
        with torch.no_grad():
            for b, saved in zip(buffers, saved_buffers, strict=True):
                b.copy_(saved)
        for g, state in zip(generators, saved_generators, strict=True):
            g.set_state(state)

    @contextmanager
    def one_pass() -> Iterator[None]:
        with torch.random.fork_rng(devices=indices, device_type=device_type), torch.enable_grad():
            try:
                yield
            finally:
                restore()

    try:
        yield one_pass
    finally:
        restore()


def _scalar_loss(loss_fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    loss = loss_fn()
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""
        raise TypeError(
            f"the drift check's loss_fn must return a scalar tensor; got {type(loss).__name__}"
            + shape
        )
    if not loss.requires_grad:
        raise ValueError(
            "the drift check's loss does not require grad: does loss_fn run the model "
            "under torch.no_grad() or with frozen parameters only?"
        )
    return loss


def _gradients(loss: torch.Tensor, targets: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if not targets:
        return []
    grads = torch.autograd.grad(loss, list(targets), allow_unused=True)
    pairs = zip(targets, grads, strict=True)
    return [torch.zeros_like(t) if g is None else g.detach() for t, g in pairs]


def _sq_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    if not grads:
        return torch.zeros(0, dtype=torch.float64)
    norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]
    return torch.stack(norms).cpu().square()


@dataclass(frozen=True)
class _Judge:
    """Which gradients judge a module: indices into a pass's target list."""

    kind: str  # _PARAMS or _TENSORS
    indices: tuple[int, ...]


# --------------------------------------------------------------------------- monitor


class DriftMonitor:
    """Runs drift checks, escalates bits along the ladder, keeps the step counter and history.

    The monitor does not know how compression works: it is given the compressed modules' bits, a
    way to change them, and a context that suspends compression (the exact pass).

    Args:
        config: the ``drift`` section of the config.
    """

    def __init__(self, config: DriftConfig):
        self.config = config
        self.steps = 0
        self.escalations = 0
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_LIMIT)
        self.last: DriftReport | None = None

    # ----------------------------------------------------------------- scheduling
    def should_check(self, step: int | None = None) -> bool:
        """True when a check is due at ``step`` (default: the counted optimizer steps).

        Checks run at step 0 and every ``check_every`` steps, when ``drift.enabled``.
        """
        step = self.steps if step is None else step
        return self.config.enabled and step % self.config.check_every == 0

    # ----------------------------------------------------------------- the check
    def check(
        self,
        model: nn.Module,
        loss_fn: Callable[[], torch.Tensor],
        bits: Mapping[str, int],
        *,
        set_bits: Callable[[str, int], None],
        suspend: Callable[[], AbstractContextManager],
        generators: Sequence[torch.Generator] = (),
        scopes: Sequence[str] | None = None,
        min_numel: int = 0,
        step: int | None = None,
        max_rounds: int | None = None,
    ) -> DriftReport:
        """Measure the drift of the modules in ``bits`` and escalate those over the threshold.

        Args:
            model: the patched model (the one ``loss_fn`` runs; see the module notes on DDP).
            loss_fn: ``loss_fn() -> scalar loss`` on a small batch; called once exact and once per
                round compressed.
            bits: ``{fqn: bits}`` of the compressed modules.
            set_bits: changes the bits of one module (takes effect at its next forward).
            suspend: a context in which nothing is compressed.
            generators: private generators the compressed pass draws from (stochastic rounding);
                restored after the check so that training is unaffected.
            scopes: every module with a compression scope (default: those in ``bits``), so that
                a tensor saved inside a 32-bit scope is not counted for a compressed ancestor.
            min_numel: saved tensors smaller than this are not compressed.
            step: the step recorded in the report (default: the counted optimizer steps).
            max_rounds: compressed passes at most; ``None`` re-checks until no module escalates,
                ``1`` escalates at most one rung per call.
        """
        cfg = self.config
        step = self.steps if step is None else step
        current = dict(bits)
        fqns = sorted(current)
        limit = len(cfg.ladder) + 1 if max_rounds is None else max(1, max_rounds)
        if not fqns:
            return self._record(DriftReport(step, threshold=cfg.threshold, metric=cfg.metric))

        modules = dict(model.named_modules())
        params = _own(model, recurse=True)
        param_free = [f for f in fqns if not _own(modules[f])]
        escalated: dict[str, tuple[int, int]] = {}
        round_max: list[float] = []
        with _preserved_state(model, generators) as one_pass:
            with one_pass(), suspend():
                rec = _Recorder(modules, param_free, fqns if scopes is None else scopes, min_numel)
                with rec:
                    loss = _scalar_loss(loss_fn)
                judges, unmeasured = self._judges(modules, fqns, params, rec)
                wanted = sorted(
                    {i for j in judges.values() if j.kind == _TENSORS for i in j.indices}
                )
                layout = rec.layout()
                exact = _gradients(loss, params + [rec.tensors[i] for i in wanted])
                del loss, rec
            position = {i: len(params) + k for k, i in enumerate(wanted)}
            judges = {
                f: j if j.kind == _PARAMS else _Judge(j.kind, tuple(position[i] for i in j.indices))
                for f, j in judges.items()
            }
            exact_sq = _sq_norms(exact)
            floors = {
                _PARAMS: NEGLIGIBLE * float(exact_sq[: len(params)].sum().sqrt()),
                _TENSORS: NEGLIGIBLE * float(exact_sq[len(params) :].sum().sqrt()),
            }
            while True:
                with one_pass():
                    rec = _Recorder(modules, param_free)
                    with rec:
                        loss = _scalar_loss(loss_fn)
                    aligned = rec.layout() == layout
                    tensors = [rec.tensors[i] for i in wanted] if aligned else []
                    approx = _gradients(loss, params + tensors)
                    del loss, rec, tensors
                local, missing = self._drifts(fqns, judges, floors, exact, exact_sq, approx)
                del approx
                drift = _max_over_ranks(local, params[0].device if params else None)
                per_module = {f: d for f, d in zip(fqns, drift, strict=True) if d >= 0}
                unmeasured_now = {**unmeasured, **missing}
                unmeasured_now = {f: r for f, r in unmeasured_now.items() if f not in per_module}
                round_max.append(max(per_module.values(), default=0.0))
                moved = self._escalate(per_module, current, set_bits, step)
                for fqn, (old, new) in moved.items():
                    escalated[fqn] = (escalated.get(fqn, (old, new))[0], new)
                if not moved or len(round_max) >= limit:
                    break
        report = DriftReport(
            step,
            per_module,
            unmeasured_now,
            escalated,
            tuple(round_max),
            threshold=cfg.threshold,
            metric=cfg.metric,
        )
        return self._record(report)

    @staticmethod
    def _judges(
        modules: Mapping[str, nn.Module],
        fqns: Sequence[str],
        params: Sequence[nn.Parameter],
        rec: _Recorder,
    ) -> tuple[dict[str, _Judge], dict[str, str]]:
        """What judges each module (see the module docstring), from the exact pass's record."""
        index = {id(p): i for i, p in enumerate(params)}
        judges: dict[str, _Judge] = {}
        unmeasured: dict[str, str] = {}
        for fqn in fqns:
            if rec.saved.get(fqn, 0) == 0:
                unmeasured[fqn] = SAVES_NOTHING
                continue
            own = _own(modules[fqn])
            tensors = rec.inputs.get(fqn) or rec.outputs.get(fqn)
            if own:
                judges[fqn] = _Judge(_PARAMS, tuple(index[id(p)] for p in own))
            elif tensors:
                judges[fqn] = _Judge(_TENSORS, tuple(dict.fromkeys(tensors)))
            else:
                name = fqn
                while name and not own:
                    name = name.rpartition(".")[0]
                    own = _own(modules[name], recurse=True)
                if own:
                    judges[fqn] = _Judge(_PARAMS, tuple(index[id(p)] for p in own))
                else:
                    unmeasured[fqn] = NOTHING_TO_JUDGE
        return judges, unmeasured

    def _drifts(
        self,
        fqns: Sequence[str],
        judges: Mapping[str, _Judge],
        floors: Mapping[str, float],
        exact: Sequence[torch.Tensor],
        exact_sq: torch.Tensor,
        approx: Sequence[torch.Tensor],
    ) -> tuple[list[float], dict[str, str]]:
        """Per-module drift (``_UNMEASURED`` where there is none) and why some have none."""
        n = len(approx)  # recorded tensors are missing when the passes ran differently
        diff_sq = _sq_norms([q - g for q, g in zip(approx, exact[:n], strict=True)])
        approx_sq = _sq_norms(approx)
        dots = [(q.double() * g.double()).sum() for q, g in zip(approx, exact[:n], strict=True)]
        dot = torch.stack(dots).cpu() if dots else torch.zeros(0, dtype=torch.float64)
        drift = [_UNMEASURED] * len(fqns)
        missing: dict[str, str] = {}
        for i, fqn in enumerate(fqns):
            judge = judges.get(fqn)
            if judge is None:
                continue
            idx = list(judge.indices)
            if any(k >= n for k in idx):
                missing[fqn] = CALLS_DIFFER
                continue
            norm = float(exact_sq[idx].sum().sqrt())
            if norm <= floors[judge.kind] or norm == 0.0:
                missing[fqn] = NEGLIGIBLE_GRADIENT
                continue
            if self.config.metric == "cosine":
                denom = norm * float(approx_sq[idx].sum().sqrt())
                drift[i] = 1.0 - float(dot[idx].sum()) / denom if denom > 0 else 1.0
            else:
                drift[i] = float(diff_sq[idx].sum().sqrt()) / norm
        return drift, missing

    def _escalate(
        self,
        per_module: Mapping[str, float],
        current: dict[str, int],
        set_bits: Callable[[str, int], None],
        step: int,
    ) -> dict[str, tuple[int, int]]:
        cfg = self.config
        moved: dict[str, tuple[int, int]] = {}
        for fqn, drift in per_module.items():
            old = current[fqn]
            if drift <= cfg.threshold or old >= TOP_BITS:
                continue
            new = next_rung(cfg.ladder, old)
            set_bits(fqn, new)
            current[fqn] = new
            moved[fqn] = (old, new)
            self.escalations += 1
            if _is_rank_zero():
                log.info(
                    "memopt: %s drift %.4f > threshold %.4f (%s) at step %d: bits %d -> %d",
                    fqn or "<root>",
                    drift,
                    cfg.threshold,
                    cfg.metric,
                    step,
                    old,
                    new,
                )
        return moved

    def _record(self, report: DriftReport) -> DriftReport:
        self.last = report
        self.history.append(
            {
                "step": report.step,
                "max": report.max,
                "round_max": list(report.round_max),
                "escalated": {k: list(v) for k, v in report.escalated.items()},
            }
        )
        return report

    # ----------------------------------------------------------------- metrics and state
    def metrics(self) -> dict[str, float]:
        """``memopt/drift/max``, ``memopt/drift/<fqn>`` (last check) and ``memopt/escalations``."""
        out: dict[str, float] = {"memopt/escalations": float(self.escalations)}
        if self.last is not None:
            out["memopt/drift/max"] = self.last.max
            for fqn, drift in self.last.per_module.items():
                out[f"memopt/drift/{fqn or '<root>'}"] = drift
        return out

    def state_dict(self) -> dict[str, Any]:
        """Step counter, escalation count, history and the last report (plain Python types)."""
        last = self.last
        return {
            "steps": self.steps,
            "escalations": self.escalations,
            "history": [dict(h) for h in self.history],
            "last": None
            if last is None
            else {
                "step": last.step,
                "per_module": dict(last.per_module),
                "unmeasured": dict(last.unmeasured),
                "escalated": {k: list(v) for k, v in last.escalated.items()},
                "round_max": list(last.round_max),
                "threshold": last.threshold,
                "metric": last.metric,
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.steps = int(state.get("steps", 0))
        self.escalations = int(state.get("escalations", 0))
        self.history = deque((dict(h) for h in state.get("history", ())), maxlen=HISTORY_LIMIT)
        last = state.get("last")
        self.last = (
            None
            if last is None
            else DriftReport(
                int(last["step"]),
                {k: float(v) for k, v in last["per_module"].items()},
                dict(last.get("unmeasured", {})),
                {k: (int(a), int(b)) for k, (a, b) in last.get("escalated", {}).items()},
                tuple(float(v) for v in last.get("round_max", ())),
                threshold=float(last.get("threshold", self.config.threshold)),
                metric=str(last.get("metric", self.config.metric)),
            )
        )


# --------------------------------------------------------------------------- distributed


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _is_rank_zero() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _max_over_ranks(values: list[float], device: torch.device | None) -> list[float]:
    """Element-wise max over all ranks (identity without torch.distributed)."""
    if not _distributed() or not values:
        return values
    if dist.get_backend() == "gloo" or device is None:
        device = torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()
