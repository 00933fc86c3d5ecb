"""Reading and writing memopt's YAML configs, and the messages for configs that cannot be used.

The lower half of :mod:`memopt_plugins.config`: the YAML loader (which rejects a key written twice),
the writer (lists inline, as the presets have them), :class:`ConfigError` and the one-line-per-
problem message built from a pydantic ``ValidationError``, naming the key path, the value given,
what is allowed (:class:`Allowed` metadata on a field) and, for a typo, the closest valid key.
"""

from __future__ import annotations

import difflib
import numbers
import os
import reprlib
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo


class ConfigError(ValueError):
    """A config that cannot be used. The message is written for a person reading a traceback.

    Attributes:
        problems: one line per problem found (all of them, not only the first).
    """

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems: tuple[str, ...] = tuple(problems) or (message,)


def closest(name: str, candidates: Iterable[str], n: int = 3, cutoff: float = 0.6) -> list[str]:
    """The up to ``n`` candidates most similar to ``name``, best first (difflib ratio >= cutoff)."""
    return difflib.get_close_matches(name, list(candidates), n=n, cutoff=cutoff)


@dataclass(frozen=True)
class Allowed:
    """Field metadata: what a valid value looks like, quoted in error messages."""

    text: str


# --------------------------------------------------------------------------- YAML


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects a key written twice in one mapping (PyYAML keeps the last
    one silently, which would hide a mistake)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _FlowListDumper(yaml.SafeDumper):
    """Writes lists inline (``ladder: [2, 4, 8, 16, 32]``), as the presets do."""


_FlowListDumper.add_representer(
    list,
    lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True),
)


def dump_yaml(data: Any) -> str:
    """``data`` (builtins) as YAML text, keys in their order, lists inline."""
    return yaml.dump(data, Dumper=_FlowListDumper, sort_keys=False)


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """The YAML document in ``path``; :class:`ConfigError` for a missing or unreadable file or bad
    YAML (with its line and column)."""
    name = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {name}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {name}: {err}") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = err.problem or err.context or "syntax error"
        raise ConfigError(f"invalid YAML in {name}{where}: {problem}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"invalid YAML in {name}: {err}") from None


# --------------------------------------------------------------------------- error messages

_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60


def show(value: Any) -> str:
    """``'eight' (str)``: the value and its type, as a reader of the YAML would want them."""
    kind = "null" if value is None else type(value).__name__
    return f"{_repr.repr(value)} ({kind})"


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The config model a field holds (``AutoRecomputeConfig | None`` -> AutoRecomputeConfig)."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _resolve(
    root: type[BaseModel], loc: tuple[int | str, ...]
) -> tuple[str, FieldInfo | None, type[BaseModel] | None]:
    """Walk ``loc`` through the models: (key path text, deepest field, model still being walked).

    The model is ``None`` once the walk has left the models (list items, mapping keys).
    """
    parts: list[str] = []
    model: type[BaseModel] | None = root
    field: FieldInfo | None = None
    for step in loc:
        if model is not None and isinstance(step, str) and step in model.model_fields:
            field = model.model_fields[step]
            parts.append(step)
            model = _model_in(field.annotation)
        else:
            model = None
            if step == "[key]":
                suffix = " (mapping key)"
            elif isinstance(step, int):
                suffix = f"[{step}]"
            else:
                suffix = f"[{step!r}]"
            parts[-1:] = [(parts[-1] if parts else "") + suffix]
    return ".".join(parts) or "config", field, model


def _allowed(field: FieldInfo | None) -> str | None:
    if field is None:
        return None
    texts = [m.text for m in field.metadata if isinstance(m, Allowed)]
    if texts:
        return texts[-1]
    model = _model_in(field.annotation)
    if model is not None:
        return f"a mapping with keys {', '.join(model.model_fields)}"
    choices = _literal_choices(field)
    if choices:
        return "one of " + ", ".join(repr(c) for c in choices)
    return None


def _literal_choices(field: FieldInfo) -> tuple[Any, ...]:
    if typing.get_origin(field.annotation) is Literal:
        return typing.get_args(field.annotation)
    return ()


def _problem_line(root: type[BaseModel], error: Any) -> str:
    loc = tuple(error["loc"])
    kind = error["type"]
    if kind == "extra_forbidden":
        parent, _, model = _resolve(root, loc[:-1])
        key = str(loc[-1])
        path = f"{parent}.{key}" if parent != "config" else key
        keys = list(model.model_fields) if model is not None else []
        guess = closest(key, keys, n=1)
        hint = f" Did you mean {guess[0]!r}?" if guess else ""
        return f"{path}: unknown key.{hint} Allowed keys: {', '.join(keys)}"

    if not loc and kind == "value_error":  # a rule across sections
        return f"config: {error['ctx']['error']}"
    path, field, _ = _resolve(root, loc)
    value = error.get("input")
    line = f"{path}: got {show(value)}"
    if kind == "value_error":
        line += f" - {error['ctx']['error']}"
    allowed = _allowed(field)
    line += f"; allowed: {allowed}" if allowed else f"; {error['msg'].lower()}"
    if isinstance(value, str) and field is not None:
        choices = [c for c in _literal_choices(field) if isinstance(c, str)]
        guess = closest(value, choices, n=1)
        if guess:
            line += f". Did you mean {guess[0]!r}?"
        elif not choices and kind != "value_error":  # the key's own reader took the text
            line += _number_advice(field.annotation, value)
    return line


def _number_advice(annotation: Any, text: str) -> str:
    """How to write numbers given as text, in the form the key takes: a list for a list key
    (``ladder: "4, 8"``), a plain number for a number key; nothing where neither fits."""
    if _takes(annotation, (list, tuple, Sequence)):
        parts = text.replace(",", " ").split()
        if parts and all(_is_number(p) for p in parts):
            return f". Write it as a list: [{', '.join(_plain_number(p) for p in parts)}]"
        return ""
    if _takes(annotation, (int, float)) and _is_number(text):
        return f". Write it as a plain number: {_plain_number(text)}"
    return ""


def _takes(annotation: Any, kinds: tuple[type, ...]) -> bool:
    """Whether a value of one of ``kinds`` fits ``annotation`` (through unions and literals)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:  # a constrained type (Fraction): the type it constrains
        return _takes(typing.get_args(annotation)[0], kinds)
    if origin is Literal:
        return any(
            isinstance(c, kinds) and not isinstance(c, bool) for c in typing.get_args(annotation)
        )
    if origin is typing.Union or origin is types.UnionType:
        return any(_takes(a, kinds) for a in typing.get_args(annotation))
    target = origin if origin is not None else annotation
    return isinstance(target, type) and issubclass(target, kinds)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _plain_number(text: str) -> str:
    # PyYAML reads 5e-2 (no dot) and quoted numbers as text; repr gives a form it reads as a number.
    number = float(text)
    return repr(int(number)) if number.is_integer() and "." not in text else repr(number)


def config_error(err: ValidationError, root: type[BaseModel], header: str) -> ConfigError:
    """A :class:`ConfigError` with one line per problem of ``err`` (validating model ``root``)."""
    lines = [_problem_line(root, e) for e in err.errors(include_url=False)]
    noun = "problem" if len(lines) == 1 else "problems"
    message = f"{header} ({len(lines)} {noun}):\n" + "\n".join(f"  {line}" for line in lines)
    return ConfigError(message, lines)


# --------------------------------------------------------------------------- saved state
@contextmanager
def reading_state(key: str) -> Iterator[None]:
    """Inside it, the part ``key`` of a saved state (``state_dict()``) is read: a value of the
    wrong type or shape becomes a :class:`ConfigError` naming ``state_dict <key>``."""
    try:
        yield
    except ConfigError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, RuntimeError) as err:
        raise ConfigError(f"state_dict {key}: {err}") from err


def state_map(value: Any) -> dict[str, Any]:
    """``value``, a mapping with string keys, as a dict (``TypeError`` otherwise)."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"expected a mapping with string keys, got {show(value)}")
    return dict(value)


def state_count(value: Any) -> int:
    """``value``, an integer >= 0 (a counter), as an ``int`` (``ValueError`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"expected an integer >= 0, got {show(value)}")
    return int(value)


def state_list(value: Any) -> list[Any]:
    """``value``, a list or tuple, as a list (``TypeError`` otherwise: a string is no list)."""
    if not isinstance(value, list | tuple):
        raise TypeError(f"expected a list, got {show(value)}")
    return list(value)


def state_name(value: Any) -> str:
    """``value``, a module name (``TypeError`` otherwise)."""
    if not isinstance(value, str):
        raise TypeError(f"expected a module name, got {show(value)}")
    return value
