"""Gradient drift: compare compressed and exact gradients on a small batch, escalate bit widths.

One check runs the user's ``loss_fn`` exactly (compression suspended) and compressed, each pass
from the same state of every RNG stream a forward may draw from -- torch's on the CPU and every
initialized accelerator device, numpy's global one, Python's ``random`` -- so dropout and masks
drawn with ``np.random`` (wav2vec2's time masking) are the same in both, and all of them are left
where they were; it restores every buffer after each pass (BatchNorm running statistics) and the
private generators it is given (stochastic rounding), and takes gradients with
:func:`torch.autograd.grad`, so neither ``.grad``, the optimizer nor a DDP reducer sees anything.
The exact gradients are computed once; every round of escalation costs one more compressed pass.

What judges a module (the drift of which gradient):

* a module with parameters of its own (``recurse=False``: ``Linear``, norms, embeddings) — those
  parameters, all together, so a bias whose exact gradient is ~0 (the key bias of attention) cannot
  blow up the ratio on its own;
* a parameter-free module — the gradient of its inputs (every call), which is computed from what
  it saved and from the gradient flowing into it. A first design judged such modules by
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

Drift by ``metric``. ``sgd`` (default): the share of a training step's progress that compression
costs, ``e k / (1 + (1 + e) k)`` (:func:`~.judges.progress_cost`), from ``e`` = ‖g_q − g‖² /
Var(g), compression's error against the gradient's own sampling noise (a second exact pass weights
the two halves of the sample +1 and −1, :class:`~.passes.SignedHalves`; both shrink as 1/batch),
and ``k``, the gradient noise scale over the training batch; the threshold judges the model's whole
parameter gradient, and over it the modules over it on their own go up (or the one costing most).
``noise``: ``e`` itself. ``rel_l2`` = ‖g_q − g‖ / ‖g‖, ``cosine`` = 1 − cos(g_q, g). A module at 32
bits over the threshold passes its drift on to the compressed modules whose forward ended after
its own. Each round escalates one rung; by default the check re-runs until nothing moves
(``max_rounds=1``: one rung per call). Every pass folds each gradient as autograd makes it
(:func:`~.passes.fold`), so a check holds no second set of gradients; a module whose gradient is
not finite in a pass is skipped (bits unchanged, one WARNING).

Under torch.distributed every rank measures its own sample, and the drifts are max-reduced over
ranks (by the reduce the integration injects: Lightning's strategy, Accelerate's accelerator, or
``all_reduce`` by default) before any decision, so all ranks escalate the same modules and always
run the same bits; the check is then a collective, run by every rank at the same step. The INFO
line of an escalation is written by rank 0 only. Under ``DistributedDataParallel`` let ``loss_fn``
call the wrapped module (``ddp.module``). Going through the wrapper also works (no gradient
reaches its reducer; checked with ``find_unused_parameters=True`` and an unused parameter too),
but each of its forwards broadcasts buffers and prepares the reducer for a backward that never
comes.

Under FSDP2 (``fully_shard``) the modules hold sharded parameters (DTensors) between forwards and
unsharded ones, all-gathered for the forward, while they run: each pass differentiates what its
modules ran with (noted as each module starts,
:class:`~memopt_plugins.measure.storage.RunningParameters`), so FSDP's unshard and reshard go on as
in training, and neither ``.grad`` nor FSDP's reduce-scatter into it is reached. Of a sharded
parameter's gradient each rank keeps only its share (a ``1/world_size`` slice of the flattened
gradient, cut as soon as autograd produces it, so no rank holds more than one whole gradient of a
sharded parameter at a time), and the shares' squared norms and dot products are summed over ranks
(``all_reduce``) before any ratio is taken: a module's drift is a norm over the whole parameter, the
same number on every rank. With the same sample on every rank it is the unsharded model's drift;
with each rank's own sample, that of the gradient assembled from the ranks' shares. Activation
gradients (the judges of parameter-free modules) are per rank, and the max over ranks follows as
above. Call the check on every rank at the same step, with ``loss_fn`` running the sharded model.
"""

from .monitor import DriftMonitor
from .report import (
    CALLS_DIFFER,
    HISTORY_LIMIT,
    NEGLIGIBLE,
    NEGLIGIBLE_GRADIENT,
    NEGLIGIBLE_NOISE,
    NOTHING_TO_JUDGE,
    SAVES_NOTHING,
    DriftReport,
    next_rung,
)

__all__ = [
    "CALLS_DIFFER",
    "HISTORY_LIMIT",
    "NEGLIGIBLE",
    "NEGLIGIBLE_GRADIENT",
    "NEGLIGIBLE_NOISE",
    "NOTHING_TO_JUDGE",
    "SAVES_NOTHING",
    "DriftMonitor",
    "DriftReport",
    "next_rung",
]
