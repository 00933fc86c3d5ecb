"""Validated memopt configuration: frozen pydantic models and :func:`load_config`.

The schema is a public contract (docs/configuration.md). Every key has a default, so the empty
file, the empty dict and ``None`` are all valid and change nothing. Bad input is never ignored:
every problem becomes one line of a :class:`ConfigError` that names the key path, the value given
and what is allowed (and, for a typo, the closest valid key): :mod:`.config_io` reads the YAML and
words the messages.
"""

from __future__ import annotations

import os
import re
import typing
from collections.abc import Mapping
from importlib import resources
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from . import presets
from .config_io import Allowed, ConfigError, closest, config_error, dump_yaml, read_yaml, show

__all__ = ["ConfigError", "MemOptConfig", "load_config"]


# --------------------------------------------------------------------------- field types


def _list_to_tuple(value: Any) -> Any:
    # Lists (from YAML or Python) are stored as tuples so a frozen config is immutable all the way.
    return tuple(value) if isinstance(value, list) else value


def _glob_list(value: Any) -> Any:
    if isinstance(value, str):
        raise ValueError(f"a single string, not a list; write a list: [{value!r}]")
    return _list_to_tuple(value)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})
_UNITS.update({"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40})


def memory_bytes(text: str) -> int:
    """``6GiB``, ``512MiB``, ``1.5G`` (binary), ``8GB`` (decimal) or a number of bytes; raises
    ``ValueError`` for anything else or for less than one byte."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{text!r} is not an amount of memory: e.g. 6GiB, 512MiB, 1.5G or 8000000000"
        )
    value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"{text} is no memory at all")
    return value


def _memory(value: Any) -> Any:
    # quantize.memory: text is an amount of memory ("6MiB"), read into bytes.
    if isinstance(value, bool):
        raise ValueError("true/false is not an amount of memory")
    return memory_bytes(value) if isinstance(value, str) else value


def _fraction_not_memory(value: Any) -> Any:
    # quantize.budget is a fraction only: an amount of memory written there points to its key
    # (a number written as text is left to the general advice: write it as a plain number).
    number = isinstance(value, int) and not isinstance(value, bool) and value > 1
    if number or (isinstance(value, str) and not re.fullmatch(r"\s*[0-9.]+\s*", value)):
        raise ValueError(f"an amount of memory is quantize.memory's: write memory: {value!r}")
    return value


#: The fewest bytes ``quantize.memory`` takes (an integer below is a slip, not a target).
MIN_MEMORY_BYTES = 1024

Bits = Literal[2, 4, 8, 16, 32]
#: Bits at which nothing is compressed: the top of every ladder, "off".
OFF_BITS = 32
#: Bits of a plain half-precision (bfloat16) copy.
HALF_BITS = 16
BITS_CHOICES: tuple[int, ...] = typing.get_args(Bits)
_BITS_TEXT = "2, 4, 8, 16 (half cast) or 32 (off)"


def checked_bits(bits: Any) -> int:
    """``bits`` as an ``int`` when it is a width memopt stores at (:data:`BITS_CHOICES`), else
    ``ValueError``: a module's bits are checked where they are set, not at its next forward."""
    if isinstance(bits, bool) or not isinstance(bits, int | float) or bits not in BITS_CHOICES:
        raise ValueError(f"bits must be one of {_BITS_TEXT}; got {bits!r}")
    return int(bits)


NonEmptyStr = Annotated[str, Field(min_length=1)]
GlobList = Annotated[
    tuple[NonEmptyStr, ...],
    BeforeValidator(_glob_list),
    Allowed("a list of non-empty module-name globs, e.g. ['*.mlp', 'blocks.*.ff']"),
]
ClassNameList = Annotated[
    tuple[NonEmptyStr, ...],
    BeforeValidator(_glob_list),
    Allowed("a list of non-empty module class names, e.g. ['GELU', 'LayerNorm']"),
]
Fraction = Annotated[float, Field(gt=0, le=1), Allowed("a number in (0, 1]")]
NonNegativeInt = Annotated[int, Field(ge=0), Allowed("an integer >= 0")]
PositiveInt = Annotated[int, Field(ge=1), Allowed("an integer >= 1")]


def _optional_field(section: str, names: str) -> Any:
    """The ``optional`` key of a section that names parts of a model (recompute, quantize, ops):
    what it names that the model lacks is refused by default, skipped (logged) when true."""
    return Field(
        False,
        description=(
            f"false: {names} that this model does not have is a ConfigError. true: it is "
            "skipped with one INFO line and the rest of the section applies (for a config meant "
            f"for many models, as the presets that set {section}.optional are)."
        ),
    )


class _Section(BaseModel):
    """Base of every config model: frozen, unknown keys rejected, no silent type coercion.

    ``strict`` keeps YAML mistakes visible: ``bits: "8"`` or ``enabled: 1`` is an error, not a
    guess. Build configs from data with :meth:`MemOptConfig.from_dict` / ``from_yaml`` /
    ``with_changes``, which raise :class:`ConfigError`; calling a model class directly raises
    pydantic's ``ValidationError`` (also a ``ValueError``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# --------------------------------------------------------------------------- sections


class AutoRecomputeConfig(_Section):
    """The recompute planner: pick modules to recompute until a memory budget is met."""

    budget: Fraction = Field(
        0.5,
        description=(
            "Keep at most this fraction of the baseline saved-activation bytes; the planner "
            "recomputes the modules with the most bytes saved per operation of recompute first."
        ),
    )


class RecomputeConfig(_Section):
    """Selective activation checkpointing: recompute these modules in backward."""

    modules: GlobList = Field(
        (),
        description=(
            "Module-name globs over model.named_modules() whose activations are recomputed in "
            "backward instead of stored, e.g. ['*.mlp', 'blocks.*.ff']."
        ),
    )
    types: ClassNameList = Field(
        (), description="Module class names to recompute, e.g. ['GELU', 'LayerNorm']."
    )
    auto: Annotated[
        AutoRecomputeConfig | None,
        Allowed("null (planner off) or a mapping {budget: b} with 0 < b <= 1"),
    ] = Field(
        None,
        description=(
            "null: recompute only what modules/types name. {budget: b}: the planner also picks "
            "modules so that at most the fraction b of the baseline saved bytes is kept."
        ),
    )
    optional: Annotated[bool, Allowed("true or false")] = _optional_field(
        "recompute", "a glob of modules or a class name of types that matches no module"
    )


class QuantizeConfig(_Section):
    """Compression of saved activations to fewer bits (per-group scale, bit-packed)."""

    bits: Annotated[Bits, Allowed(_BITS_TEXT)] = Field(
        32,
        description=(
            "Bit width for the selected modules: 2, 4 or 8 (quantized), 16 (half cast) or 32 "
            "(off, the default)."
        ),
    )
    modules: GlobList = Field(
        ("*",), description="Module-name globs whose activations are compressed."
    )
    exclude: GlobList = Field(
        (), description="Module-name globs never compressed (wins over modules and overrides)."
    )
    overrides: Annotated[
        dict[NonEmptyStr, Bits],
        Allowed(f"a mapping {{module-name glob: bits}} with bits {_BITS_TEXT}"),
    ] = Field(
        default_factory=dict,
        description="Per-module bit widths, {module-name glob: bits}; the last matching glob wins.",
    )
    group_size: Annotated[
        int, Field(gt=0, multiple_of=8), Allowed("a positive multiple of 8, e.g. 128 or 256")
    ] = Field(256, description="Elements sharing one minimum and scale.")
    rounding: Literal["stochastic", "nearest"] = Field(
        "stochastic",
        description=(
            "stochastic: unbiased (the expected decoded value is the input); nearest: "
            "deterministic, lower error per value but biased."
        ),
    )
    min_numel: NonNegativeInt = Field(
        4096, description="Saved tensors with fewer elements are kept as they are."
    )
    seed: NonNegativeInt | None = Field(
        None,
        description=(
            "Seed of the stochastic-rounding noise; null: torch.initial_seed() at apply (so "
            "torch.manual_seed or seed_everything before apply reproduces a run). Under "
            "torch.distributed it is mixed with the rank: each rank draws its own noise."
        ),
    )
    budget: Annotated[
        Fraction | None,
        BeforeValidator(_fraction_not_memory),
        Allowed("null or a fraction in (0, 1], e.g. 0.25"),
    ] = Field(
        None,
        description=(
            "A memory target as a fraction of the saved bytes uncompressed: the bits are solved "
            "for it at every drift check, the widths (from drift.ladder) that minimise the summed "
            "squared predicted drift with the bytes kept for backward within it, each module's "
            "drift still capped by drift.threshold (the threshold wins; the log says by how much "
            "the target is missed and which modules stopped it). With memory too, the tighter of "
            "the two is the target. null: no fraction (with memory null too, the bits stay as "
            "configured, and drift only escalates, or with drift.lower comes back down)."
        ),
    )
    memory: Annotated[
        Annotated[int, Field(ge=MIN_MEMORY_BYTES)] | None,
        BeforeValidator(_memory),
        Allowed(f"null, bytes (an integer >= {MIN_MEMORY_BYTES}) or text such as '6MiB', '512MB'"),
    ] = Field(
        None,
        description=(
            "A memory target as an amount of memory: the bytes a training forward keeps for "
            "backward, solved for as budget is (with budget too, the tighter of the two is the "
            "target). It is priced from a training forward's counts: a check before any waits "
            "(logged). null: no amount."
        ),
    )
    optional: Annotated[bool, Allowed("true or false")] = _optional_field(
        "quantize", "a glob of modules, exclude or overrides that matches no module"
    )

    @property
    def targets_memory(self) -> bool:
        """Whether the bits are solved for a memory target (``budget`` or ``memory``)."""
        return self.budget is not None or self.memory is not None


class DriftConfig(_Section):
    """Gradient-drift monitoring: compare compressed and exact gradients, escalate bits."""

    enabled: Annotated[bool, Allowed("true or false")] = Field(
        True, description="Run the check (only meaningful when something is below 32 bits)."
    )
    threshold: Fraction = Field(
        0.05,
        description="A module whose drift (by `metric`) exceeds this escalates.",
    )
    metric: Literal["sgd", "rel_l2", "cosine", "noise"] = Field(
        "sgd",
        description=(
            "sgd: the share of a training step's progress that compression costs, from its "
            "error against the gradient's own sampling noise and the gradient noise scale at "
            "the training batch (0.05: at most 5% more steps to the same loss). rel_l2: "
            "|g_q - g| / |g| (strict: in practice 8 bits); cosine: 1 - cos(g_q, g); noise: "
            "|g_q - g|^2 / the sampling variance of g (0.05: about the noise of a 5% smaller "
            "batch)."
        ),
    )
    check_every: PositiveInt = Field(
        100, description="Optimizer steps between checks; the first check runs at step 0."
    )
    sample_size: PositiveInt = Field(8, description="Samples sliced from the batch for the check.")
    ladder: Annotated[
        tuple[Bits, ...],
        BeforeValidator(_list_to_tuple),
        Allowed("a strictly increasing list of bit widths from {2, 4, 8, 16, 32} ending at 32"),
    ] = Field(
        (2, 4, 8, 16, 32),
        description="Bit widths a drifting module climbs, one rung per escalation.",
    )
    lower: Annotated[bool, Allowed("true or false")] = Field(
        False,
        description=(
            "Bring bits back down: a module whose drift one rung lower is predicted (and then "
            "measured by a probe pass) under `lower_below` x threshold for `lower_after` checks "
            "in a row goes down one rung, never below its starting bits; false: escalation only."
        ),
    )
    lower_below: Fraction = Field(
        0.5, description="The fraction of the threshold a lowered module's drift must stay under."
    )
    lower_after: PositiveInt = Field(
        2,
        description=(
            "Consecutive calm checks before a module goes down; doubled (up to 8x) each time a "
            "lowering fails (its probe or a later check comes back over the threshold)."
        ),
    )
    lower_changes: Annotated[int, Field(ge=2)] = Field(
        4,
        description=(
            "Most width changes a module makes in a run where lowering is concerned: it is not "
            "lowered when the lowering and a return over the threshold would take its changes "
            "past this (escalation still acts: the threshold is a hard cap)."
        ),
    )

    @field_validator("ladder")
    @classmethod
    def _ladder_climbs_to_32(cls, ladder: tuple[int, ...]) -> tuple[int, ...]:
        if any(a >= b for a, b in zip(ladder, ladder[1:], strict=False)):
            raise ValueError("values must be strictly increasing")
        if not ladder or ladder[-1] != 32:
            raise ValueError("the last rung must be 32")
        return ladder


class DropoutConfig(_Section):
    """How dropout keeps its mask for backward."""

    mode: Literal["keep", "bitmask", "regenerate"] = Field(
        "keep",
        description=(
            "keep: nn.Dropout unchanged; bitmask: the mask stored at 1 bit per element; "
            "regenerate: only a seed is stored and the mask rebuilt in backward."
        ),
    )


class BatchNormConfig(_Section):
    """Which statistics BatchNorm normalizes with in training."""

    mode: Literal["batch", "running"] = Field(
        "batch",
        description=(
            "batch: standard BatchNorm; running: normalize with the running mean/var, so "
            "backward needs no batch statistics."
        ),
    )
    warmup_steps: NonNegativeInt = Field(
        0, description="Steps with batch statistics before switching to running ones."
    )


FUSED_CHAINS = (
    "mlp", "gelu", "swiglu", "geglu", "rmsnorm", "layernorm", "attention", "batchnorm", "conv",
    "relu", "maxpool",
)  # fmt: skip


class OpsConfig(_Section):
    """Memory-lean operations (memopt_plugins.lean): exact, each saving only its inputs."""

    loss: Literal["none", "chunked"] = Field(
        "none",
        description=(
            "chunked: a Hugging Face causal LM's loss head and cross-entropy run in chunks of "
            "tokens in training with labels (the full logits are never made; `logits` is None "
            "then); none: the model's own loss."
        ),
    )
    cross_entropy: Literal["none", "lean"] = Field(
        "none",
        description=(
            "lean: F.cross_entropy called inside the model's forward (nanoGPT-style heads) runs "
            "lean in training: on the unchanged output of an nn.Linear head, as the chunked "
            "loss head (no logits kept); on other logits, keeping them once (compressed) with "
            "the gradient written into them. Class weights and probability targets run "
            "F.cross_entropy itself. With it, loss: chunked on a model that is no Hugging Face "
            "causal LM is no error. none: F.cross_entropy as it is."
        ),
    )
    chunk_size: Annotated[int | None, Field(ge=1), Allowed("null or an integer >= 1")] = Field(
        None,
        description="Tokens per chunk (null: chunks of logits about the hidden states' size).",
    )
    no_cache: bool = Field(
        True,
        description=(
            "true: while another ops key acts (loss, cross_entropy or fuse), a Hugging Face "
            "model's config.use_cache is False, so training builds no KV cache (as transformers' "
            "gradient checkpointing does); remove() restores it. false: left as it is."
        ),
    )
    fuse: Annotated[
        tuple[
            Literal[
                "all",
                "mlp",
                "gelu",
                "swiglu",
                "geglu",
                "rmsnorm",
                "layernorm",
                "attention",
                "batchnorm",
                "conv",
                "relu",
                "maxpool",
            ],
            ...,
        ],
        BeforeValidator(_glob_list),
        Allowed(f"a list of {', '.join(FUSED_CHAINS)}, or [all]"),
    ] = Field(
        (),
        description=(
            "Activation and norm chains swapped for one node that saves its inputs: mlp (an MLP "
            "block, gated or GPT-2's, over chunks of as many tokens as its width: its wide "
            "tensors exist one chunk at a time; a gated one with the lean product), gelu "
            "(tanh-GELU written in Python, as GPT-2's), swiglu and geglu (Llama/Gemma-style "
            "gated MLPs), rmsnorm (Llama-style RMSNorm), layernorm (F.layer_norm inside the "
            "model: a projection that saves its output keeps a recipe over the norm's compressed "
            "input), attention (a Hugging Face model's eager "
            "attention as scaled_dot_product_attention; not with attention dropout), batchnorm "
            "(BatchNorm1d/2d/3d in training: its backward writes into the decoded input), conv "
            "(zero-padded Conv1d/2d/3d: backward in pieces of the batch, the input's gradient "
            "written into the decoded input), relu (nn.ReLU: its gradient written into the decoded "
            "output), maxpool (MaxPool1d/2d/3d saving only where each argmax sits in its window, "
            "in 1-8 bits). A chain named here must match a module of the model; [all]: every "
            "chain the model has."
        ),
    )
    optional: Annotated[bool, Allowed("true or false")] = _optional_field(
        "ops",
        "loss: chunked where no loss head can be reached, or a fuse chain (or attention that "
        "cannot switch) that matches no module,",
    )


class LogConfig(_Section):
    """Which ``memopt/*`` metrics go to the framework's loggers (a compact set by default)."""

    per_module: bool = Field(
        False,
        description=(
            "Also log one series per compressed module: its bits when they change "
            "(memopt/bits/<module>) and its drift at each check (memopt/drift/<module>)."
        ),
    )


# --------------------------------------------------------------------------- top level


class MemOptConfig(_Section):
    """The whole memopt config: one section per technique (docs/configuration.md).

    A section written with nothing under it (``quantize:`` with every key commented out, i.e.
    null) means that section's defaults.
    """

    recompute: RecomputeConfig = Field(
        default_factory=RecomputeConfig, description="Selective activation recompute."
    )
    quantize: QuantizeConfig = Field(
        default_factory=QuantizeConfig, description="Activation compression."
    )
    drift: DriftConfig = Field(
        default_factory=DriftConfig, description="Gradient-drift check and escalation."
    )
    dropout: DropoutConfig = Field(default_factory=DropoutConfig, description="Dropout masks.")
    batchnorm: BatchNormConfig = Field(
        default_factory=BatchNormConfig, description="BatchNorm statistics."
    )
    ops: OpsConfig = Field(default_factory=OpsConfig, description="Memory-lean operations.")
    log: LogConfig = Field(default_factory=LogConfig, description="Metrics sent to loggers.")

    # The name of the preset the settings were loaded from, for display only: what a setting
    # means never depends on it (a preset that serves many models says so with `optional`).
    _preset: str | None = PrivateAttr(None)

    def __eq__(self, other: object) -> bool:  # the settings decide, not where they came from
        return type(other) is type(self) and self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash(self.to_yaml())

    @property
    def preset(self) -> str | None:
        """The name of the preset this config was loaded from (kept by :meth:`with_changes`)."""
        return self._preset

    @classmethod
    def from_preset(cls, name: str) -> MemOptConfig:
        """The preset ``name`` (``memopt presets`` lists them), e.g. ``"int4_drift"``."""
        found = presets.path(name)
        if found is None:
            known = presets.names()
            guess = closest(name, known, n=1)
            hint = f" Did you mean {guess[0]!r}?" if guess else ""
            raise ConfigError(
                f"no memopt preset named {name!r}.{hint} Presets: {', '.join(known)} "
                "(`memopt presets` says what each is for); a path to a YAML file works too"
            )
        with resources.as_file(found) as file:
            return cls._validate(read_yaml(file), f"invalid memopt preset {name}")._as_preset(name)

    def _as_preset(self, name: str) -> MemOptConfig:
        self._preset = name
        return self

    @field_validator(
        "recompute", "quantize", "drift", "dropout", "batchnorm", "ops", "log", mode="before"
    )
    @classmethod
    def _null_section_is_default(cls, value: Any) -> Any:
        return {} if value is None else value

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> MemOptConfig:
        """Validate a dict in the YAML schema (``None`` or ``{}`` gives the defaults)."""
        return cls._validate(data, "invalid memopt config")

    @model_validator(mode="after")
    def _budget_needs_drift_checks(self) -> MemOptConfig:
        if self.quantize.targets_memory and not self.drift.enabled:
            key = "quantize.budget" if self.quantize.budget is not None else "quantize.memory"
            raise ValueError(f"{key} is solved at each drift check: it needs drift.enabled true")
        return self

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> MemOptConfig:
        """Load and validate a YAML file; an empty file gives the defaults. A preset's own file
        (``configs/int4_drift.yaml`` in the repository) loads as that preset."""
        config = cls._validate(read_yaml(path), f"invalid memopt config in {os.fspath(path)}")
        name = presets.name_of(path)
        return config._as_preset(name) if name is not None else config

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of builtins (lists, not tuples) that YAML and JSON can write."""
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        """The config as YAML text that :meth:`from_yaml` reads back to an equal config."""
        return dump_yaml(self.to_dict())

    def with_changes(self, **section_updates: Mapping[str, Any] | BaseModel | None) -> MemOptConfig:
        """A validated copy with some keys changed, e.g. ``cfg.with_changes(quantize={"bits": 4})``.

        A mapping updates only the keys it names; a section model replaces the section; ``None``
        resets the section to its defaults.
        """
        data = self.to_dict()
        for section, update in section_updates.items():
            if isinstance(update, BaseModel):
                data[section] = update.model_dump(mode="json")
            elif isinstance(update, Mapping) and isinstance(data.get(section), dict):
                data[section] = {**data[section], **update}
            else:
                data[section] = update
        changed = self.from_dict(data)
        changed._preset = self._preset
        return changed

    @classmethod
    def _validate(cls, data: Any, header: str) -> MemOptConfig:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"{header}: the top level must be a mapping of sections "
                f"({', '.join(cls.model_fields)}); got {show(data)}"
            )
        try:
            return cls.model_validate(dict(data))
        except ValidationError as err:
            raise config_error(err, cls, header) from None


def is_preset_name(text: str) -> bool:
    """A bare name (``"int4_drift"``): no folder and no ``.yaml``/``.yml`` suffix. Anything else
    is a path to a YAML file."""
    return not any(sep in text for sep in ("/", os.sep)) and not text.endswith((".yaml", ".yml"))


def load_config(
    config: MemOptConfig | Mapping[str, Any] | str | os.PathLike[str] | None,
) -> MemOptConfig:
    """A :class:`MemOptConfig` from a config (returned as is), a dict, a preset's name
    (``"int4_drift"``), a YAML path or ``None``."""
    if isinstance(config, MemOptConfig):
        return config
    if config is None or isinstance(config, Mapping):
        return MemOptConfig.from_dict(config)
    if isinstance(config, str) and is_preset_name(config):
        return MemOptConfig.from_preset(config)
    if isinstance(config, str | os.PathLike):
        stem = os.path.splitext(os.path.basename(os.fspath(config)))[0]
        if not os.path.exists(config) and presets.path(stem) is not None:
            raise ConfigError(
                f"config file not found: {os.fspath(config)}; memopt has a preset named "
                f"{stem!r}: pass {stem!r} to load it by name"
            )
        return MemOptConfig.from_yaml(config)
    raise ConfigError(
        "a memopt config must be a MemOptConfig, a dict, a preset's name, a path to a YAML file "
        f"or None; got {show(config)}"
    )
