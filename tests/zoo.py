"""Third-party models for tests: Hugging Face transformers models built from a config (no download).

Each builder returns ``(model, batch, loss_fn)`` with ``loss_fn(model, batch) -> scalar loss``.
Dropout is off unless asked for, so that compression figures are not mixed with dropout masks
(those are the dropout modes' business).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import (
    BertConfig,
    BertForMaskedLM,
    CLIPConfig,
    CLIPModel,
    ResNetConfig,
    ResNetForImageClassification,
)

from examples.models import hf_gpt2_model, hf_llama_model


def _lm_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


def _image_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(pixel_values=x).logits, y)


def hf_gpt2(batch_size=8, seq=128, dim=128, layers=2, dropout=0.0, seed=0):
    """GPT-2 (transformers) built from a small config: a GPT-style transformer."""
    model = hf_gpt2_model(512, seq, dim, layers, dropout, seed=seed)
    return model, torch.randint(0, 512, (batch_size, seq)), _lm_loss


def hf_llama(batch_size=4, seq=64, dim=64, layers=2, seed=0):
    """Llama (transformers) built from a small config: RMSNorm, SwiGLU, rotary attention."""
    model = hf_llama_model(256, seq, dim, layers, seed=seed)
    return model, torch.randint(0, 256, (batch_size, seq)), _lm_loss


def hf_bert(batch_size=8, seq=64, dim=64, layers=2, dropout=0.1, seed=0):
    """BERT (transformers) built from a small config, masked-LM head, dropout on by default."""
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=256,
        hidden_size=dim,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=4 * dim,
        max_position_embeddings=seq,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    cfg._attn_implementation = "eager"
    model = BertForMaskedLM(cfg)
    return model, torch.randint(0, 256, (batch_size, seq)), _lm_loss


def hf_resnet(batch_size=16, size=64, depths=(3, 4, 6, 3), seed=0):
    """ResNet (transformers) with bottleneck blocks in ResNet-50's layout, at a quarter width."""
    torch.manual_seed(seed)
    cfg = ResNetConfig(
        embedding_size=16,
        hidden_sizes=[32, 64, 128, 256],
        depths=list(depths),
        layer_type="bottleneck",
        num_labels=10,
    )
    model = ResNetForImageClassification(cfg)
    batch = (torch.randn(batch_size, 3, size, size), torch.randint(0, 10, (batch_size,)))
    return model, batch, _image_loss


def _clip_loss(model, batch):
    input_ids, pixel_values = batch
    return model(input_ids=input_ids, pixel_values=pixel_values, return_loss=True).loss


def hf_clip(batch_size=16, seq=32, dim=64, layers=2, size=64, seed=0):
    """CLIP (transformers) built from a small config: a text and a vision tower feeding one
    contrastive loss (the projections keep their default width, 512)."""
    torch.manual_seed(seed)
    tower = dict(
        hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers, num_attention_heads=4
    )
    cfg = CLIPConfig(
        text_config=dict(tower, vocab_size=256, max_position_embeddings=seq),
        vision_config=dict(tower, image_size=size, patch_size=8),
    )
    cfg._attn_implementation = "eager"
    model = CLIPModel(cfg)
    batch = (torch.randint(0, 256, (batch_size, seq)), torch.randn(batch_size, 3, size, size))
    return model, batch, _clip_loss
