"""Memory-lean operations: exact (up to floating-point rounding), each saving only its inputs and
recomputing its cheap internals in backward, so that what they save is what memopt compresses.

* :func:`linear_cross_entropy` -- the loss head and the cross-entropy in chunks of tokens;
* :func:`gelu`, :func:`gelu_mlp` (a GPT-2 MLP saving its input only: backward does its up
  projection again), :func:`gated_mlp` (a bias-free SwiGLU / GeGLU MLP saving its input only),
  :func:`swiglu`,
  :func:`geglu`, :func:`rms_norm`, :func:`layer_norm`, :func:`batch_norm` -- activation and
  norm chains;
* :func:`conv`, :func:`relu`, :func:`max_pool` -- a CNN's ops with leaner backwards;
* :class:`LeanOps` -- the ``ops`` section of the config: swaps a model's modules for these where
  the swap is exact, and a Hugging Face causal LM's loss for the chunked one.
"""

from .loss import linear_cross_entropy

__all__ = ["linear_cross_entropy"]
