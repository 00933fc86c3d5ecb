"""Activation compression: the codec, the per-module saved-tensor hooks and their bookkeeping.

* :mod:`.face`: compression as the engine sees it, one narrow object (:class:`.face.Compression`);
* :mod:`.codec`: the codec, a package in layers (façade, dispatch, specification, kernels);
* :mod:`.hooks`: the compression scopes' saved-tensor hook pair, for eager and compiled code;
* :mod:`.saved`: what autograd holds for a packed tensor, and how it comes back;
* :mod:`.counts`: the hooks' counting observer (per forward and scope, the step-peak meter);
* :mod:`.compiled`: how the hooks get into compiled graphs, and what those graphs save;
* :mod:`.stats`: byte counts of what the hooks saved, per forward, scope and compiled graph;
* :mod:`.estimate`: what the hooks store, from sizes and bits alone (prices, the planner's ratio);
* :mod:`.bits`: the engine's bit table.

Which modules get which bits, and which saved tensors are kept as they are, is the compression
policy's (:mod:`memopt_plugins.policy`).
"""
