"""The messages of the supervisor's inbox: commands (past-participle requests) and what helper
tasks report (past tense). An "event" is something else: a record in events.jsonl.

Commands carry a reply future; internal events carry the launch generation they belong to, so
a timer or probe of an earlier launch that fires late is dropped.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from .sglanglines import ParsedLine


def _future() -> asyncio.Future[Any]:
    return asyncio.get_running_loop().create_future()


# -- commands (from the API, the CLI through the API, and the daemon itself) ----------------------


@dataclass(frozen=True)
class StartRequested:
    config: str | None
    reply: asyncio.Future[Any] = field(default_factory=_future)
    boot: bool = False
    preflight: Any = None  # a PreflightResult, checked before the message was posted
    resolved: Any = None  # the ResolvedConfig, read off the owner before the message was posted
    ticket: int = 0  # when it was asked for: a stop asked for later cancels it
    last_good: Any = None  # a resumed swap's rollback config, read ahead like `resolved`


@dataclass(frozen=True)
class StopRequested:
    reply: asyncio.Future[Any] = field(default_factory=_future)
    ticket: int = 0


@dataclass(frozen=True)
class RestartRequested:
    config: str | None
    reply: asyncio.Future[Any] = field(default_factory=_future)
    preflight: Any = None
    sweep_id: str | None = None  # a sweep's own swaps pass its 409
    resolved: Any = None
    ticket: int = 0
    # The last good config, read ahead: what a failed swap rolls back to when nothing serves.
    last_good: Any = None
    ensure: bool = False  # nothing to do when this config is already ready (a sweep's step)


@dataclass(frozen=True)
class ShutdownRequested:
    """The daemon is exiting: stop the server, keep the saved intent."""

    reply: asyncio.Future[Any] = field(default_factory=_future)


# -- internal events ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spawned:
    """The launch's log was created and its server executed."""

    gen: int
    child: Any  # child.ChildProcess
    log: Any  # launchlog.LaunchLog


@dataclass(frozen=True)
class SpawnFailed:
    """The log could not be created (`log_unwritable`) or the server not executed
    (`exec_failed`)."""

    gen: int
    reason: str
    detail: str


@dataclass(frozen=True)
class GpuWaitDone:
    gen: int
    ok: bool
    busy: str = ""


@dataclass(frozen=True)
class ChildExited:
    gen: int
    returncode: int | None


@dataclass(frozen=True)
class LineParsed:
    gen: int
    parsed: ParsedLine
    line: str


@dataclass(frozen=True)
class ProbeSucceeded:
    gen: int
    detail: str


@dataclass(frozen=True)
class ListenerChecked:
    """Who holds the health URL's listening socket, asked when the launch looked ready."""

    gen: int
    how: str  # what said ready: "ready line" or the probe's detail
    check: Any  # listener.ListenerCheck


@dataclass(frozen=True)
class ProbeFailed:
    gen: int
    detail: str
    readiness: bool = False


@dataclass(frozen=True)
class StartupTimedOut:
    gen: int


@dataclass(frozen=True)
class GraceExpired:
    gen: int


@dataclass(frozen=True)
class SweepDone:
    gen: int
    killed: list[dict[str, Any]]


@dataclass(frozen=True)
class BackoffElapsed:
    """The backoff's delay is over and the intent's config was read for the retry."""

    gen: int
    resolved: Any = None  # the ResolvedConfig, or None with `error`
    error: str | None = None
    unreadable: bool = False  # the error is the config's file: missing, unreadable, not parsed


@dataclass(frozen=True)
class StableUptime:
    """`reset_after_s` of ready: consecutive failures are forgiven."""

    gen: int


@dataclass(frozen=True)
class ProbationOver:
    gen: int


@dataclass(frozen=True)
class GpuSampled:
    """A GPU snapshot and the pids of the running launch's tree, taken off the owner."""

    gen: int
    snapshot: Any
    tree: frozenset[tuple[int, float]]
    unresolved: tuple[int, ...] = ()  # holders' pids this daemon cannot see (NVML only)


@dataclass(frozen=True)
class OrphansKilled:
    """Processes of earlier launches that held GPU memory, killed before a launch."""

    killed: list[dict[str, Any]]


@dataclass(frozen=True)
class EventNoted:
    """A helper task has something to record (it posts; the owner records)."""

    kind: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class TaskFailed:
    """A helper task of the owner raised: the owner records it and recovers (never silent)."""

    name: str
    gen: int
    error: str


@dataclass(frozen=True)
class StateSaved:
    """The writer thread's outcome for one state.json write (None: written)."""

    error: str | None


@dataclass(frozen=True)
class WriteHealth:
    """A file the daemon writes started failing (`error`) or works again (None)."""

    target: str
    error: str | None
    gen: int = 0


@dataclass(frozen=True)
class SweepBegan:
    """A sweep runs: other restarts and swaps are refused until it ends. `restore_to`: the
    config it ends on (the one serving before it, or its `end_on`; None: none)."""

    sweep_id: str
    restore_to: str | None = None


@dataclass(frozen=True)
class SweepEnded:
    sweep_id: str


@dataclass(frozen=True)
class ServerFiguresRead:
    """The server's figures, read from its own /metrics for launch `gen` (on a scrape)."""

    gen: int
    figures: dict[str, Any]
    reply: asyncio.Future[Any] = field(default_factory=_future)


@dataclass(frozen=True)
class SaveAgain:
    """Retry a failed state.json write."""


Message = (
    StartRequested
    | StopRequested
    | RestartRequested
    | ShutdownRequested
    | Spawned
    | SpawnFailed
    | GpuWaitDone
    | ChildExited
    | LineParsed
    | ProbeSucceeded
    | ListenerChecked
    | ProbeFailed
    | StartupTimedOut
    | GraceExpired
    | SweepDone
    | BackoffElapsed
    | StableUptime
    | EventNoted
    | ProbationOver
    | GpuSampled
    | OrphansKilled
    | TaskFailed
    | StateSaved
    | WriteHealth
    | SweepBegan
    | SweepEnded
    | SaveAgain
    | ServerFiguresRead
)
