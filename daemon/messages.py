"""The messages of the supervisor's inbox, plain typed data named in the past tense: commands
(requests) and what the host's tasks report. An "event" is something else: a record in
events.jsonl.

A command's answer goes back through the future the facade (`supervisor.py`) keeps beside the
message in its inbox; internal messages carry the launch generation they belong to, so a timer
or probe of an earlier launch that fires late is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .sglanglines import ParsedLine

if TYPE_CHECKING:
    from pathlib import Path

    from .effects import ServerHandle, ServerLog
    from .gpustate import GpuSnapshot
    from .listener import ListenerCheck
    from .model import Adoptee, PreviousServer
    from .preflight import PreflightResult
    from .resolvedconfig import ResolvedConfig


# -- commands (from the API, the CLI through the API, and the daemon itself) ----------------------


@dataclass(frozen=True)
class StartRequested:
    config: str | None
    boot: bool = False
    preflight: PreflightResult | None = None  # checked before the message was posted
    resolved: ResolvedConfig | None = None  # read off the owner before the message was posted
    ticket: int = 0  # when it was asked for: a stop asked for later cancels it
    last_good: ResolvedConfig | None = None  # a resumed swap's rollback config, read ahead


@dataclass(frozen=True)
class StopRequested:
    ticket: int = 0


@dataclass(frozen=True)
class RestartRequested:
    config: str | None
    preflight: PreflightResult | None = None
    sweep_id: str | None = None  # a sweep's own swaps pass its 409
    resolved: ResolvedConfig | None = None
    ticket: int = 0
    # The last good config, read ahead: what a failed swap rolls back to when nothing serves.
    last_good: ResolvedConfig | None = None
    ensure: bool = False  # nothing to do when this config is already ready (a sweep's step)
    weights: tuple[Path, ...] = ()  # its weight files, found before: a swap pre-warms them


@dataclass(frozen=True)
class ShutdownRequested:
    """The daemon is exiting: stop the server, keep the saved intent."""


@dataclass(frozen=True)
class BootBegan:
    """The daemon starts: what its previous life left, read off the owner before the first
    message. The machine restores it and decides what becomes of a server that life left."""

    record: dict[str, Any]  # state.json as read ({}: none, or unreadable)
    note: str | None  # why state.json could not be read as it was (moved aside), if so
    previous: PreviousServer | None  # a server of that life still running, or its leftovers
    # Of the processes that life knew to be ours, (pid, create time) of those still alive.
    alive_known: frozenset[tuple[int, float]] = frozenset()
    # The install's key for the digests of each launch's secrets kept in its record (None:
    # none are kept).
    secret_salt: bytes | None = None
    # With live_restore: that life's server, verified under the shim, to be taken over as it
    # runs (or as it ended while the daemon was away); and what was found that is not
    # verifiably ours ({pid, name, why}): listed, never signalled.
    adoptee: Adoptee | None = None
    unmanaged: tuple[dict[str, Any], ...] = ()


# -- internal events ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spawned:
    """The launch's log was created and its server executed."""

    gen: int
    server: ServerHandle
    log: ServerLog


@dataclass(frozen=True)
class Adopted:
    """An adopted server's log is taken up (the shim writes it; its lines come from now on)."""

    gen: int
    log: ServerLog


@dataclass(frozen=True)
class SpawnFailed:
    """The log could not be created (`log_unwritable`) or the server not executed
    (`exec_failed`)."""

    gen: int
    reason: str
    detail: str


@dataclass(frozen=True)
class GpuWaitEnded:
    gen: int
    ok: bool
    busy: str = ""


@dataclass(frozen=True)
class ServerExited:
    gen: int
    returncode: int | None
    unknown: str | None = None  # why its exit cannot be known (the shim running it was lost)


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
    check: ListenerCheck


@dataclass(frozen=True)
class ProbeFailed:
    gen: int
    detail: str


@dataclass(frozen=True)
class StartupTimedOut:
    gen: int


@dataclass(frozen=True)
class GraceExpired:
    gen: int


@dataclass(frozen=True)
class SweepFinished:
    gen: int
    killed: list[dict[str, Any]]


@dataclass(frozen=True)
class PrewarmEnded:
    """A swap's pre-warm is over: `outcome` done, abandoned (memory) or failed (a read)."""

    swap_id: str
    outcome: str
    detail: str


@dataclass(frozen=True)
class BackoffElapsed:
    """The backoff's delay is over and the intent's config was read for the retry."""

    gen: int
    resolved: ResolvedConfig | None = None  # None: with `error`
    error: str | None = None
    unreadable: bool = False  # the error is the config's file: missing, unreadable, not parsed


@dataclass(frozen=True)
class StableUptimeReached:
    """`reset_after_s` of ready: consecutive failures are forgiven."""

    gen: int


@dataclass(frozen=True)
class ProbationOver:
    gen: int


@dataclass(frozen=True)
class GpuSampled:
    """A GPU snapshot and the pids of the running launch's tree, taken off the owner."""

    gen: int
    snapshot: GpuSnapshot
    tree: frozenset[tuple[int, float]]
    unresolved: tuple[int, ...] = ()  # holders' pids this daemon cannot see (NVML only)


@dataclass(frozen=True)
class PreviousServerStopped:
    """The server (or the leftovers) of the daemon's previous life is stopped."""

    previous: PreviousServer
    killed: list[dict[str, Any]]


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
class WriteHealthChanged:
    """A file the daemon writes started failing (`error`) or works again (None)."""

    target: str
    error: str | None


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
    """The server's figures, read from its own /metrics for launch `gen` (on a scrape), or its
    own account of its start (`startup`: 0.5.23's `/server_info` `startup_time`, once ready)."""

    gen: int
    figures: dict[str, Any]
    startup: dict[str, Any] | None = None


@dataclass(frozen=True)
class SaveDelayElapsed:
    """The wait before retrying a failed state.json write is over."""


Message = (
    StartRequested
    | StopRequested
    | RestartRequested
    | ShutdownRequested
    | BootBegan
    | PreviousServerStopped
    | Spawned
    | Adopted
    | SpawnFailed
    | GpuWaitEnded
    | ServerExited
    | LineParsed
    | ProbeSucceeded
    | ListenerChecked
    | ProbeFailed
    | StartupTimedOut
    | GraceExpired
    | SweepFinished
    | BackoffElapsed
    | PrewarmEnded
    | StableUptimeReached
    | EventNoted
    | ProbationOver
    | GpuSampled
    | OrphansKilled
    | TaskFailed
    | StateSaved
    | WriteHealthChanged
    | SweepBegan
    | SweepEnded
    | SaveDelayElapsed
    | ServerFiguresRead
)
# What the ledger records (`Ledger.note`): some are the running launch's signals as well.
Noted = LineParsed | GpuSampled | ServerFiguresRead | OrphansKilled | WriteHealthChanged
