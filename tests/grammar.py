"""A grammar of small models and memopt configs for the generative exactness suite.

Each case is drawn from ``random.Random(seed)``: a model made of the building blocks users combine
(residual MLPs with assorted activations, gated MLPs, norms, causal attention, convolutions, RNNs,
parametrized weights, buffers updated in forward, shared and tied modules, a MoE router with an
auxiliary loss, dropout) and a config from what ``memopt_plugins/config.py`` accepts. The model is
built from a seed too, so a baseline built the same way is the same model. Dims are tiny: a case
is about what memopt promises, not about speed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

B, T, D, H, V = 4, 6, 8, 16, 12  # batch, tokens, width, MLP width, vocabulary

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "relu2", "silu", "clamp")
BLOCKS = ("mlp", "gated", "attn", "conv", "rnn", "plin", "fparam", "ema", "moe")
NORMS = ("none", "layernorm", "rmsnorm", "llama_rmsnorm", "batchnorm")


# --------------------------------------------------------------------------- building blocks


class LlamaRMSNorm(nn.Module):
    """Llama's RMSNorm as transformers writes it (``weight``, ``variance_epsilon``)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


class TokenBatchNorm(nn.Module):
    """``BatchNorm1d`` over the channels of a (batch, tokens, width) tensor."""

    def __init__(self, dim: int):
        super().__init__()
        self.bn = nn.BatchNorm1d(dim)

    def forward(self, x):
        return self.bn(x.transpose(1, 2)).transpose(1, 2)


def make_norm(kind: str) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(D)
    if kind == "rmsnorm":
        return nn.RMSNorm(D, eps=1e-6)
    if kind == "llama_rmsnorm":
        return LlamaRMSNorm(D)
    if kind == "batchnorm":
        return TokenBatchNorm(D)
    return nn.Identity()


def make_activation(kind: str) -> nn.Module:
    """The activation module an MLP holds (ReLU² and the clamp are a ReLU / GELU module whose
    output the MLP's forward squares / clamps, as such code is written)."""
    if kind in ("gelu", "clamp"):
        return nn.GELU()
    if kind == "gelu_tanh":
        return nn.GELU(approximate="tanh")
    if kind in ("relu", "relu2"):
        return nn.ReLU()
    return nn.SiLU()


def _after_activation(kind: str, h: torch.Tensor) -> torch.Tensor:
    if kind == "relu2":
        return h.square()
    if kind == "clamp":
        return h.clamp(-0.05, 0.05)
    return h


class Mlp(nn.Module):
    """A GPT-2-style MLP (``c_fc``, ``act``, ``c_proj``, ``dropout``), the activation's output
    squared (ReLU²) or clamped where its kind says so."""

    def __init__(self, act: str, p: float, zero_out: bool):
        super().__init__()
        self.kind = act
        self.c_fc = nn.Linear(D, H)
        self.act = make_activation(act)
        self.c_proj = nn.Linear(H, D)
        self.dropout = nn.Dropout(p)
        if zero_out:
            nn.init.zeros_(self.c_proj.weight)

    def forward(self, x):
        return self.dropout(self.c_proj(_after_activation(self.kind, self.act(self.c_fc(x)))))


class GatedMlp(nn.Module):
    """A Llama-style gated MLP (``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``)."""

    def __init__(self, act: str, zero_out: bool):
        super().__init__()
        self.kind = act
        self.gate_proj = nn.Linear(D, H, bias=False)
        self.up_proj = nn.Linear(D, H, bias=False)
        self.down_proj = nn.Linear(H, D, bias=False)
        self.act_fn = nn.SiLU() if act in ("silu", "relu", "relu2") else nn.GELU("tanh")
        if zero_out:
            nn.init.zeros_(self.down_proj.weight)

    def forward(self, x):
        gate = _after_activation(self.kind, self.act_fn(self.gate_proj(x)))
        return self.down_proj(gate * self.up_proj(x))


class Attention(nn.Module):
    """Causal self-attention through ``F.scaled_dot_product_attention``, two heads."""

    def __init__(self, p: float, zero_out: bool):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.o_proj = nn.Linear(D, D)
        self.drop = nn.Dropout(p)
        if zero_out:
            nn.init.zeros_(self.o_proj.weight)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.drop(self.o_proj(y.transpose(1, 2).reshape(b, t, D)))


class Conv(nn.Module):
    """A zero-padded ``Conv1d`` along the tokens, then a ReLU."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(D, D, 3, padding=1)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)


class Rnn(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        cls = nn.GRU if kind == "gru" else nn.LSTM
        self.rnn = cls(D, D, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


class ParamLinear(nn.Module):
    """A Linear whose weight is computed from parameters: ``weight_norm``, ``orthogonal`` or
    ``spectral_norm`` (torch.nn.utils.parametrizations)."""

    def __init__(self, kind: str):
        super().__init__()
        self.lin = nn.Linear(D, D)
        if kind == "weight_norm":
            parametrizations.weight_norm(self.lin)
        elif kind == "orthogonal":
            parametrizations.orthogonal(self.lin)
        else:
            parametrizations.spectral_norm(self.lin)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class FunctionalWeight(nn.Module):
    """``W = f(params)`` into ``F.linear``: a weight the forward computes."""

    def __init__(self):
        super().__init__()
        self.v = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.g = nn.Parameter(torch.ones(D, 1))

    def weight(self) -> torch.Tensor:
        return self.g * self.v

    def forward(self, x):
        return torch.tanh(F.linear(x, self.weight()))


class Ema(nn.Module):
    """A normaliser whose buffer tracks the mean of its input, updated in forward: in place
    (``mul_`` / ``add_``) or reassigned (``self.avg = 0.9 * self.avg + ...``)."""

    def __init__(self, inplace: bool):
        super().__init__()
        self.inplace = inplace
        self.register_buffer("avg", torch.zeros(D))
        self.scale = nn.Parameter(torch.ones(D))

    def forward(self, x):
        if self.training:
            mean = x.detach().mean((0, 1))
            if self.inplace:
                self.avg.mul_(0.9).add_(0.1 * mean)
            else:
                self.avg = 0.9 * self.avg + 0.1 * mean
        return torch.tanh((x - self.avg) * self.scale)


class Moe(nn.Module):
    """A two-expert soft mixture with a router whose load-balancing loss is kept in ``aux``."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, 2)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.aux: torch.Tensor | None = None

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        self.aux = 2 * (probs.mean((0, 1)) ** 2).sum()
        return sum(probs[..., i : i + 1] * e(x) for i, e in enumerate(self.experts))


class Block(nn.Module):
    """``x + body(norm(x))``."""

    def __init__(self, norm: nn.Module, body: nn.Module):
        super().__init__()
        self.norm = norm
        self.body = body

    def forward(self, x):
        return x + self.body(self.norm(x))


@dataclass
class ModelSpec:
    seed: int
    tokens: bool  # token ids in (an embedding) or floats (a Linear)
    blocks: list[dict[str, Any]]
    shared: int | None  # index of a block run twice in a row (one module, used twice)
    final_norm: str
    head: str  # "regress": MSE outside the model; "lm": cross-entropy (inside or outside)
    loss_inside: bool
    tied: bool
    probe: bool = False  # a second head (a value probe) reads the head's input first

    def summary(self) -> str:
        parts = []
        for i, b in enumerate(self.blocks):
            text = b["kind"]
            if "act" in b:
                text += f"({b['act']})"
            if "variant" in b:
                text += f"({b['variant']})"
            if b.get("zero_out"):
                text += "0"
            if b["norm"] != "none":
                text = f"{b['norm']}>{text}"
            if self.shared == i:
                text += "x2"
            parts.append(text)
        head = self.head + ("+ce" if self.loss_inside else "") + ("+tied" if self.tied else "")
        head += "+probe" if self.probe else ""
        return f"{'tok' if self.tokens else 'x'}|{','.join(parts)}|{self.final_norm}|{head}"

    @property
    def moe(self) -> bool:
        return any(b["kind"] == "moe" for b in self.blocks)


class Model(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.stem = nn.Embedding(V, D) if spec.tokens else nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block(make_norm(b["norm"]), make_body(b)) for b in spec.blocks)
        self.final_norm = make_norm(spec.final_norm)
        self.head = nn.Linear(D, V if spec.head == "lm" else 2)
        if spec.tied:
            self.head.weight = self.stem.weight
        self.probe = nn.Linear(D, 1) if spec.probe else None
        self.value: torch.Tensor | None = None

    def forward(self, x, targets=None):
        h = self.stem(x)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if self.spec.shared == i:
                h = block(h)
        h = self.final_norm(h)
        if self.probe is not None:  # as an actor-critic's value head: before the policy head
            self.value = self.probe(h)
        out = self.head(h)
        aux = self.aux_loss()
        if targets is None:
            return out if aux is None else (out, aux)
        loss = F.cross_entropy(out.view(-1, V), targets.view(-1))
        return loss if aux is None else loss + 0.1 * aux

    def aux_loss(self) -> torch.Tensor | None:
        """The MoE routers' load-balancing losses and the probe's (its values' mean square)."""
        auxes = [m.aux for m in self.modules() if isinstance(m, Moe) and m.aux is not None]
        if self.probe is not None:
            auxes.append(self.value.square().mean())
        return sum(auxes) if auxes else None


def make_body(b: dict[str, Any]) -> nn.Module:
    kind = b["kind"]
    if kind == "mlp":
        return Mlp(b["act"], b["p"], b["zero_out"])
    if kind == "gated":
        return GatedMlp(b["act"], b["zero_out"])
    if kind == "attn":
        return Attention(b["p"], b["zero_out"])
    if kind == "conv":
        return Conv()
    if kind == "rnn":
        return Rnn(b["variant"])
    if kind == "plin":
        return ParamLinear(b["variant"])
    if kind == "fparam":
        return FunctionalWeight()
    if kind == "ema":
        return Ema(b["variant"] == "inplace")
    return Moe()


def draw_model(rng: random.Random, seed: int) -> ModelSpec:
    tokens = rng.random() < 0.5
    blocks = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(BLOCKS)
        b: dict[str, Any] = {"kind": kind, "norm": rng.choice(NORMS)}
        if kind in ("mlp", "gated"):
            b["act"] = rng.choice(ACTIVATIONS)
        if kind in ("mlp", "attn"):
            b["p"] = rng.choice((0.0, 0.0, 0.1, 0.3))
        if kind in ("mlp", "gated", "attn"):
            b["zero_out"] = rng.random() < 0.3
        if kind == "rnn":
            b["variant"] = rng.choice(("gru", "lstm"))
        if kind == "plin":
            b["variant"] = rng.choice(("weight_norm", "orthogonal", "spectral_norm"))
        if kind == "ema":
            b["variant"] = rng.choice(("inplace", "reassign"))
        blocks.append(b)
    head = rng.choice(("regress", "lm"))
    return ModelSpec(
        seed=seed,
        tokens=tokens,
        blocks=blocks,
        shared=rng.randrange(len(blocks)) if rng.random() < 0.25 else None,
        final_norm=rng.choice(NORMS),
        head=head,
        loss_inside=head == "lm" and rng.random() < 0.5,
        tied=head == "lm" and tokens and rng.random() < 0.5,
        probe=rng.random() < 0.25,
    )


def build(spec: ModelSpec) -> Model:
    """The model of ``spec``, its initial values from ``spec.seed`` (the same model each call)."""
    torch.manual_seed(spec.seed)
    return Model(spec)


def make_batch(spec: ModelSpec, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if spec.tokens:
        x = torch.randint(0, V, (B, T), generator=g)
    else:
        x = torch.randn(B, T, D, generator=g)
    if spec.head == "lm":
        y = torch.randint(0, V, (B, T), generator=g)
    else:
        y = torch.randn(B, T, 2, generator=g)
    return x, y


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The training loss: the model's own (cross-entropy inside its forward) or one outside it
    (MSE, or cross-entropy on the logits), plus the MoE router's auxiliary loss."""
    x, y = batch
    spec = model.spec
    if spec.loss_inside:
        return model(x, y)
    out = model(x)
    out, aux = out if isinstance(out, tuple) else (out, None)
    if spec.head == "lm":
        loss = F.cross_entropy(out.reshape(-1, V), y.reshape(-1))
    else:
        loss = F.mse_loss(out, y)
    return loss if aux is None else loss + 0.1 * aux


# --------------------------------------------------------------------------- configs


@dataclass
class ConfigSpec:
    config: dict[str, Any]
    head_exact: str | None = None  # how the head is kept exact: exclude / override / set_bits
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        c = self.config
        q = c.get("quantize", {})
        parts = [f"q{q.get('bits', 32)}"]
        if q.get("exclude"):
            parts.append("ex" + "+".join(q["exclude"]).replace("*", "all"))
        if q.get("overrides"):
            parts.append("ov" + "+".join(f"{k}={v}" for k, v in q["overrides"].items()))
        if self.head_exact == "set_bits":
            parts.append("set_bits(head,32)")
        rc = c.get("recompute", {})
        if rc.get("modules"):
            parts.append("rc" + "+".join(rc["modules"]))
        if rc.get("types"):
            parts.append("rc" + "+".join(rc["types"]))
        if c.get("dropout", {}).get("mode", "keep") != "keep":
            parts.append(c["dropout"]["mode"])
        if c.get("batchnorm", {}).get("mode") == "running":
            parts.append("bnrun")
        if c.get("ops"):
            parts.append("lean")
        if c.get("drift", {}).get("enabled"):
            parts.append("drift")
        return "-".join(parts)


def draw_config(rng: random.Random, spec: ModelSpec) -> ConfigSpec:
    names = [f"blocks.{i}" for i in range(len(spec.blocks))]
    bits = rng.choice((2, 4, 8, 16, 32, 32))
    quantize: dict[str, Any] = {
        "bits": bits,
        "min_numel": rng.choice((0, 0, 16)),
        "group_size": rng.choice((8, 64, 256)),
        "rounding": rng.choice(("stochastic", "nearest")),
        "seed": rng.randrange(1000),
    }
    spec_ = ConfigSpec(config={"quantize": quantize})
    r = rng.random()
    if r < 0.15:
        quantize["exclude"] = ["*"]
    elif r < 0.45:
        spec_.head_exact = rng.choice(("exclude", "override", "set_bits"))
        if spec_.head_exact == "exclude":
            quantize["exclude"] = ["head"]
        elif spec_.head_exact == "override":
            quantize["overrides"] = {"head": 32}
    elif r < 0.6:
        quantize["overrides"] = {rng.choice(names): rng.choice((2, 4, 8, 16, 32))}
    recompute = rng.random()
    if recompute < 0.3:
        spec_.config["recompute"] = {"modules": rng.sample(names, rng.randint(1, len(names)))}
    elif recompute < 0.4:
        types = ["Linear", "Block"] + ["Mlp"] * any(b["kind"] == "mlp" for b in spec.blocks)
        spec_.config["recompute"] = {"types": [rng.choice(types)]}
    spec_.config["dropout"] = {"mode": rng.choice(("keep", "bitmask", "regenerate"))}
    spec_.config["batchnorm"] = (
        {"mode": "batch"}
        if rng.random() < 0.7
        else {
            "mode": "running",  # with batch statistics until warmup ends: not in these few steps
            "warmup_steps": 1000,
        }
    )
    if rng.random() < 0.4:  # as configs/lean.yaml turns them on
        spec_.config["ops"] = {"loss": "chunked", "cross_entropy": "lean", "fuse": ["all"]}
    # sgd's cost is a share of a step's progress, below 1: at threshold 1.0 nothing escalates
    spec_.config["drift"] = {
        "enabled": rng.random() < 0.5,
        "metric": "sgd",
        "threshold": 1.0,
        "check_every": 1,
        "sample_size": rng.choice((2, 4)),
    }
    return spec_


@dataclass
class Case:
    seed: int
    model: ModelSpec
    config: ConfigSpec

    @property
    def id(self) -> str:
        return f"{self.seed}-{self.model.summary()}-{self.config.summary()}"


def draw_case(seed: int) -> Case:
    rng = random.Random(seed)
    spec = draw_model(rng, seed)
    return Case(seed, spec, draw_config(rng, spec))
