"""An MLP block run over chunks of tokens, so that its wide tensors exist one chunk at a time.

An MLP widens every token three or four times before narrowing it back. Run whole, the widened
tensor and its activation are alive together in the forward until memopt packs what backward
needs, and in the backward the decoded inputs and the gradient of the product are as wide: with
everything else compressed, these are what the step peaks on. Each token goes through an MLP on
its own, so running it over chunks of tokens gives the same outputs and gradients, and only one
chunk's wide tensors exist at a time: autograd runs each chunk's backward through before the
previous chunk's (its nodes are newer). A chunk holds as many tokens as the hidden size: its
widened tensor is the size of one of the MLP's weights, whatever the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def tiled(x: torch.Tensor, block: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``block(x)`` for a ``block`` that maps each token (the last dim) on its own, run over
    chunks of ``x.shape[-1]`` tokens and put back together."""
    width = x.shape[-1]
    tokens = x.reshape(-1, width)
    if tokens.shape[0] <= width:
        return block(x)
    parts = [block(chunk) for chunk in tokens.split(width)]
    return torch.cat(parts).view(*x.shape[:-1], parts[0].shape[-1])
