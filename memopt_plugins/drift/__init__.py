"""Gradient drift: compare compressed and exact gradients on a small batch, change bit widths.

A check runs the user's ``loss_fn`` exactly (compression suspended) and compressed, each pass from
the same state of every RNG stream, with buffers restored and gradients taken by
:func:`torch.autograd.grad`, so neither ``.grad``, the optimizer nor a DDP reducer sees it and a
run in which nothing changes is bit for bit the run without checks. A module with parameters is
judged by their gradients together, a parameter-free one by the gradient of its inputs
(:mod:`.judges`); ``drift.metric`` says what its drift is (``sgd``: the share of a step's progress
compression costs). Modules over the threshold go up the ladder; with ``drift.lower`` or a
memory target (``quantize.budget``/``memory``) calm ones come down, each change confirmed by a
probe pass (:mod:`.decide`, :mod:`.budget`). Every pass folds gradients as autograd makes them
(:mod:`.passes`), so a check holds no second set of gradients. Under torch.distributed the drifts
are max-reduced over ranks before any decision (sharded gradients' norms summed first), so all
ranks run the same bits. docs/drift.md and docs/distributed.md say more.
"""
