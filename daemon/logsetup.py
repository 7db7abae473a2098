"""The daemon's own log: one JSON object a line when not on a terminal, readable on one.

A small logger of its own in place of structlog: records are an event name and flat fields
(`log.info("child.spawned", pid=...)`), and uvicorn's stdlib records get the same shape.
Levels are the operator's: errors for crashes, rollbacks and `failed`, warnings for retries
and crash loops (`record_level`). Under systemd (`JOURNAL_STREAM` names our stderr) each line
starts with its syslog priority, `<3>` for an error, which journald strips and keeps, so
`journalctl -p err` finds them. (structlog pulled in rich and cost the idle daemon ~6 MiB.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

# syslog priorities (sd-daemon.h's SD_ERR, SD_WARNING, ...), by stdlib level
PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6}
DEBUG_PRIORITY = 7


class Logger:
    """`log.info("event.name", key=value, ...)`: a stdlib record carrying the fields."""

    __slots__ = ("_logger",)

    def __init__(self, name: str) -> None:
        self._logger = logging.getLogger(name)

    def log(self, level: int, event: str, /, exc_info: Any = None, **fields: Any) -> None:
        if self._logger.isEnabledFor(level):
            self._logger.log(level, event, exc_info=exc_info, extra={"fields": fields})

    def debug(self, event: str, /, **fields: Any) -> None:
        self.log(logging.DEBUG, event, **fields)

    def info(self, event: str, /, **fields: Any) -> None:
        self.log(logging.INFO, event, **fields)

    def warning(self, event: str, /, **fields: Any) -> None:
        self.log(logging.WARNING, event, **fields)

    def error(self, event: str, /, **fields: Any) -> None:
        self.log(logging.ERROR, event, **fields)

    def exception(self, event: str, /, **fields: Any) -> None:
        """An error with the exception being handled."""
        self.log(logging.ERROR, event, exc_info=True, **fields)


def get_logger(name: str) -> Logger:
    return Logger(name)


def record_level(record: dict[str, Any]) -> int:
    """The level a supervisor record is logged at: what an operator must act on is an error,
    what heals by itself (a retry, a crash loop still retrying, a failed probe) a warning."""
    kind = record.get("event")
    reason = record.get("reason")
    if kind == "exit":
        return logging.INFO if reason in (None, "requested_stop") else logging.ERROR
    if kind == "state":
        to = record.get("to")
        if to == "failed":
            return logging.ERROR
        return logging.WARNING if to in ("backoff", "unhealthy") else logging.INFO
    if kind == "swap_settled":
        return logging.INFO if record.get("outcome") == "ready" else logging.ERROR
    if kind in ("rollback", "internal_error", "write_failed", "preflight_refused", "shim_lost"):
        return logging.ERROR
    if kind in (
        "crash_loop",
        "probe_failed",
        "death_announced",
        "gpu_orphans_killed",
        "state_file_corrupt",
        "events_gap",
        "config_unreadable",
        "shim_unavailable",
        "unmanaged_process",
    ):
        return logging.WARNING
    return logging.INFO


class Formatter(logging.Formatter):
    """JSON (`{fields..., "event", "level", "logger", "timestamp"}`) or a console line."""

    def __init__(self, json_lines: bool, priority_prefix: bool) -> None:
        super().__init__()
        self.json_lines = json_lines
        self.priority_prefix = priority_prefix

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = dict(getattr(record, "fields", None) or {})
        event = record.getMessage()
        level = record.levelname.lower()
        ts = datetime.fromtimestamp(record.created, UTC).isoformat().replace("+00:00", "Z")
        if record.exc_info:
            fields["exception"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        if self.json_lines:
            out = {**fields, "event": event, "level": level, "logger": record.name}
            out["timestamp"] = ts
            line = json.dumps(out, default=str, ensure_ascii=False)
        else:
            pairs = " ".join(f"{k}={v!r}" for k, v in fields.items() if k != "exception")
            line = f"{ts} [{level:<8}] {event:<28} {pairs}".rstrip()
            if "exception" in fields:
                line += "\n" + fields["exception"]
        if self.priority_prefix:
            prio = PRIORITY.get(record.levelno, DEBUG_PRIORITY)
            line = "\n".join(f"<{prio}>{part}" for part in line.split("\n"))
        return line


def journald_stderr() -> bool:
    """True when stderr is the journal's stream: `JOURNAL_STREAM` is `DEVICE:INODE` of it."""
    dev, _, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return dev.isdigit() and ino.isdigit() and (st.st_dev, st.st_ino) == (int(dev), int(ino))


def configure(json_logs: bool | None = None, level: int = logging.INFO) -> None:
    journal = journald_stderr()
    if json_logs is None:
        json_logs = journal or not sys.stderr.isatty()
    # What no line of ours shows is not gathered for each record (the logging docs'
    # "Optimization"): the caller's file and line (a walk of the stack), thread, process.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(Formatter(json_logs, priority_prefix=journal))
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
            get_logger("gpuwarden").warning(
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
