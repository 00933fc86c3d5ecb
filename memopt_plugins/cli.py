"""The ``memopt`` command.

``memopt profile --model FILE.py:factory [--config YAML] [--out DIR] [--top N]`` prints the
per-module memory table of one training step and writes ``DIR/report.md``, ``DIR/memory.png``,
``DIR/timeline.png`` (the step's memory over time) and ``DIR/report.json``. ``memopt plan
--model FILE.py:factory [--budget 0.4] [--memory 6GiB] [--optimizer adamw] [--bits N]`` prints a
config (YAML) that keeps the step's peak at most that fraction of the baseline's peak (or the
whole step, the optimizer's state included, under that cap, and then also the largest batch whose
whole training fits, drift checks included, read in fresh processes with the config and without
memopt), measured by running it: the modules the recompute
planner picks, plus compression at ``N`` bits, or at the bits needed when recompute alone cannot
reach it (:mod:`memopt_plugins.profiler.fit`). The factory takes no arguments and
returns ``(model, batch, loss_fn)`` with ``loss_fn(model, batch) -> scalar loss``.
``--config`` takes a preset's name or a YAML file; ``memopt presets`` lists the presets.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import presets
from .config import ConfigError, MemOptConfig, closest, load_config, memory_bytes
from .profiler import ProfileReport, profile_model, suggest_config
from .profiler.fit import plan_peak
from .profiler.ops import OpsEntry, suggest_ops
from .profiler.training import OPTIMIZERS, Training
from .tree import map_tensors

EXPECTED = (
    "a factory taking no arguments and returning (model, batch, loss_fn): model a "
    "torch.nn.Module, loss_fn(model, batch) -> scalar loss"
)


class CliError(Exception):
    """A problem with the command's input: printed as one message, exit status 2."""


# --------------------------------------------------------------------------- the factory


def _where(err: BaseException, path: Path) -> str:
    """`` (models.py, line 12)``: the innermost frame of the traceback inside ``path``."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if Path(f.filename) == path]
    return f" ({path.name}, line {frames[-1].lineno})" if frames else ""


def _raised_by_memopt(err: BaseException) -> bool:
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and Path(frames[-1].filename).parent == Path(__file__).parent


def load_factory(spec: str) -> Callable[[], Any]:
    """The callable named by ``FILE.py:factory``, imported from the file (not from sys.path)."""
    file, sep, name = spec.rpartition(":")
    if not sep or not file or not name:
        raise CliError(f"--model {spec!r}: expected FILE.py:factory, e.g. examples/models.py:gpt")
    path = Path(file).expanduser().resolve()
    if not path.is_file():
        raise CliError(f"--model: file not found: {file} (expected FILE.py:factory)")
    module_name = f"memopt_factory_{path.stem}_{abs(hash(path)) & 0xFFFFFF:x}"
    spec_obj = importlib.util.spec_from_file_location(module_name, path)
    if spec_obj is None or spec_obj.loader is None:
        raise CliError(f"--model: cannot import {file}: not a Python source file")
    module = importlib.util.module_from_spec(spec_obj)
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # so the file can import its neighbours
    sys.modules[module_name] = module
    try:
        spec_obj.loader.exec_module(module)
    except Exception as err:
        sys.modules.pop(module_name, None)
        raise CliError(
            f"--model: importing {file} failed: {type(err).__name__}: {err}{_where(err, path)}"
        ) from None
    factory = getattr(module, name, None)
    if factory is None:
        defined = [
            n
            for n, v in vars(module).items()
            if callable(v) and not n.startswith("_") and getattr(v, "__module__", "") == module_name
        ]
        guess = closest(name, defined, n=1)
        hint = f" Did you mean {guess[0]!r}?" if guess else ""
        raise CliError(
            f"--model: {file} has no factory {name!r}.{hint} Callables defined there: "
            f"{', '.join(defined) or 'none'}; expected {EXPECTED}"
        )
    if not callable(factory):
        raise CliError(
            f"--model: {file}:{name} is a {type(factory).__name__}, not a callable; "
            f"expected {EXPECTED}"
        )
    return factory


def build(spec: str) -> tuple[nn.Module, Any, Callable[[nn.Module, Any], torch.Tensor]]:
    """Call the factory named by ``FILE.py:factory`` and check it returned the triple."""
    factory = load_factory(spec)
    path = Path(spec.rpartition(":")[0]).expanduser().resolve()
    try:
        result = factory()
    except Exception as err:
        raise CliError(
            f"--model: {spec}() raised {type(err).__name__}: {err}{_where(err, path)}"
        ) from None
    got = f"a {type(result).__name__}"
    if isinstance(result, tuple | list):
        got += f" of {len(result)}: ({', '.join(type(x).__name__ for x in result)})"
    if not isinstance(result, tuple | list) or len(result) != 3:
        raise CliError(f"--model: {spec}() returned {got}; expected {EXPECTED}")
    model, batch, loss_fn = result
    if not isinstance(model, nn.Module) or not callable(loss_fn):
        raise CliError(f"--model: {spec}() returned {got}; expected {EXPECTED}")
    return model, batch, loss_fn


# --------------------------------------------------------------------------- commands


def _budget(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            f"{text} is outside (0, 1]: a fraction of the baseline to keep, e.g. 0.4"
        )
    return value


def _memory(text: str) -> int:
    """``6GiB``, ``512MiB``, ``1.5G`` (binary), ``8GB`` (decimal) or a number of bytes."""
    try:
        return memory_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def _config(path: str | None) -> MemOptConfig | None:
    if path is None:
        return None
    try:
        return load_config(path)
    except ConfigError as err:
        raise CliError(f"--config: {err}") from None


def _profile(
    spec: str, config: MemOptConfig | None, optimizer: str | None, device: str | None
) -> tuple[nn.Module, ProfileReport]:
    model, batch, loss_fn = build(spec)
    if device is not None:
        model.to(device)
        batch = map_tensors(lambda t: t.to(device), batch)
    opt = OPTIMIZERS[optimizer](model.parameters()) if optimizer else None
    path = Path(spec.rpartition(":")[0]).expanduser().resolve()
    try:
        return model, profile_model(model, batch, loss_fn, config, opt, device=device)
    except ConfigError as err:
        raise CliError(f"--config does not fit the model of {spec}: {err}") from None
    except Exception as err:
        if _raised_by_memopt(err):
            raise  # a bug of ours: the traceback is the useful part
        raise CliError(
            f"one training step of {spec} failed: {type(err).__name__}: {err}{_where(err, path)}; "
            f"expected loss_fn(model, batch) to return a scalar loss"
        ) from None


def cmd_profile(args: argparse.Namespace) -> int:
    """``memopt profile``: write report.md, memory.png and report.json, print the table."""
    config = _config(args.config)
    model, report = _profile(args.model, config, args.optimizer, args.device)
    suggestion = suggest_config(report, args.suggest, base=config) if args.suggest else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written, image, timeline, warning = [], None, None, None
    try:
        written.append(report.plot(out / "memory.png", top=min(args.top, 20)))
        written.append(report.plot_timeline(out / "timeline.png"))
        image, timeline = "memory.png", "timeline.png"
    except ImportError as err:
        warning = f"memopt: memory.png and timeline.png not written: {err}"
    shown = min(args.top, len(report.modules))
    markdown = report.to_markdown(args.top, image=image, timeline=timeline)
    markdown += f"\nThe {shown} largest of {len(report.modules)} rows; report.json has all.\n"
    for name, text in (("report.md", markdown), ("report.json", report.to_json() + "\n")):
        (out / name).write_text(text, encoding="utf-8")
        written.append(out / name)
    if suggestion is not None:
        (out / "suggested.yaml").write_text(suggestion.to_yaml(), encoding="utf-8")
        written.append(out / "suggested.yaml")

    ops = suggest_ops(model, report)
    if ops:
        print(report.summary(), _ops_lines(ops), report.table(args.top), sep="\n\n")
    else:
        print(report.summary(), report.table(args.top), sep="\n\n")
    if suggestion is not None:
        print("\n" + suggestion.to_yaml(), end="")
    print("\nwrote " + ", ".join(os.fspath(p) for p in written))
    if warning:
        print(warning, file=sys.stderr)
    return 0


def _ops_lines(ops: list[OpsEntry]) -> str:
    return "\n".join(
        [
            "memory-lean ops that act where the peak is (configs/lean.yaml has them all):",
            *(f"  {entry}" for entry in ops),
        ]
    )


def cmd_plan(args: argparse.Namespace) -> int:
    """``memopt plan``: print (and optionally write) a config for the peak budget or cap."""
    if args.budget is None and args.memory is None:
        raise CliError("plan: give --budget (a fraction of the baseline's peak), --memory, or both")
    base = _config(args.config)
    model, batch, loss_fn = build(args.model)
    if args.device is not None:
        model.to(args.device)
        batch = map_tensors(lambda t: t.to(args.device), batch)
    name = None if args.optimizer == "none" else args.optimizer
    optimizer = OPTIMIZERS[name](model.parameters()) if name else None
    # The factory again, in the fresh processes that read the whole training under the cap;
    # load_factory named by its module (run by ``python -m``, this module is ``__main__``).
    named = importlib.import_module(f"{__package__}.cli").load_factory
    training = Training(functools.partial(named, args.model), name, args.device)
    try:
        plan = plan_peak(
            model, batch, loss_fn, budget=args.budget, memory=args.memory, bits=args.bits,
            base=base, device=args.device, optimizer=optimizer, optimizer_name=name,
            training=training,
        )  # fmt: skip
    except ConfigError as err:
        raise CliError(f"--config does not fit the model of {args.model}: {err}") from None
    text = plan.to_yaml()
    print(text, end="")
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"memopt: wrote {args.output}", file=sys.stderr)
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    """``memopt presets``: each preset's name and what it is for, and which to start with."""
    names = presets.names()
    width = max(len(n) for n in names)
    for name in names:
        print(f"{name.ljust(width)}  {presets.describe(name)}")
    print(
        f"\nStart with {presets.FIRST}: MemOptCallback({presets.FIRST!r}), "
        f"MemoryOptimizer({presets.FIRST!r}) or --config {presets.FIRST}. "
        "Print one with: memopt presets NAME"
    )
    return 0


def cmd_preset(args: argparse.Namespace) -> int:
    """``memopt presets NAME``: the preset's YAML, comments and all (a file to start from)."""
    found = presets.path(args.name)
    if found is None:
        try:
            MemOptConfig.from_preset(args.name)
        except ConfigError as err:  # names the presets and the closest one
            raise CliError(str(err)) from None
    print(found.read_text(encoding="utf-8"), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``memopt`` (subcommands ``profile``, ``plan`` and ``presets``)."""
    parser = argparse.ArgumentParser(
        prog="memopt", description="Find where a model's training memory goes, and plan to cut it."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{profile,plan,presets}")
    model_help = (
        "FILE.py:factory - the factory returns (model, batch, loss_fn) with "
        "loss_fn(model, batch) -> scalar loss"
    )
    device_help = "run on this device (default: where the model's parameters are)"

    p = sub.add_parser("profile", help="per-module memory of one training step")
    p.add_argument("--model", required=True, metavar="FILE.py:factory", help=model_help)
    p.add_argument(
        "--config", metavar="NAME|YAML", help="memopt preset or config whose plan is measured too"
    )
    p.add_argument("--out", default="memopt-report", metavar="DIR", help="report folder")
    p.add_argument("--top", type=_positive, default=25, metavar="N", help="rows shown (25)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), help="count this optimizer's state")
    p.add_argument("--suggest", type=_budget, metavar="BUDGET", help="also print a plan (0-1]")
    p.add_argument("--device", help=device_help)
    p.set_defaults(run=cmd_profile)

    p = sub.add_parser("plan", help="propose a config for a memory budget, printed as YAML")
    p.add_argument("--model", required=True, metavar="FILE.py:factory", help=model_help)
    p.add_argument(
        "--budget",
        type=_budget,
        help="the step's peak, as a fraction of the baseline's peak to keep, (0, 1]",
    )
    p.add_argument(
        "--memory",
        type=_memory,
        metavar="BYTES",
        help="a cap for the whole training (e.g. 6GiB): also prints the largest batch that fits",
    )
    p.add_argument(
        "--bits",
        type=int,
        choices=(2, 4, 8, 16),
        help="also compress at these bits (default: --config's bits where it compresses, else "
        "only when recompute cannot reach the budget)",
    )
    p.add_argument(
        "--optimizer",
        choices=(*sorted(OPTIMIZERS), "none"),
        default="adamw",
        help="the training's optimizer, whose state --memory counts (default adamw)",
    )
    p.add_argument(
        "--config", metavar="NAME|YAML", help="start from this preset or config (its keys stay)"
    )
    p.add_argument("--output", "-o", metavar="FILE", help="also write the YAML to FILE")
    p.add_argument("--device", help=device_help)
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser("presets", help="list the presets (--config NAME), or print one")
    p.add_argument("name", nargs="?", metavar="NAME", help="print this preset's YAML")
    p.set_defaults(run=lambda args: cmd_preset(args) if args.name else cmd_presets(args))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``memopt`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except CliError as err:
        print(f"memopt: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `memopt profile ... | head`: the reader left, nothing is wrong
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
