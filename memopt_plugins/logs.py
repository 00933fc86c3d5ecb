"""Where memopt's lines go: the ``memopt`` logger, shown on the console without any set-up.

memopt's decisions (the plan, each drift check's escalations, warnings) are INFO lines on the
``memopt`` logger. Python shows nothing below WARNING until someone configures logging, and
neither Lightning nor the ``transformers.Trainer`` does it for other libraries' loggers, so
:func:`show_on_console` (called by every ``apply``) gives the logger one stderr handler at INFO
when nothing would print its lines: no handler on it or its ancestors (root included). A script
that configures logging itself (``logging.basicConfig``, a handler on ``memopt``) keeps its own
set-up. The handler passes INFO lines from the process of rank 0 only (the rank read as
:func:`~.distributed.process_rank` does); warnings come from every rank.

To silence memopt: ``logging.getLogger("memopt").setLevel(logging.WARNING)`` (a level set before
or after the first ``apply`` is kept).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from .distributed import process_rank

log = logging.getLogger("memopt")


class _RankZeroInfo(logging.Filter):
    """INFO and below from rank 0 only; warnings and errors from every rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or process_rank() == 0


class ConsoleHandler(logging.StreamHandler):
    """The stderr handler :func:`show_on_console` adds (one per process)."""

    def __init__(self) -> None:
        super().__init__()  # sys.stderr, looked up at each line (pytest's capture swaps it)
        self.setFormatter(logging.Formatter("%(message)s"))
        self.addFilter(_RankZeroInfo())


#: What :func:`show_on_console` changed on the logger, for :func:`release_console` to undo.
_shown: dict[str, object] = {}


def show_on_console() -> None:
    """Give the ``memopt`` logger a stderr handler at INFO when no handler would print its
    lines; a no-op once it has one, or when logging is configured."""
    if log.hasHandlers():
        return
    _shown["handler"] = handler = ConsoleHandler()
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
        _shown["level"] = logging.INFO


def release_console() -> None:
    """Take back what :func:`show_on_console` added (``remove()`` calls it once no patched model
    is left): the handler, and the level where it is still the one memopt set."""
    handler = _shown.pop("handler", None)
    if handler is not None:
        log.removeHandler(handler)  # type: ignore[arg-type]
    if _shown.pop("level", None) == log.level:
        log.setLevel(logging.NOTSET)


@contextmanager
def quiet() -> Iterator[None]:
    """memopt's INFO lines are dropped inside (measurement passes that patch a copy of the plan:
    their lines would repeat the training patch's)."""
    level = log.level
    log.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        log.setLevel(level)
