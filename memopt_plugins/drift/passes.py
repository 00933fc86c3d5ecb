"""One pass of the drift check: what it records, and everything it must leave as it was."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from ..distributed import distributed, rank_share, sum_over_ranks
from ..measure.isolate import isolated
from ..measure.scopes import ScopeTracker, Watch
from ..measure.storage import ModelStorages, RunningParameters, is_sharded, local_part
from ..policy import compressible, in_foreign_region, min_numel_at
from ..tree import batch_size_of, map_tensors, tensors_in


def own_parameters(module: nn.Module, recurse: bool = False) -> list[nn.Parameter]:
    """The parameters of ``module`` that train (its own only, unless ``recurse``)."""
    return [p for p in module.parameters(recurse=recurse) if p.requires_grad]


class CheckedParameters:
    """The model's trainable parameters, numbered once before the check's passes.

    A pass differentiates what its modules ran with: the parameters themselves, or for a sharded
    one (a DTensor, FSDP2) the unsharded tensor FSDP swapped in for the forward (:meth:`targets`).
    Which parameter a module owns is read here, before the first pass, while the modules hold the
    registered parameters (FSDP puts the sharded ones back after each backward); during and after a
    pass they may hold the unsharded ones.

    Attributes:
        params: the trainable parameters (``model.parameters()``, shared ones once).
        sharded: indices of the sharded ones: of their gradients each rank keeps its share only
            (:func:`gradients`), and their norms are summed over ranks (:func:`summed_over_shards`).
    """

    def __init__(self, model: nn.Module):
        self.params = own_parameters(model, recurse=True)
        index = {id(p): i for i, p in enumerate(self.params)}
        self._owned: dict[str, tuple[int, ...]] = {}
        self._slots: dict[int, list[tuple[str, str]]] = {}
        for fqn, module in model.named_modules():
            owned = []
            for name, p in module.named_parameters(recurse=False):
                if p.requires_grad:
                    owned.append(index[id(p)])
                    self._slots.setdefault(index[id(p)], []).append((fqn, name))
            self._owned[fqn] = tuple(owned)
        self.sharded = tuple(i for i, p in enumerate(self.params) if is_sharded(p))

    def own(self, fqn: str) -> tuple[int, ...]:
        """Indices of the parameters module ``fqn`` owns itself."""
        return self._owned[fqn]

    def subtree(self, fqn: str) -> tuple[int, ...]:
        """Indices of the parameters of module ``fqn`` and every module inside it."""
        prefix = f"{fqn}." if fqn else ""
        inside = (own for f, own in self._owned.items() if f == fqn or f.startswith(prefix))
        return tuple(dict.fromkeys(i for own in inside for i in own))

    def targets(self, running: RunningParameters) -> list[torch.Tensor]:
        """What a pass ran with, per parameter: the unsharded tensor of a sharded parameter when
        its module ran (the parameter itself otherwise)."""
        out = list(self.params)
        for i in self.sharded:
            leaves = (running.leaf(fqn, name) for fqn, name in self._slots[i])
            out[i] = next((t for t in leaves if t is not None), out[i])
        return out


class PassRecorder:
    """What one forward pass of the check records, through the model's scope tracker.

    Records the tensors whose gradients judge parameter-free modules (their inputs, and their
    direct children's outputs), the parameters a sharded model's modules ran with (``running``),
    and, when ``scopes`` is given, counts per scope the saved tensors compression would touch
    (:func:`memopt_plugins.policy.compressible`) -- each attributed to the innermost scope, as the
    compression hooks do. Which are too small is decided when :attr:`saved` is read, by
    ``min_numel`` and :attr:`sample` (set once the pass has found it:
    :func:`~memopt_plugins.policy.min_numel_at`), so the count is training's.
    """

    def __init__(
        self,
        model: nn.Module,
        param_free: Sequence[str],
        scopes: Sequence[str] = (),
        min_numel: int = 0,
    ):
        self.model = model
        self.param_free = sorted(param_free)
        self.scopes = list(scopes)
        self.min_numel = min_numel
        self.tensors: list[torch.Tensor] = []
        self.inputs: dict[str, list[int]] = {f: [] for f in self.param_free}
        self.outputs: dict[str, list[int]] = {f: [] for f in self.param_free}
        self.sample: tuple[int, int] | None = None  # (samples, training batch)
        self._saves: dict[str, list[torch.Size]] = {f: [] for f in self.scopes}  # their shapes
        self.finished: dict[str, int] = {}  # watched module -> when its forward last ended
        self._ended = 0
        self._index: dict[int, int] = {}
        self._stack: list[saved_tensors_hooks | None] = []
        self._depth = 0  # the thread's entered scopes when the pass began
        self._watch: Watch | None = None
        self._storages: ModelStorages | None = None
        self.running = RunningParameters(model)
        self._scope_set = set(self.scopes)

    @property
    def saved(self) -> dict[str, int]:
        """Per scope, the saved tensors compression touches in training."""
        return {
            f: sum(s.numel() >= min_numel_at(s, self.min_numel, self.sample) for s in saves)
            for f, saves in self._saves.items()
        }

    def layout(self) -> tuple:
        """Shapes of what was recorded per module: equal layouts line two passes up."""
        shape = [tuple(t.shape) for t in self.tensors]
        return tuple(
            (f, tuple(shape[i] for i in self.inputs[f]), tuple(shape[i] for i in self.outputs[f]))
            for f in self.param_free
        )

    def _add(self, into: list[int], value: Any) -> None:
        for t in tensors_in(value):
            if t.requires_grad and t.is_floating_point():
                i = self._index.setdefault(id(t), len(self.tensors))
                if i == len(self.tensors):
                    self.tensors.append(t)
                into.append(i)

    def __enter__(self) -> PassRecorder:
        self._storages = ModelStorages(self.model)
        modules = dict(self.model.named_modules())
        children = [
            f"{fqn}.{name}" if fqn else name
            for fqn in self.param_free
            for name, _ in modules[fqn].named_children()
        ]
        watched = [*self.param_free, *(c for c in children if c in modules), *self.scopes]
        self._watch = ScopeTracker.of(self.model).watch(self, watched)
        self.running.sync()
        self._depth = ScopeTracker.depth()
        return self

    def __exit__(self, *exc: object) -> None:
        # An interrupt in the pass's forward (a KeyboardInterrupt, for which torch leaves no
        # scope) left the scopes it was in, its own and compression's: left first, innermost first.
        ScopeTracker.leave_from(self._depth)
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        self.running.remove()  # its leaves stay readable, for the pass's gradients

    def enter(self, fqn: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if fqn in self.inputs:
            self._add(self.inputs[fqn], (args, kwargs))
        if fqn in self._scope_set:
            scope = None  # inside a checkpoint's region its hooks stay innermost, as compression's
            if not in_foreign_region():
                scope = saved_tensors_hooks(self._counter(fqn), _identity)
                scope.__enter__()
            self._stack.append(scope)

    def exit(self, fqn: str, module: nn.Module, args: tuple, output: Any) -> None:
        if fqn in self._scope_set and self._stack:
            scope = self._stack.pop()
            if scope is not None:
                scope.__exit__(None, None, None)
        self._ended += 1
        self.finished[fqn] = self._ended
        parent = fqn.rpartition(".")[0]
        if fqn and parent in self.outputs:
            self._add(self.outputs[parent], output)

    def _counter(self, fqn: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def count(t: torch.Tensor) -> torch.Tensor:
            if compressible(t, 0, (self._storages, self.running)):
                self._saves[fqn].append(local_part(t).shape)  # a DTensor: its shard is coded
            return t

        return count


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class _EveryCall:
    """A context that hooks every module of ``self.model`` while entered: ``_enter`` before each
    call (given its kwargs where :attr:`KWARGS`, first among the pre-hooks) and ``_exit`` after
    it, also when it raised; subclasses count the calls in progress in ``_depth``."""

    KWARGS = False
    model: nn.Module

    def __enter__(self):
        self._handles: list[Any] = []
        for module in self.model.modules():
            self._handles.append(
                module.register_forward_pre_hook(
                    self._enter, with_kwargs=self.KWARGS, prepend=self.KWARGS
                )
            )
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class SampleInputs(_EveryCall):
    """The check's sample, read where the model is called from outside every module: how many
    samples it holds (:attr:`samples`: dim 0 of the first such call's first tensor of one
    dimension or more), and, with ``part`` (a slice of them), each such call run on that part:
    its tensors with the samples along dim 0 cut to it. Run on the two halves of the sample, a
    loss that is a mean over samples gives each half's mean gradient whatever the model returns
    (a loss computed inside it, no logits)."""

    KWARGS = True  # the call's tensors are cut before any other pre-hook sees them

    def __init__(self, model: nn.Module, part: slice | None = None):
        self.model = model
        self.part = part
        self.samples = 0
        self._depth = 0  # module calls in progress

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        self._depth += 1
        if self._depth > 1:
            return None
        self.samples = self.samples or batch_size_of((args, kwargs)) or 0
        n, part = self.samples, self.part
        if part is None or not n:
            return None

        def cut(t: torch.Tensor) -> torch.Tensor:
            return t[part] if t.dim() > 0 and t.shape[0] == n else t

        return map_tensors(cut, args), map_tensors(cut, kwargs)

    def _exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._depth -= 1


class SignedHalves(_EveryCall):
    """Weights the two halves of the sample +1 and -1 in one pass's backward, for the sampling
    variance of the gradient (``drift.metric`` ``sgd`` and ``noise``).

    The gradient flowing into the model's output (its first floating tensor with a batch
    dimension of 2 or more, dim 0) is multiplied, row by row, by ``n / (2 |A|)`` in the first
    half A of the ``n`` samples and ``-n / (2 |B|)`` in the second half B. The model's output is
    that of the outermost module call that ends last: the model itself, or, where its own forward
    never runs (a LightningModule whose ``training_step`` calls ``self.model``), the last of its
    submodules called from outside every other. When the loss is a mean over the samples and the
    model handles them independently, every gradient of that pass is
    then ``(g_A - g_B) / 2``, half the difference of the two halves' mean gradients, whose squared
    norm times :attr:`scale` estimates the variance of the whole sample's mean gradient:
    ``E|g_A - g_B|^2 = tr(Σ) (1/|A| + 1/|B|)`` and ``Var(g) = tr(Σ) / n`` for per-sample gradient
    covariance ``Σ``. (BatchNorm in training mode couples the samples; the estimate is then
    approximate.) A parameter-free module's input gradient holds each sample's own rows: its
    "variance" is its squared norm (for equal halves), and the metric its squared relative error.

    ``piece``: ``(index, count)`` when the pass runs the sample in ``count`` equal pieces
    (:func:`cut_sample`): the output holds piece ``index``'s rows, weighted by their places in
    the whole sample, so the pieces' gradients averaged are the whole pass's.
    """

    def __init__(self, model: nn.Module, piece: tuple[int, int] = (0, 1)):
        self.model = model
        self.piece = piece
        self.scale = 0.0  # stays 0 where the model's output has no such tensor
        self.samples = 0  # in the sample (the model output's dim 0)
        self._depth = 0  # module calls in progress
        self._weighted: Any = None  # the hook on the output weighted so far

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self._depth += 1

    def _exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._depth -= 1
        if self._depth:
            return  # called inside another module: not the model's output
        index, count = self.piece
        found = [
            t
            for t in tensors_in(output)
            if t.requires_grad
            and t.is_floating_point()
            and t.dim() >= 1
            and t.shape[0] * count >= 2
        ]
        if not found:
            return
        if self._weighted is not None:  # a later outermost call: its output is the model's
            self._weighted.remove()
        out = found[0]
        rows = out.shape[0]
        n = rows * count  # the whole sample's
        a, b = (n + 1) // 2, n // 2
        weights = torch.full((rows,), -n / (2 * b), dtype=out.dtype, device=out.device)
        weights[: max(0, min(rows, a - index * rows))] = n / (2 * a)  # this piece's rows in A
        weights = weights.view(rows, *([1] * (out.dim() - 1)))
        self.scale = 4.0 / (n * (1 / a + 1 / b))
        self.samples = n
        self._weighted = out.register_hook(lambda grad: grad * weights)


@contextmanager
def preserved_state(
    model: nn.Module, generators: Sequence[torch.Generator]
) -> Iterator[Callable[[], AbstractContextManager]]:
    """The check's passes, isolated (:func:`~memopt_plugins.measure.isolated`): everything a pass
    may change is put back on exit, and after each pass.

    Yields a factory of per-pass contexts (with gradients enabled): each pass starts from the same
    buffers and tensor attributes, by slot (one a forward reassigns holds training's own tensor
    again, with its value), and the same state of every RNG stream a forward may draw from --
    torch's on the CPU and every initialized accelerator device, numpy's global one, Python's
    ``random`` and ``generators`` -- so dropout and masks drawn with ``np.random`` are the same in
    every pass, and training after the check continues every stream from where it was. ``.grad``
    is left alone (the passes differentiate with :func:`gradients`).
    """
    with isolated(model, generators=generators) as isolation:

        @contextmanager
        def one_pass() -> Iterator[None]:
            with isolation.one_pass(), torch.enable_grad():
                yield

        yield one_pass


def scalar_loss(loss_fn: Callable[[], torch.Tensor]) -> torch.Tensor:
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


def piece_samples(samples: int, batch_size: int | None, stored: int, original: int) -> int:
    """The most samples a piece of the check's exact passes may hold: those whose uncompressed
    saved bytes fit in what the compressed training forward of ``batch_size`` samples kept
    (``stored`` of its ``original`` bytes), so that no pass holds more for its backward than the
    step the check guards. The whole sample where no training forward was counted yet."""
    if not batch_size or not stored or not original:
        return samples
    return max(1, min(samples, batch_size * stored // original))


def couples_samples(model: nn.Module) -> bool:
    """Whether a forward of ``model`` mixes its samples: a BatchNorm normalizing with the
    statistics of the batch (training mode). Cut in pieces, its sample would be normalized by
    each piece's statistics: a function training never runs."""
    return any(
        isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules()
    )


def cut_sample(
    loss_fn: Callable[[nn.Module, Any], torch.Tensor], model: nn.Module, sample: Any, most: int
) -> list[Callable[[], torch.Tensor]]:
    """``loss_fn(model, sample)`` as closures over equal pieces of ``sample`` (dim 0 of every
    tensor with the sample's count there; other leaves whole), each of at most ``most`` samples:
    the pieces' count divides the sample's, so the mean of their gradients is the sample's for
    a loss that is a mean over samples (for a sum, a scale no metric sees). One closure over
    the whole sample when it fits, or when the model couples its samples
    (:func:`couples_samples`)."""
    samples = batch_size_of(sample)
    whole = [lambda: loss_fn(model, sample)]
    if samples is None or samples <= most or couples_samples(model):
        return whole
    size = max(d for d in range(1, most + 1) if samples % d == 0)

    def piece(start: int) -> Callable[[], torch.Tensor]:
        cut = map_tensors(
            lambda t: t[start : start + size] if t.dim() > 0 and t.shape[0] == samples else t,
            sample,
        )
        return lambda: loss_fn(model, cut)

    return [piece(start) for start in range(0, samples, size)]


#: A gradient of more elements than this is folded into this many: element ``i`` is added, with a
#: sign of its own (fixed per target, the same in every pass), into slot ``i mod SKETCH``.
#: Differences, dot products and squared norms of the folds estimate those of the gradients
#: without bias (relative standard error about ``sqrt(2 / SKETCH)`` = 4% on a squared norm, 2% on
#: a norm), so a check never holds a whole gradient (a fold is kept in float32: 4 KiB a target and
#: pass); a smaller gradient is kept as it is (exact).
SKETCH = 1024
#: Elements folded at a time, at least (their float64 copy and signs are the fold's only memory).
CHUNK = SKETCH * 8
#: ... and at most: a gradient is folded in about :data:`CHUNKS` chunks between the two, so that
#: a large one is folded in few steps (each a Python round trip) while a chunk's copy stays a
#: small share of the gradient in flight.
MOST_CHUNK = SKETCH * 256
CHUNKS = 16


def chunk_size(whole: int) -> int:
    """Elements a fold of a gradient of ``whole`` elements takes at a time: a multiple of
    :data:`SKETCH` that depends on ``whole`` alone, so every pass and every rank's share of one
    target draws the same signs."""
    return SKETCH * max(CHUNK // SKETCH, min(MOST_CHUNK // SKETCH, whole // (SKETCH * CHUNKS)))


@dataclass
class PassGradients:
    """What one pass keeps of its gradients, per target (this rank's share of a sharded one).

    Attributes:
        folds: each target's gradient folded to :data:`SKETCH` float32 values (the gradient
            itself when it is no longer); ``None`` where no gradient reached it.
        sq: exact squared norms (float64, on the CPU).
        finite: whether each gradient held only finite values.
    """

    folds: list[torch.Tensor | None]
    sq: torch.Tensor
    finite: torch.Tensor

    def fold(self, i: int, like: PassGradients) -> torch.Tensor:
        """Target ``i``'s fold, zeros shaped like ``like``'s where no gradient reached it."""
        fold = self.folds[i]
        if fold is not None:
            return fold.double()
        other = like.folds[i]
        return torch.zeros(0 if other is None else other.numel(), dtype=torch.float64)


def fold(
    grad: torch.Tensor, salt: int, offset: int = 0, whole: int | None = None
) -> tuple[torch.Tensor, float]:
    """``grad`` flattened and folded to :data:`SKETCH` float32 values (see there), on the CPU,
    and its exact squared norm; ``salt`` seeds the signs, so a target folds alike in every pass.
    ``grad`` may be a share of a gradient of ``whole`` elements starting at ``offset``: it is
    folded by its elements' places in the whole, so the shares' folds add up to the whole's.
    Chunk by chunk: it never holds more than :data:`CHUNK` elements' copy."""
    flat = grad.detach().reshape(-1)
    whole = flat.numel() if whole is None else whole
    if whole <= SKETCH:  # kept whole, in float32 unless it is float64
        dtype = torch.float64 if flat.dtype == torch.float64 else torch.float32
        kept = flat.to(dtype).cpu()
        if flat.numel() < whole:  # a share, in its place
            kept = torch.zeros(whole, dtype=dtype).index_copy_(
                0, torch.arange(offset, offset + flat.numel()), kept
            )
        return kept, float(torch.linalg.vecdot(kept.double(), kept.double()))
    out = torch.zeros(SKETCH, dtype=torch.float64, device=flat.device)
    sq = torch.zeros((), dtype=torch.float64, device=flat.device)
    generator = torch.Generator(device=flat.device)
    end, size = offset + flat.numel(), chunk_size(whole)
    for first in range(offset - offset % size, end, size):  # the whole's chunks it touches
        lo, hi = max(first, offset), min(first + size, end)
        chunk = flat[lo - offset : hi - offset].double()
        sq += torch.linalg.vecdot(chunk, chunk)
        generator.manual_seed(salt * 1_000_003 + first // size)
        signs = torch.randint(
            0, 2, (size,), generator=generator, device=flat.device, dtype=torch.int8
        )[lo - first : hi - first]
        chunk.mul_(signs.mul_(2).sub_(1))
        front = lo % SKETCH  # chunks start at a multiple of SKETCH
        chunk = torch.nn.functional.pad(chunk, (front, -(front + chunk.numel()) % SKETCH))
        out += chunk.view(-1, SKETCH).sum(0)
    return out.float().cpu(), float(sq)


def squared_norm(flat: torch.Tensor) -> float:
    """The squared norm of the flat tensor ``flat`` in float64, a chunk's copy at a time."""
    size = min(MOST_CHUNK, max(CHUNK, flat.numel() // CHUNKS))  # as a fold's, of SKETCH alone
    chunks = (flat[lo : lo + size].double() for lo in range(0, flat.numel(), size))
    return float(sum(torch.linalg.vecdot(c, c) for c in chunks))


#: What a reentrant checkpoint (torch's ``use_reentrant=True``, ``deepspeed.checkpointing``'s
#: either form) raises under ``torch.autograd.grad``.
_REENTRANT = "Checkpointing is not compatible with .grad()"


def _differentiate(loss: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """``torch.autograd.grad(loss, inputs)`` (what it returns is taken by hooks), saying why when
    a checkpoint in the model refuses it."""
    try:
        torch.autograd.grad(loss, inputs, allow_unused=True)
    except RuntimeError as err:
        if _REENTRANT not in str(err):
            raise
        raise RuntimeError(
            "memopt's drift check differentiates with torch.autograd.grad (so that .grad, the "
            "optimizer and DDP/ZeRO reducers never see it), which a checkpoint in the model "
            "refuses: torch's reentrant checkpoint (use_reentrant=True) or "
            "deepspeed.checkpointing (both forms). Use torch's non-reentrant checkpoint "
            "(transformers' default) or turn drift checks off (drift.enabled: false)"
        ) from err


def gradients(
    loss: torch.Tensor,
    targets: Sequence[torch.Tensor],
    shares: Sequence[int] = (),
    *,
    squares_only: bool = False,
) -> PassGradients:
    """The gradients of ``loss`` with respect to ``targets``, folded as autograd produces them.

    Each target's gradient is folded (:func:`fold`) and its squared norm taken by a hook on the
    target the moment autograd has it; a parameter's hook hands autograd a zero tensor without
    memory of its own in its place, so no pass holds more than the gradients in flight. Of the
    targets at the indices in ``shares`` (sharded parameters) only this rank's share of the
    flattened gradient is kept (:func:`~memopt_plugins.distributed.rank_share`). ``.grad`` is never
    touched (so neither is FSDP's reduce-scatter into it, nor a DDP reducer). ``squares_only``:
    only the squared norms (the signed-halves pass).
    """
    n = len(targets)
    folds: list[torch.Tensor | None] = [None] * n
    sq = torch.zeros(n, dtype=torch.float64)
    shared = set(shares)
    handles = []

    def keeper(i: int, leaf: bool) -> Callable[[torch.Tensor], torch.Tensor | None]:
        def keep(grad: torch.Tensor) -> torch.Tensor | None:
            flat = grad.detach().reshape(-1)
            whole, offset = flat.numel(), 0
            if i in shared:
                share = rank_share(whole)
                flat, offset = flat[share], share.start
            if squares_only:  # no fold to make: only its squared norm
                sq[i] += squared_norm(flat)
            else:
                folded, square = fold(flat, i, offset, whole)
                sq[i] += square
                folds[i] = folded if folds[i] is None else folds[i] + folded
            if leaf:  # nothing flows on from a parameter: free its gradient now
                return torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)
            return None

        return keep

    leaves, inner = [], []
    for i, t in enumerate(targets):
        if is_sharded(t):  # a sharded parameter whose module did not run in this pass
            continue
        handles.append(t.register_hook(keeper(i, t.grad_fn is None)))
        (inner if t.grad_fn is not None else leaves).append(t)
    try:
        # Recorded activations are reached on the way to the parameters; asked for themselves
        # (only when no parameter is), their gradients would be held to the end of the pass.
        if leaves or inner:
            _differentiate(loss, leaves or inner)
    finally:
        for handle in handles:
            handle.remove()
    if not squares_only:  # a sharded gradient's fold: the shares' folds summed over ranks
        for i in shares:
            size = targets[i].numel()
            fold_i = folds[i]
            if fold_i is None:
                fold_i = torch.zeros(size if size <= SKETCH else SKETCH, dtype=torch.float32)
            folds[i] = sum_over_ranks(fold_i.to(_device_of(targets[i]))).cpu()
    return PassGradients(folds, sq, torch.isfinite(sq))


def merged(
    parts: Sequence[PassGradients], params: int, tensors: int, shares: Sequence[int] = ()
) -> PassGradients:
    """One pass's gradients from its pieces' (:func:`cut_sample`): the mean of the first
    ``params`` targets' folds (folding is linear), each recorded tensor of each piece a target
    of its own (``tensors`` a piece, all dropped when a piece recorded other ones). A parameter's
    squared norm is then its mean fold's (exact up to :data:`SKETCH` elements, else the fold's
    estimate): the pieces' exact norms do not add up to the mean's. A sharded parameter's fold
    is already the whole gradient's on every rank: each rank holds its squared norm over the
    world size, so the sum over ranks (:func:`summed_over_shards`) is the whole's."""
    if len(parts) == 1:
        return parts[0]
    weight = 1.0 / len(parts)
    folds: list[torch.Tensor | None] = []
    for i in range(params):
        found = [p.folds[i] for p in parts if p.folds[i] is not None]
        folds.append(sum(f.double() for f in found).mul_(weight).float() if found else None)
    sq = torch.tensor(
        [0.0 if f is None else float(f.double().square().sum()) for f in folds],
        dtype=torch.float64,
    )
    if shares and distributed():
        sq[list(shares)] /= torch.distributed.get_world_size()
    finite = torch.stack([p.finite[:params] for p in parts]).all(0) & torch.isfinite(sq)
    if all(len(p.folds) == params + tensors for p in parts):  # the recorded tensors, piece by piece
        for p in parts:
            folds += [None if f is None else f * weight for f in p.folds[params:]]
        sq = torch.cat([sq, *(p.sq[params:] * weight**2 for p in parts)])
        finite = torch.cat([finite, *(p.finite[params:] for p in parts)])
    return PassGradients(folds, sq, finite)


def _device_of(t: torch.Tensor) -> torch.device:
    """Where a collective on ``t``'s behalf runs (gloo: the CPU; NCCL: the tensor's GPU)."""
    return t.device if t.device.type == "cuda" else torch.device("cpu")


def summed_over_shards(stats: torch.Tensor, sharded: Sequence[int]) -> torch.Tensor:
    """``stats`` (one value per target in its last dim) with the values of the sharded
    parameters' shares summed over ranks (one all-reduce): norms over the whole parameter."""
    if not sharded:
        return stats
    index = torch.tensor(sharded, dtype=torch.long)
    out = stats.clone()
    out[..., index] = sum_over_ranks(stats[..., index].contiguous()).to(stats.device)
    return out


def max_reduced(
    reduce_max: Callable[[torch.Tensor], torch.Tensor],
    values: list[float],
    device: torch.device | None,
) -> list[float]:
    """``values`` max-reduced over ranks by ``reduce_max`` (as a float64 tensor on ``device``)."""
    if not values:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device or torch.device("cpu"))
    return reduce_max(t).cpu().tolist()
