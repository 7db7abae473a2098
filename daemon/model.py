"""Plain data of the lifecycle: what is asked to run, a launch attempt, a swap under way, what
follows an exit.

The machine (`machine.py`) and its parts are the only writers of these (`Launch` says which
part writes which of its fields), with two exceptions: the log pipeline appends a launch's
findings as its lines arrive (stated on `Launch`), and a swap's pre-warm reader writes its
`PrewarmProgress` as it reads.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from .phases import PhaseClock
from .redact import Redactor
from .sglanglines import Finding
from .states import SwapPhase

if TYPE_CHECKING:
    from .effects import ServerHandle, ServerLog
    from .policy import Classification
    from .resolvedconfig import ResolvedConfig

MAX_FINDINGS = 200


class Next(StrEnum):
    """What to do once a launch has exited and been swept."""

    STOP = "stop"  # stopped on request
    RELAUNCH = "relaunch"  # a restart or swap: start `next_config`
    RETRY = "retry"  # we ended it (startup timeout, liveness): the restart policy decides
    SHUTDOWN = "shutdown"  # the daemon is exiting


@dataclass
class Intent:
    """What is asked to run, and what is known good: the machine's, kept across the daemon's
    lives (state.json's `intent`, `last_good_*`, `last_failed_launch` and `sweep`)."""

    config: str | None = None
    running: bool = False
    last_good_config: str | None = None
    last_good_launch: str | None = None
    last_failed_launch: str | None = None
    # A sweep under way, and the config it ends on: no other config it starts becomes
    # last-good, and a daemon that dies mid-sweep starts that one at its next boot.
    sweep: str | None = None
    sweep_restore_to: str | None = None

    def good(self, launch: Launch) -> bool:
        """`launch` is what a failed swap rolls back to from now on, and what a later life
        keeps the logs of; not one a sweep measures (it ends on another config)."""
        if self.sweep is not None and launch.config.name != self.sweep_restore_to:
            return False
        self.last_good_config, self.last_good_launch = launch.config.name, launch.launch_id
        return True

    def protected_logs(self, current: str | None) -> set[str]:
        """The launches whose logs are never pruned."""
        return {x for x in (current, self.last_good_launch, self.last_failed_launch) if x}


@dataclass(frozen=True)
class PreviousServer:
    """A server the daemon's previous life left running on this boot, or processes of its
    launch left behind (`alive` False: its own process is gone). As state.json recorded it."""

    pid: int
    pgid: int
    create_time: float | None
    launch_id: str
    token: str
    alive: bool


@dataclass(frozen=True)
class Adoptee:
    """The server the previous life recorded as running, verified as that very server (pid,
    create time, boot, argv, token) under the shim, which this life takes over as it is
    (live restore). `exited_at`: when it ended while the daemon was away, by the shim's
    record (None: it runs; its code comes through `server`, as any exit's)."""

    record: dict[str, Any]  # state.json's `current_launch`
    server: ServerHandle
    config: ResolvedConfig  # its config as it reads now (`config_changed`: not as launched)
    exited_at: float | None = None
    rollback: ResolvedConfig | None = None  # what a swap resumed with it rolls back to

    @property
    def config_changed(self) -> bool:
        return self.config.config_hash != self.record.get("config_hash")

    def previous(self) -> PreviousServer:
        """As a server of the previous life to stop (it is not what is asked to run)."""
        r, pid = self.record, self.server.pid
        alive = self.exited_at is None
        token = str(r.get("token"))
        return PreviousServer(pid, pid, self.server.create_time, str(r["launch_id"]), token, alive)


@dataclass(eq=False)
class Launch:
    """One launch attempt, from the GPU wait to the sweep after its exit. `gen` tags every
    message about it, so a late timer or probe of an earlier attempt is dropped."""

    gen: int
    config: ResolvedConfig
    # Its steps and its end, written only by the attempt part (`attempt.py`).
    launch_id: str = ""
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    log: ServerLog | None = None
    child: ServerHandle | None = None
    redactor: Redactor = field(default_factory=Redactor)
    spawning: bool = False  # the host is creating the log and executing the server
    started_at: float | None = None
    started_mono: float | None = None
    ready_at: float | None = None
    ready_mono: float | None = None
    exited: bool = False
    returncode: int | None = None
    exited_at: float | None = None  # when known better than its handling (adopted, exited away)
    # Adopted: its launch as the previous life recorded it (state.json's `current_launch`), what
    # it was launched with (argv digest, config hash, port, log) whatever its config reads now.
    recorded: dict[str, Any] | None = None
    next: Next | None = None
    next_config: ResolvedConfig | None = None
    imposed: Classification | None = None
    # Written by the log pipeline as lines arrive (log data, not lifecycle state): what the
    # exit's classification reads once the launch has been swept.
    findings: list[Finding] = field(default_factory=list)
    finding_times: list[float] = field(default_factory=list)  # monotonic, one per finding
    # Where this exit's evidence starts in `findings`: DEATH_CONTEXT_S before SGLang's death
    # line (a watchdog timeout, an OOM logged just before), not a request's error of hours ago.
    death_at: int | None = None
    phases: PhaseClock = field(default_factory=PhaseClock)  # the phases its start went through
    # The evidence of its health, written only by the evidence part (`evidence.py`).
    announced: str | None = None  # SGLang's line saying the server died
    checking_listener: bool = False  # a readiness signal came; who listens is being asked
    listener_rechecked: bool = False
    probe_failures: int = 0
    rank_gpus: dict[int, list[int]] | None = None  # GPU -> pids of ours it held at ready
    # The swap it belongs to (set as it begins), and its probation (the machine's).
    swap: Swap | None = None
    rollback: bool = False  # this attempt is a rollback to the last good config
    on_probation: bool = False

    @property
    def running(self) -> bool:
        """A process of this launch exists and has not exited."""
        return self.child is not None and not self.exited

    def add_findings(self, findings: list[Finding], at: float) -> None:
        if len(self.findings) < MAX_FINDINGS:
            self.findings.extend(findings)
            self.finding_times.extend([at] * len(findings))
        else:  # keep the first ones and the latest ones
            self.findings[MAX_FINDINGS // 2 :] = [
                *self.findings[MAX_FINDINGS // 2 + len(findings) :],
                *findings,
            ]
            self.finding_times[MAX_FINDINGS // 2 :] = [
                *self.finding_times[MAX_FINDINGS // 2 + len(findings) :],
                *([at] * len(findings)),
            ]

    def evidence(self) -> list[Finding]:
        """The findings that speak for this exit: after SGLang's death line, what it logged
        long before (a request's traceback hours ago) is no evidence."""
        if self.death_at is not None and self.death_at < len(self.findings):
            return self.findings[self.death_at :]
        return self.findings


@dataclass
class PrewarmProgress:
    """A swap's page-cache pre-warm as it goes (`prewarm.py`): written by its reader's thread
    alone once the machine has made it, read by `/status`."""

    files: int = 0
    total_bytes: int = 0  # the files' sizes
    cached_bytes: int = 0  # found in the page cache already (not read again)
    read_bytes: int = 0  # read into it by the pre-warm
    held_bytes: int = 0  # held in the page cache until the swap settles (`mlock`)
    state: str = "reading"  # reading | done | abandoned | failed | cancelled
    detail: str | None = None
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None

    def view(self) -> dict[str, Any]:
        took = (self.ended or time.monotonic()) - self.started
        return {
            "state": self.state,
            "files": self.files,
            "total_bytes": self.total_bytes,
            "cached_bytes": self.cached_bytes,
            "read_bytes": self.read_bytes,
            "held_bytes": self.held_bytes,
            "elapsed_s": round(took, 3),
            "detail": self.detail,
        }


@dataclass(eq=False)
class Swap:
    """A restart under way: a swap to another config, or a restart of the current one."""

    id: str
    from_config: str | None
    to_config: str
    is_swap: bool
    phase: SwapPhase = SwapPhase.STOPPING
    outcome_reason: str | None = None  # why it rolled back
    outcome_evidence: str | None = None
    launch_ids: list[str] = field(default_factory=list)
    outcome: dict[str, Any] | None = None
    # What a failed swap goes back to: the config serving when it began, else last-good
    # (read when the swap was asked for; None: it did not resolve then).
    rollback_name: str | None = None
    rollback_to: ResolvedConfig | None = None
    # While it pre-warms (the old server serves on): the config it brings up next, and how
    # far the read is (kept once it ends, for `/status`).
    pending: ResolvedConfig | None = None
    prewarm: PrewarmProgress | None = None

    @property
    def active(self) -> bool:
        """Not settled yet (its `outcome`, the answer, is set as it settles)."""
        return self.phase != SwapPhase.DONE

    def view(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "from": self.from_config,
            "to": self.to_config,
            "phase": str(self.phase),
            "prewarm": self.prewarm.view() if self.prewarm is not None else None,
        }


def utc_iso(ts: float | None) -> str | None:
    """A wall-clock time as the API writes it (pure formatting: no clock is read)."""
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


def utc_stamp(ts: float) -> str:
    """A launch id's time part."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(ts))
