"""A :class:`~memopt_plugins.MemoryOptimizer`'s saved state (``state_dict()``): read whole before
any of it is applied, and the rule for a checkpoint's bits that differ from the config's.

:func:`read_state` checks every part (bits: names and widths; the drift monitor's counters,
floors and history; the rounding generators, each set on a scratch generator; the recompute
plan) and raises one :class:`ConfigError` naming the key of a bad value. The engine lays a state
on a model only once it names no module the model lacks, so a load that fails changes nothing.

Resuming (:func:`resumed_bits`): the checkpoint's bits are what the drift guard learned, and they
win where the config gives a module the bits it gave when the checkpoint's run started. Where the
user changed a module's configured bits since, the config's win, with the guard's escalations on
top: a module the checkpoint holds above its old configured bits keeps them where they are higher
than the new ones. One INFO line says which won wherever the two differ.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .config import checked_bits
from .config_io import (
    ConfigError,
    closest,
    reading_state,
    state_count,
    state_list,
    state_map,
    state_name,
)
from .drift.monitor import DriftMonitor

#: The parts of a saved state, each optional.
KEYS = ("bits", "drift", "noise", "recompute")


@dataclass(frozen=True)
class SavedState:
    """A state read by :func:`read_state`; ``None``: the part was not saved."""

    bits: dict[str, int] | None
    drift: DriftMonitor | None  # a scratch monitor holding the drift state
    noise: dict[str, Any] | None
    recompute: list[str] | None

    @property
    def modules(self) -> set[str]:
        """Every module the state names."""
        named = set(self.bits or ()) | set(self.recompute or ())
        return named | (self.drift.modules if self.drift is not None else set())

    def state_dict(self) -> dict[str, Any]:
        """The state as :meth:`MemoryOptimizer.state_dict` writes it (plain Python types)."""
        parts = {
            "bits": None if self.bits is None else dict(self.bits),
            "drift": None if self.drift is None else self.drift.state_dict(),
            "noise": copy.deepcopy(self.noise),
            "recompute": None if self.recompute is None else list(self.recompute),
        }
        return {k: v for k, v in parts.items() if v is not None}


def read_state(state: Any, monitor: DriftMonitor, auto: bool) -> SavedState:
    """``state`` read whole (``monitor`` reads the drift part; ``auto``: the config has
    ``recompute.auto``, which a recompute plan needs). Raises :class:`ConfigError` naming the key
    of the first bad value; nothing is applied."""
    with reading_state("(the whole state)"):
        state = state_map(state)
    unknown = sorted(set(state) - set(KEYS))
    if unknown:
        near = closest(unknown[0], KEYS)
        raise ConfigError(
            f"state_dict: unknown key(s) {unknown}; a memopt state holds {', '.join(KEYS)}"
            + (f" (did you mean {near[0]!r}?)" if near else "")
        )
    bits = None
    if "bits" in state:
        with reading_state("bits"):
            saved = state_map(state["bits"])
        bits = {}
        for fqn, width in saved.items():
            with reading_state(f"bits[{fqn!r}]"):
                bits[fqn] = checked_bits(width)
    drift = monitor.read(state["drift"]) if "drift" in state else None
    noise = read_noise(state["noise"]) if "noise" in state else None
    recompute = None
    if "recompute" in state:
        if not auto:
            raise ConfigError(
                "state_dict holds a recompute plan, but this config has no recompute.auto"
            )
        with reading_state("recompute"):
            recompute = [state_name(f) for f in state_list(state["recompute"])]
    return SavedState(bits, drift, noise, recompute)


def read_noise(noise: Any) -> dict[str, Any]:
    """The rounding generators' state (``NoiseGenerators.state_dict`` and the rank that saved
    it), each generator's bytes set on a scratch generator first: a state torch would refuse is a
    :class:`ConfigError` naming its key before anything is restored."""
    with reading_state("noise"):
        noise = state_map(noise)
        generators = state_map(noise.get("generators", {}))
    with reading_state("noise.seed"):
        seed = noise["seed"]
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"expected an integer seed, got {type(seed).__name__}")
        torch.Generator().manual_seed(seed)
    with reading_state("noise.rank"):
        rank = state_count(noise.get("rank", 0))
    for device, encoded in generators.items():
        with reading_state(f"noise.generators[{device!r}]"):
            torch.device(device)
            if not isinstance(encoded, str):
                raise TypeError(f"expected base64 text, got {type(encoded).__name__}")
            raw = bytearray(base64.b64decode(encoded, validate=True))
            if not raw:
                raise ValueError("no generator state")
            torch.Generator().set_state(torch.frombuffer(raw, dtype=torch.uint8).clone())
    return {"rank": rank, "seed": seed, "generators": dict(generators)}


def resumed_bits(
    saved: Mapping[str, int],
    floors: Mapping[str, int] | None,
    configured: Mapping[str, int],
    compressed: Container[str],
) -> tuple[dict[str, int], dict[str, int], str | None]:
    """The bits a resume runs at, by the rule of the module notes.

    Args:
        saved: the checkpoint's bits.
        floors: the configured bits the checkpoint's run started from (its drift floors;
            ``None`` or a module missing: unknown, and the checkpoint's bits win).
        configured: the bits the config gives each module now.
        compressed: the modules compressed now (those outside it stay as the config has them).

    Returns:
        ``{fqn: bits}`` to set, ``{fqn: configured bits}`` of the modules whose configured bits
        changed (their new floor), and the INFO line on the differences (``None``: none).
    """
    bits: dict[str, int] = {}
    rebased: dict[str, int] = {}
    config_wins: list[str] = []
    checkpoint_wins: list[str] = []
    uncompressed: list[str] = []
    for fqn, was in saved.items():
        name = fqn or "<root>"
        if fqn not in compressed or fqn not in configured:
            uncompressed.append(name)
            continue
        now = configured[fqn]
        start = floors.get(fqn) if floors is not None else None
        if start is not None and start != now:  # the user changed it since the checkpoint
            rebased[fqn] = now
            bits[fqn] = was if was > start and was > now else now
        else:
            bits[fqn] = was
        if bits[fqn] != was:
            config_wins.append(f"{name} {was} -> {now}")
        elif was != now:
            checkpoint_wins.append(f"{name} {was} (config {now})")
    parts = []
    if config_wins:
        parts.append(
            f"the config's win for {_some(config_wins)} whose configured bits changed since "
            "the checkpoint"
        )
    if checkpoint_wins:
        parts.append(
            f"the checkpoint's win for {_some(checkpoint_wins)} that the drift guard or "
            "set_bits moved"
        )
    if uncompressed:
        parts.append(f"{_some(uncompressed)} stay uncompressed, as this config has them")
    if not parts:
        return bits, rebased, None
    return bits, rebased, "memopt: resuming, checkpoint bits differ: " + "; ".join(parts)


def _some(items: list[str]) -> str:
    """``"2 modules (a 4 -> 8, b 4 -> 8)"``, at most 4 of them named."""
    shown = ", ".join(items[:4]) + (", ..." if len(items) > 4 else "")
    return f"{len(items)} module{'s' if len(items) != 1 else ''} ({shown})"
