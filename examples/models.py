"""Small models for the demo, the examples and `memopt profile`.

Each factory returns ``(model, batch, loss_fn)`` with ``loss_fn(model, batch) -> scalar loss``, the
shape `memopt profile --model examples/models.py:gpt` expects. ``hf_gpt2_model`` and
``hf_llama_model`` build Hugging Face models from a small config (no download): the one builder
the Trainer example, the benchmarks and the tests' zoo share.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = self.attn_drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, dim: int, dropout: float):
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-2-style decoder: token + position embeddings, pre-norm blocks, tied head."""

    def __init__(
        self,
        vocab: int = 128,
        dim: int = 128,
        depth: int = 4,
        heads: int = 4,
        block_size: int = 128,
        dropout: float = 0.1,
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block_size, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy for a ``(inputs, targets)`` batch of token ids."""
    idx, targets = batch
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class ConvBNReLU(nn.Sequential):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        )


class BasicBlock(nn.Module):
    """A ResNet basic block: two 3x3 conv-BN(-ReLU) with an identity or strided shortcut."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = ConvBNReLU(cin, cout, stride)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn2(self.conv2(self.conv1(x))) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A ResNet-style CNN for small images (e.g. 8x8 digits or 32x32 inputs)."""

    def __init__(
        self, in_channels: int = 1, classes: int = 10, width: int = 32, dropout: float = 0.1
    ):
        super().__init__()
        self.stem = ConvBNReLU(in_channels, width)
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(
            BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width)
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(self.drop(self.pool(x).flatten(1)))


def classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def gpt(batch_size: int = 8, block_size: int = 128, seed: int = 0):
    """A 4-block character GPT with a random batch of byte tokens."""
    torch.manual_seed(seed)
    model = GPT(block_size=block_size)
    tokens = torch.randint(0, 128, (batch_size, block_size + 1))
    return model, (tokens[:, :-1], tokens[:, 1:]), lm_loss


def cnn(batch_size: int = 32, size: int = 32, seed: int = 0):
    """A small ResNet with a random batch of 3-channel images."""
    torch.manual_seed(seed)
    model = SmallResNet(in_channels=3)
    batch = (torch.randn(batch_size, 3, size, size), torch.randint(0, 10, (batch_size,)))
    return model, batch, classification_loss


def hf_gpt2_model(
    vocab: int,
    positions: int,
    dim: int,
    depth: int,
    dropout: float = 0.0,
    *,
    eager: bool = True,
    seed: int | None = 0,
    **config: Any,
) -> nn.Module:
    """A Hugging Face GPT-2 (4 heads) from a config; ``config`` adds ``GPT2Config`` fields.

    ``eager``: eager attention (else transformers' default, SDPA); ``seed``: torch's seed before
    the weights are drawn (``None``: the generator as it is).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    if seed is not None:
        torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=vocab, n_positions=positions, n_embd=dim, n_layer=depth, n_head=4,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        bos_token_id=0, eos_token_id=0, **config,
    )  # fmt: skip
    if eager:
        cfg._attn_implementation = "eager"
    return GPT2LMHeadModel(cfg)


def hf_llama_model(
    vocab: int, positions: int, dim: int, depth: int, *, eager: bool = True, seed: int | None = 0
) -> nn.Module:
    """A Hugging Face Llama (4 heads, MLP 4x wide) from a config; ``eager`` and ``seed`` as
    :func:`hf_gpt2_model`'s."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=4 * dim, num_hidden_layers=depth,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=positions,
    )  # fmt: skip
    if eager:
        cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg)
