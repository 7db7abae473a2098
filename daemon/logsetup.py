"""structlog for the daemon's own logs: JSON lines when not a TTY, readable on a terminal.

The same processor chain formats stdlib records (uvicorn's), so every line has one shape.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
from collections.abc import Callable
from typing import Any

import structlog


def configure(json_logs: bool | None = None, level: int = logging.INFO) -> None:
    if json_logs is None:
        json_logs = not sys.stderr.isatty()
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json_logs
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)


class Repeats:
    """At most one full record per kind per `window_s`: the first is logged, the rest are
    counted, and one summary line at the window's end says how many there were. A flood of one
    failure (an accept loop out of descriptors, a client that keeps misbehaving) stays a few
    lines instead of filling the disk."""

    MAX_KINDS = 100  # kinds beyond it are counted together

    def __init__(self, loop: asyncio.AbstractEventLoop, window_s: float) -> None:
        self.loop = loop
        self.window_s = window_s
        self._counts: dict[str, int] = {}

    def admit(self, kind: str) -> bool:
        """True when this occurrence is to be logged in full."""
        if kind not in self._counts and len(self._counts) >= self.MAX_KINDS:
            kind = "(other kinds)"
        if kind in self._counts:
            self._counts[kind] += 1
            return False
        self._counts[kind] = 0
        self.loop.call_later(self.window_s, self._summarize, kind)
        return True

    def _summarize(self, kind: str) -> None:
        repeated = self._counts.pop(kind, 0)
        if repeated:
            structlog.get_logger("gpuwarden").warning(
                "log.repeated", kind=kind, count=repeated, window_s=self.window_s
            )


def loop_exception_handler(
    repeats: Repeats,
) -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
    """asyncio's handler, through `repeats`: its kind is the message (numbers and addresses
    blurred, so one failure repeated is one kind) and the exception's type."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        message = re.sub(r"0x[0-9a-fA-F]+|\d+", "#", str(context.get("message", "")))[:120]
        kind = f"{message} ({type(exc).__name__})" if exc is not None else message
        if repeats.admit(kind):
            loop.default_exception_handler(context)

    return handle
