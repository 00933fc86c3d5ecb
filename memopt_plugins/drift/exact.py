"""The drift check's exact pass: what every compressed round is judged against.

:class:`CheckPasses` runs each pass of a check over the same equal pieces of its sample (one
piece: the whole sample). :func:`exact_pass` runs the exact one with compression suspended: it
finds what judges each module, the norms under which a gradient is negligible and (metrics
``noise`` and ``sgd``) the sampling variance of the exact gradient from the sample's two halves:
from the exact pass's own pieces where it runs two or more (the halves' gradients are their
pieces' folds: no pass of its own), else from a pass of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from ..distributed import distributed
from .judges import PARAMS, TENSORS, Judge, find_judges
from .passes import (
    CheckedParameters,
    PassGradients,
    PassRecorder,
    SampleInputs,
    SignedHalves,
    gradients,
    max_reduced,
    merged,
    scalar_loss,
    summed_over_shards,
)
from .report import CALLS_DIFFER, NEGLIGIBLE
from .request import DriftCheck


class CheckPasses:
    """The check's passes, each over the same equal pieces of its sample in turn (one piece:
    the whole sample), so that the gradients compared are of one function and no pass holds more
    than a piece's activations; a pass's gradients are its pieces' merged (:func:`merged`).

    :meth:`exact` runs first: it says what judges each module (:attr:`judges`, by its first
    piece), and the size training judges a piece's saved tensors at (:attr:`sample`)."""

    def __init__(
        self,
        model: nn.Module,
        checked: CheckedParameters,
        param_free: Sequence[str],
        pieces: Sequence[Callable[[], torch.Tensor]],
    ):
        self.model, self.checked, self.param_free, self.pieces = model, checked, param_free, pieces
        self.wanted: list[int] = []  # the recorded tensors a piece's judges read
        self.layout: tuple = ()
        self.judges: dict[str, Judge] = {}
        self.unmeasured: dict[str, str] = {}
        #: when each module that saved something for compression finished (inherited drift)
        self.finished: dict[str, int] = {}
        self.samples = 0  # in a piece
        #: ``(samples in a piece, training batch)``: a piece's saves judged at training's sizes
        #: (:func:`~memopt_plugins.policy.min_numel_at`); ``None``: at their own
        self.sample: tuple[int, int] | None = None
        #: per parameter, the sampling variance of the exact gradient from the halves of the
        #: exact pass's pieces (:func:`piece_halves`); ``None``: one piece, or not asked for
        self.spread: torch.Tensor | None = None
        self.halves = False  # whether the exact pass measures :attr:`spread`

    @classmethod
    def of(cls, check: DriftCheck, fqns: Sequence[str], halves: bool = False) -> CheckPasses:
        """The passes of ``check`` on the modules ``fqns``: its sample cut in pieces of the
        least size over ranks where it gives a cut (every rank cuts alike: sharded folds are
        collectives). ``halves`` (the sampling variance is wanted): a sample that fits whole
        is cut in its two halves where it can be, so the exact pass measures the variance
        too and no pass of its own runs for it (the same samples, one pass fewer)."""
        sample = check.sample
        checked = CheckedParameters(sample.model)
        param_free = [f for f in fqns if not checked.own(f)]
        pieces: Sequence[Callable[[], torch.Tensor]] = [sample.loss_fn]
        if sample.cut is not None:  # every rank joins the reduce, whatever its own room
            least = int(
                -max_reduced(check.reduce_max, [-float(sample.most)], device_of(checked))[0]
            )
            if least > 0:  # no rank measured a room: every rank runs the sample whole
                pieces = sample.cut(least)
                if halves and len(pieces) == 1 and len(cut := sample.cut(max(1, least // 2))) == 2:
                    pieces = cut
        passes = cls(sample.model, checked, param_free, pieces)
        passes.halves = halves
        return passes

    def run(
        self,
        loss_of: Callable[[int, Callable[[], torch.Tensor]], torch.Tensor | None] | None = None,
        recorder: Callable[[], PassRecorder] | None = None,
        squares_only: bool = False,
        first: Callable[[PassRecorder], None] | None = None,
        kept: list[PassGradients] | None = None,
    ) -> PassGradients | None:
        """One pass: ``loss_of(index, piece)`` per piece (default: the piece's loss), recorded by
        ``recorder()``; ``first(rec)`` after the first piece's forward; each piece's gradients
        appended to ``kept``. ``None`` where ``loss_of`` returns ``None``: the pass ends there,
        with no backward."""
        params, sharded = self.checked.params, self.checked.sharded
        parts = []
        for index, piece in enumerate(self.pieces):
            rec = recorder() if recorder else PassRecorder(self.model, self.param_free)
            with rec:
                loss = loss_of(index, piece) if loss_of else scalar_loss(piece)
            if loss is None:
                return None
            if first is not None and not index:
                first(rec)
            tensors = [rec.tensors[i] for i in self.wanted] if rec.layout() == self.layout else []
            targets = self.checked.targets(rec.running) + tensors
            only = squares_only and len(self.pieces) == 1  # pieces merge by their folds
            parts.append(gradients(loss, targets, sharded, squares_only=only))
            del loss, rec, tensors, targets
        if kept is not None:
            kept.extend(parts)
        return merged(parts, len(params), len(self.wanted), sharded)

    def exact(
        self, fqns: Sequence[str], scopes: Sequence[str], min_numel: int, batch_size: int | None
    ) -> PassGradients:
        """The exact pass (compression suspended by the caller). A piece of ``n`` samples cut
        from a training batch of ``batch_size`` is judged at its training size: ``(n,
        batch_size)`` where the sample holds 2 or more samples and a piece fewer than the batch.
        A piece's recorded tensors are targets of their own (a judge's indices, piece by piece);
        a piece that recorded other tensors than the first leaves them unjudged."""
        inputs = SampleInputs(self.model)

        def counted(index: int, piece: Callable[[], torch.Tensor]) -> torch.Tensor:
            with inputs:
                return scalar_loss(piece)

        def first(rec: PassRecorder) -> None:
            self.samples = inputs.samples
            if batch_size and self.samples * len(self.pieces) >= 2 and self.samples < batch_size:
                rec.sample = self.sample = (self.samples, batch_size)
            self.judges, self.unmeasured = find_judges(fqns, self.checked, rec)
            self.wanted = sorted(
                {i for j in self.judges.values() if j.kind == TENSORS for i in j.indices}
            )
            self.layout = rec.layout()
            self.finished = {f: t for f, t in rec.finished.items() if rec.saved.get(f, 0)}

        parts: list[PassGradients] = []
        exact = self.run(
            counted,
            lambda: PassRecorder(self.model, self.param_free, scopes, min_numel),
            first=first,
            kept=parts,
        )
        assert exact is not None
        params, count, wanted = len(self.checked.params), len(self.pieces), self.wanted
        if self.halves and count >= 2 and self.samples:
            self.spread = piece_halves(parts, params, self.checked.sharded)
        del parts
        if len(exact.folds) < params + count * len(wanted):
            for f in [f for f, j in self.judges.items() if j.kind == TENSORS]:
                del self.judges[f]
                self.unmeasured[f] = CALLS_DIFFER
        position = {i: params + k for k, i in enumerate(wanted)}
        self.judges = {
            f: j
            if j.kind == PARAMS
            else Judge(
                j.kind,
                tuple(position[i] + n * len(wanted) for n in range(count) for i in j.indices),
            )
            for f, j in self.judges.items()
        }
        return exact

    def signed_halves(self) -> tuple[torch.Tensor | None, int]:
        """The sampling variance of the exact gradient per target and the sample's count, from
        one exact pass with its halves weighted +1 and -1 (:class:`SignedHalves`, each piece's
        rows by their half of the whole sample); ``(None, 0)`` where the model's output holds
        no tensor with the samples."""
        signed: list[SignedHalves] = []

        def weighted(index: int, piece: Callable[[], torch.Tensor]) -> torch.Tensor | None:
            with SignedHalves(self.model, piece=(index, len(self.pieces))) as halves:
                loss = scalar_loss(piece)
            signed.append(halves)
            return loss if halves.scale else None

        spread = self.run(weighted, squares_only=True)
        if spread is None:
            return None, 0
        variance = summed_over_shards(spread.sq, self.checked.sharded) * signed[-1].scale
        return variance, signed[-1].samples

    def halves_apart(self, tensors_sq: torch.Tensor) -> tuple[torch.Tensor | None, int]:
        """:meth:`signed_halves` for a model whose output holds no tensor with the samples (a
        loss computed inside it): each piece's rows in the whole sample's first half ``A`` and
        in its second ``B`` run on their own (:class:`SampleInputs`), their losses weighted so
        that the pieces' mean gradient is ``(g_A - g_B) / 2`` for a loss that is a mean over
        samples. After the parameters, the recorded tensors, whose rows are each sample's own:
        their exact squared norms ``tensors_sq`` (as :class:`SignedHalves` gives for equal
        halves). ``(None, samples)`` when the sample holds fewer than 2."""
        rows, count = self.samples, len(self.pieces)
        n = rows * count
        if n < 2:
            return None, n
        a, b = (n + 1) // 2, n // 2

        def apart(index: int, piece: Callable[[], torch.Tensor]) -> torch.Tensor:
            split = min(rows, max(0, a - index * rows))  # this piece's rows in A
            halves = (
                (slice(0, split), split / (2 * a)),
                (slice(split, rows), (split - rows) / (2 * b)),
            )
            losses = []
            for part, weight in halves:
                if part.stop > part.start:
                    with SampleInputs(self.model, part):
                        losses.append(scalar_loss(piece) * (weight * count))
            return sum(losses[1:], losses[0])

        spread = self.run(apart, lambda: PassRecorder(self.model, ()), squares_only=True)
        assert spread is not None
        scale = 4.0 / (n * (1 / a + 1 / b))
        params = summed_over_shards(spread.sq, self.checked.sharded) * scale
        return torch.cat([params[: len(self.checked.params)], tensors_sq]), n


def piece_halves(
    parts: Sequence[PassGradients], params: int, sharded: Sequence[int]
) -> torch.Tensor:
    """Per parameter, the sampling variance of the mean exact gradient of a sample run in
    ``parts``, equal pieces of it in order: its first half ``A`` the first ``ceil(count / 2)``
    pieces, ``B`` the others, ``E|g_A - g_B|^2 = tr(Σ) (1/|A| + 1/|B|)`` and ``Var(g) = tr(Σ) /
    n`` (as :class:`~.passes.SignedHalves` measures it in a pass of its own), from the pieces'
    folds (folding is linear: the halves' folds are their pieces' mean; a fold's squared norm
    estimates the gradient's without bias). A sharded parameter's fold is the whole gradient's
    on every rank: each holds its squared norm over the world size, as :func:`merged` does."""
    count = len(parts)
    a, b = (count + 1) // 2, count // 2  # pieces: their samples are in the same ratio
    out = torch.zeros(params, dtype=torch.float64)
    for i in range(params):
        found = [p.folds[i] for p in parts]
        if any(f is not None for f in found):
            difference = _mean_fold(found[:a]) - _mean_fold(found[a:])
            out[i] = difference.square().sum()
    if sharded and distributed():
        out[list(sharded)] /= torch.distributed.get_world_size()
    return out / (count * (1 / a + 1 / b))


def _mean_fold(folds: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The mean of ``folds`` in float64 (``None``: no gradient reached that piece: zeros)."""
    found = [f.double() for f in folds if f is not None]
    return sum(found[1:], found[0]) / len(folds) if found else torch.zeros((), dtype=torch.float64)


def device_of(checked: CheckedParameters) -> torch.device | None:
    """Where the check's values are reduced over ranks: the first parameter's device."""
    return checked.params[0].device if checked.params else None


@dataclass(frozen=True)
class ExactPass:
    """What the exact pass measured, against which every round is judged.

    Attributes:
        gradients: its gradients, folded as autograd made them.
        sq: their squared norms per target (sharded parameters' summed over ranks).
        floors: per judge kind (parameters, tensors), the norm at or under which a module's
            exact gradient is negligible.
        variance: metrics ``noise`` and ``sgd``: per target, the sampling variance of the
            sample's mean exact gradient (``None``: the sample has no two halves).
        samples: the samples that variance is of.
        params: the first ``params`` targets are the model's parameters.
    """

    gradients: PassGradients
    sq: torch.Tensor
    floors: dict[str, float]
    variance: torch.Tensor | None
    samples: int
    params: int


def exact_pass(
    passes: CheckPasses,
    one_pass: Callable[[], AbstractContextManager],
    check: DriftCheck,
    fqns: Sequence[str],
    metric: str,
) -> ExactPass:
    """The exact pass of ``check`` (``one_pass()``: from the state every pass starts from), and
    for metrics ``noise`` and ``sgd`` the variance of its gradient: an exact pass with its
    halves weighted +1 and -1, or without an output with the samples the halves on their own."""
    face = check.face
    scopes = fqns if face.scopes is None else face.scopes
    with one_pass(), face.suspend():
        exact = passes.exact(fqns, scopes, face.min_numel, check.sample.batch_size)
    params = len(passes.checked.params)
    exact_sq = summed_over_shards(exact.sq, passes.checked.sharded)
    usable = torch.where(torch.isfinite(exact_sq), exact_sq, torch.zeros_like(exact_sq))
    floors = {
        PARAMS: NEGLIGIBLE * float(usable[:params].sum().sqrt()),
        TENSORS: NEGLIGIBLE * float(usable[params:].sum().sqrt()),
    }
    variance, samples = None, 0
    if metric in ("noise", "sgd") and passes.spread is not None:  # the pieces' halves
        spread = summed_over_shards(passes.spread, passes.checked.sharded)
        variance, samples = (
            torch.cat([spread, exact_sq[params:]]),
            passes.samples * len(passes.pieces),
        )
    elif metric in ("noise", "sgd"):
        with one_pass(), face.suspend():
            variance, samples = passes.signed_halves()
        if variance is None:  # no output with the samples: the halves run on their own
            with one_pass(), face.suspend():
                variance, samples = passes.halves_apart(exact_sq[params:])
        if variance is None and metric == "noise":
            raise ValueError(
                "drift.metric noise needs two halves of the sample: the model was called "
                "with no tensor of 2 or more samples along dim 0; use sample_size >= 2, "
                "or metric rel_l2 / cosine"
            )
    return ExactPass(exact, exact_sq, floors, variance, samples, params)
