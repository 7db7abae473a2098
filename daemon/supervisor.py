"""The supervisor: the single owner of the server's lifecycle.

One task (`run`) owns every piece of mutable lifecycle state. Everything else talks to it by
posting a message (`events.py`) to its inbox; commands carry a reply future. Long operations
(waiting for GPUs, grace periods, probes, sweeps, backoff) run as tasks that post their outcome
back, tagged with the launch generation so that late ones are dropped. State changes go through
`_transition`, which checks the one transition table in `states.py`.

A launch attempt: waiting_gpu → starting → ready; a failure anywhere ends in backoff (or failed,
for config errors and after `max_failures`), and the same sweep runs after every exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
import uuid
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import structlog

from gpuwarden.daemon import child as childmod
from gpuwarden.daemon.clock import Clock, SystemClock
from gpuwarden.daemon.configs import ConfigError, ConfigStore, ResolvedConfig, redacted_header_lines
from gpuwarden.daemon.events import (
    BackoffElapsed,
    ChildExited,
    EventNoted,
    GpuSample,
    GpuWaitDone,
    GraceExpired,
    LineParsed,
    ListenerChecked,
    Message,
    OrphansKilled,
    ProbationOver,
    ProbeFailed,
    ProbeSucceeded,
    RestartRequested,
    SaveAgain,
    ShutdownRequested,
    StableUptime,
    StartRequested,
    StartupTimedOut,
    StateSaved,
    StopRequested,
    SweepDone,
    TaskFailed,
    WriteHealth,
)
from gpuwarden.daemon.gpu import GpuBackend, GpuSnapshot, busy_gpus, describe_busy
from gpuwarden.daemon.health import HttpProber, Prober
from gpuwarden.daemon.launchlog import LaunchLog, LogUnwritable
from gpuwarden.daemon.listener import ListenerCheck, check_listener
from gpuwarden.daemon.logfiles import prune_logs
from gpuwarden.daemon.policy import NOT_RETRIED, Classification, backoff_delay, classify_exit
from gpuwarden.daemon.preflight import Preflight, PreflightResult
from gpuwarden.daemon.redact import Redactor
from gpuwarden.daemon.settings import Settings
from gpuwarden.daemon.sglanglines import Finding, ParsedLine, decode_metrics, strip_prefix
from gpuwarden.daemon.states import RUNNING_STATES, ServerState, check_transition
from gpuwarden.daemon.store import EventLog, StateStore

S = ServerState
log = structlog.get_logger("gpuwarden.supervisor")

MAX_FINDINGS = 200
# Findings logged this long before SGLang's death line are evidence of that death (its
# scheduler watchdog logs the timeout, then waits 5 s before the SIGQUIT); older ones are not.
DEATH_CONTEXT_S = 60.0
PIPE_DRAIN_S = 0.2  # after an exit, how long to wait for the last output before classifying
LAUNCH_HISTORY = 50
# The owner handles a message in milliseconds; one taking this long means supervision is stuck
# (the watchdog stops being fed). Config reads are bounded well below it.
OWNER_STALL_S = 60.0
# How long the post-exit sweep may take before it counts as overdue (it normally takes well
# under a second: pipes, a /proc walk, a GPU snapshot, the kills' own grace).
SWEEP_DEADLINE_S = 120.0
SAVE_RETRY_S = 2.0
BOOT_DEADLINE_S = 300.0  # the boot's config read and preflight (two introspections at most)


class CommandError(Exception):
    """A command the supervisor refuses; maps to an HTTP status."""

    def __init__(
        self, status: int, error: str, detail: str, extra: dict[str, Any] | None = None
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail
        self.extra = extra or {}


class Next(StrEnum):
    """What to do once a launch has exited and been swept."""

    STOP = "stop"  # stopped on request
    RELAUNCH = "relaunch"  # a restart or swap: start `next_config`
    RETRY = "retry"  # we ended it (startup timeout, liveness): the restart policy decides
    SHUTDOWN = "shutdown"  # the daemon is exiting


@dataclass
class Launch:
    gen: int
    config: ResolvedConfig
    launch_id: str = ""
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    log: LaunchLog | None = None
    child: childmod.ChildProcess | None = None
    redactor: Redactor = field(default_factory=Redactor)
    started_at: float | None = None
    started_mono: float | None = None
    ready_at: float | None = None
    ready_mono: float | None = None
    findings: list[Finding] = field(default_factory=list)
    finding_times: list[float] = field(default_factory=list)  # monotonic, one per finding
    exited: bool = False
    returncode: int | None = None
    next: Next | None = None
    next_config: ResolvedConfig | None = None
    imposed: Classification | None = None
    announced: str | None = None  # SGLang's line saying the server died
    # Where this exit's evidence starts in `findings`: DEATH_CONTEXT_S before SGLang's death
    # line (a watchdog timeout, an OOM logged just before), not a request's error of hours ago.
    death_at: int | None = None
    checking_listener: bool = False  # a readiness signal came; who listens is being asked
    listener_rechecked: bool = False
    probe_failures: int = 0
    swap: Swap | None = None  # the swap this attempt belongs to
    rollback: bool = False  # this attempt is a rollback to the last good config
    on_probation: bool = False
    rank_gpus: dict[int, list[int]] | None = None  # GPU -> pids of ours it held at ready
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)

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

    def cancel_tasks(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.tasks.clear()


@dataclass
class Swap:
    """A restart under way: a swap to another config, or a restart of the current one."""

    id: str
    from_config: str | None
    to_config: str
    is_swap: bool
    phase: str = "stopping"
    outcome_reason: str | None = None  # why it rolled back
    outcome_evidence: str | None = None
    launch_ids: list[str] = field(default_factory=list)
    outcome: dict[str, Any] | None = None
    # What a failed swap goes back to: the config serving when it began, else last-good.
    rollback_name: str | None = None
    rollback_to: ResolvedConfig | None = None
    settled: asyncio.Future[dict[str, Any]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    @property
    def active(self) -> bool:
        return self.outcome is None or self.phase == "rolling_back"

    def view(self) -> dict[str, Any]:
        return {"id": self.id, "from": self.from_config, "to": self.to_config, "phase": self.phase}


def utc_iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


def _launch_tree(main_pid: int) -> frozenset[tuple[int, float]]:
    """(pid, create_time) of a launch's main process, its descendants, and the orphans that
    reparented to this daemon (a subreaper runs one server at a time, so they are its)."""
    import psutil  # noqa: PLC0415

    out: set[tuple[int, float]] = set()
    roots = [main_pid]
    with contextlib.suppress(psutil.Error):
        me = psutil.Process()
        roots += [
            c.pid for c in me.children() if c.pid != main_pid and c.pid not in childmod._OWNED
        ]
    for root in roots:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(root)
            out.add((proc.pid, proc.create_time()))
            for c in proc.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    out.add((c.pid, c.create_time()))
    return frozenset(out)


class Supervisor:
    def __init__(
        self,
        settings: Settings,
        gpu: GpuBackend,
        *,
        configs: ConfigStore | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        prober: Prober | None = None,
        store: StateStore | None = None,
        events: EventLog | None = None,
        preflight: Preflight | None = None,
    ) -> None:
        self.settings = settings
        self.gpu = gpu
        self.configs = configs or ConfigStore(settings.configs_dir)
        self.clock: Clock = clock or SystemClock()
        self.rng = rng or random.Random()
        self.prober: Prober = prober or HttpProber()
        self.store = store or StateStore(settings.state_dir)
        self.events = events or EventLog(settings.state_dir / "events.jsonl")
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._running = False
        self._stopped = asyncio.Event()

        self.state = S.STOPPED
        self.state_since = self.clock.time()
        self._gen = 0
        self.launch: Launch | None = None
        self.intent_config: str | None = None
        self.intent_running = False
        self.last_good_config: str | None = None
        self.last_good_launch: str | None = None
        self.last_failed_launch: str | None = None
        self.failures = 0
        self.restarts = 0
        self.crash_loop = False
        self.next_retry_at: float | None = None
        self.last_exit: dict[str, Any] | None = None
        self.last_sweep_killed: list[dict[str, Any]] = []
        self.server_metrics: dict[str, Any] = {}
        self.gpu_snapshot = GpuSnapshot()
        self.launch_history: list[dict[str, Any]] = []
        self._launch_seq = 0
        self._backoff_task: asyncio.Task[Any] | None = None
        self._gpu_task: asyncio.Task[Any] | None = None
        self._shutdown_replies: list[asyncio.Future[Any]] = []
        # Called with each chunk's lines (raw: redact before serving them).
        self.line_listeners: set[Callable[[list[str]], None]] = set()
        self._subreaper = childmod.is_subreaper()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-writer")
        self._dirty = False
        self.preflight = preflight or Preflight()
        self.swap: Swap | None = None
        self.rolled_back_from: str | None = None
        self.exits_by_reason: dict[str, int] = {}
        self.ready_times: list[float] = []
        self._tree_cache: tuple[int, float, set[int]] | None = None
        # Processes known to be ours, of this and earlier launches: (pid, create_time) ->
        # launch id. Persisted, so a later daemon life recognises orphans holding GPU memory.
        self.known_ours: dict[tuple[int, float], str] = {}
        self.gpu_pids_unresolved = False
        self.event_listeners: list[Callable[[dict[str, Any]], None]] = []
        self.active_sweep: str | None = None  # set by the sweep manager
        # Every command takes a ticket when it is asked for (before any await), so a stop
        # cancels whatever was asked before it even if that finishes its preflight later.
        self._ticket = 0
        self._stop_ticket = 0
        # Files the daemon writes that fail now (target -> error), and failures so far.
        self.write_errors: dict[str, str] = {}
        self.write_failures: dict[str, int] = {}
        self._save_retry: asyncio.Task[Any] | None = None
        self.internal_errors = 0
        # For the watchdog: when the owner took the message it is handling (None: idle), and
        # the helper tasks that must finish by a deadline.
        self._handling_since: float | None = None
        self._deadlines: dict[asyncio.Task[Any], tuple[str, float]] = {}
        self._owner_task: asyncio.Task[Any] | None = None
        self.sweep_deadline_s = SWEEP_DEADLINE_S
        self.sweep_view: Callable[[], dict[str, Any]] | None = None
        self._listener_warned: set[str] = set()

    # -- public: thin clients of the owner task ---------------------------------------------------

    async def request(self, msg: StartRequested | StopRequested | RestartRequested) -> Any:
        self._inbox.put_nowait(msg)
        return await msg.reply

    def _take_ticket(self) -> int:
        self._ticket += 1
        return self._ticket

    async def check(self, name: str) -> PreflightResult:
        """The preflight of a config, without touching what runs (400/404 for bad names)."""
        cfg, invalid = await self._resolve_for_command(name, invalid_ok=True)
        if cfg is None:
            return invalid
        return await self.preflight.check(cfg, replacing_port=self._replacing_port())

    async def start(self, config: str | None = None) -> Any:
        ticket = self._take_ticket()  # before any await: its place among stops
        name = config or self.intent_config or self.settings.default_config
        cfg, invalid = await self._resolve_for_command(name, invalid_ok=True)
        pre = invalid if cfg is None else await self.preflight.check(cfg)
        return await self.request(StartRequested(name, preflight=pre, resolved=cfg, ticket=ticket))

    async def stop(self) -> Any:
        return await self.request(StopRequested(ticket=self._take_ticket()))

    async def restart(
        self, config: str | None = None, wait: bool = False, sweep_id: str | None = None
    ) -> Any:
        """Restart, or swap when `config` names another config. A swap is preflighted first:
        a refused one answers 422 and touches nothing."""
        ticket = self._take_ticket()
        name = config or self.intent_config or self.settings.default_config
        cfg, _ = await self._resolve_for_command(name)
        assert cfg is not None
        pre = None
        if cfg.name != self._current_config():
            pre = await self.preflight.check(cfg, replacing_port=self._replacing_port())
            if not pre.ok:
                raise CommandError(
                    422,
                    "preflight_refused",
                    "; ".join(pre.problems),
                    extra={"problems": pre.problems, "warnings": pre.warnings},
                )
        reply = await self.request(
            RestartRequested(
                cfg.name, preflight=pre, sweep_id=sweep_id, resolved=cfg, ticket=ticket
            )
        )
        if wait:
            swap: Swap = reply.pop("_swap")
            outcome = await asyncio.shield(swap.settled)
            # The state now, not the one at acceptance (which was stopping or waiting_gpu).
            reply = {**reply, **outcome, "state": str(self.state)}
        else:
            reply.pop("_swap", None)
        return reply

    async def _resolve_for_command(
        self, name: str | None, invalid_ok: bool = False
    ) -> tuple[ResolvedConfig | None, PreflightResult]:
        """(config, _): 400/404 raise; an invalid config (422) raises too unless `invalid_ok`,
        when it comes back as (None, a failed preflight result)."""
        try:
            return await self._resolve(name), PreflightResult(ok=True)
        except CommandError as exc:
            if exc.status == 422 and invalid_ok:
                return None, PreflightResult(ok=False, problems=[exc.detail])
            raise

    def _current_config(self) -> str | None:
        launch = self.launch
        if launch is not None and self.state in (S.WAITING_GPU, *RUNNING_STATES):
            return launch.config.name
        return self.intent_config

    def _replacing_port(self) -> int | None:
        launch = self.launch
        if launch is not None and launch.child is not None and not launch.exited:
            return launch.config.port
        return None

    async def shutdown(self) -> None:
        """Stop the server (the saved intent is kept) and end `run`."""
        msg = ShutdownRequested()
        self._inbox.put_nowait(msg)
        await msg.reply

    async def wait_for(self, predicate: Callable[[Supervisor], bool], timeout: float) -> None:
        """Wake on every handled message until `predicate(self)` holds."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: predicate(self))

    async def wait_for_state(self, *states: ServerState, timeout: float = 10.0) -> None:
        await self.wait_for(lambda s: s.state in states, timeout)

    def post(self, msg: Message) -> None:
        self._inbox.put_nowait(msg)

    # -- the owner ---------------------------------------------------------------------------

    async def run(self) -> None:
        self._running = True
        self._owner_task = asyncio.current_task()
        self._spawn(self._poll_gpus())
        await self._boot()
        self._save()
        await self._notify()
        try:
            while self._running:
                msg = await self._inbox.get()
                self._handling_since = time.monotonic()
                try:
                    await self._handle(msg)
                except CommandError as exc:
                    reply = getattr(msg, "reply", None)
                    if reply is not None and not reply.done():
                        reply.set_exception(exc)
                except Exception as exc:  # a bug must not take supervision down
                    log.exception("supervisor.error", message=type(msg).__name__)
                    reply = getattr(msg, "reply", None)
                    if reply is not None and not reply.done():
                        reply.set_exception(exc)
                    else:
                        self._recover(type(msg).__name__, exc)
                if self._dirty:
                    self._save()
                await self._notify()
                self._handling_since = None
        finally:
            if self._dirty:
                self._save()
            await asyncio.to_thread(self._writer.shutdown, wait=True)
            for task in list(self._tasks):
                task.cancel()
            await self.prober.close()
            self._stopped.set()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _handle(self, msg: Message) -> None:
        match msg:
            case StartRequested():
                msg.reply.set_result(await self._on_start(msg))
            case StopRequested():
                msg.reply.set_result(self._on_stop(msg))
            case RestartRequested():
                msg.reply.set_result(await self._on_restart(msg))
            case ProbationOver():
                self._on_probation_over(msg)
            case GpuSample():
                self._on_gpu_sample(msg)
            case OrphansKilled():
                self.last_sweep_killed = msg.killed
                self._event("gpu_orphans_killed", killed=msg.killed)
            case ShutdownRequested():
                self._on_shutdown(msg.reply)
            case GpuWaitDone():
                await self._on_gpu_wait_done(msg)
            case ChildExited():
                self._on_child_exited(msg)
            case SweepDone():
                await self._on_sweep_done(msg)
            case LineParsed():
                self._on_line_parsed(msg)
            case ProbeSucceeded():
                self._on_probe_ok(msg)
            case ListenerChecked():
                self._on_listener_checked(msg)
            case ProbeFailed():
                self._on_probe_failed(msg)
            case StartupTimedOut():
                self._on_startup_timeout(msg)
            case GraceExpired():
                self._on_grace_expired(msg)
            case BackoffElapsed():
                await self._on_backoff_elapsed(msg)
            case StableUptime():
                self._on_stable_uptime(msg)
            case EventNoted():
                self._event(msg.kind, **msg.fields)
            case TaskFailed():
                await self._on_task_failed(msg)
            case StateSaved():
                self._on_state_saved(msg)
            case WriteHealth():
                self._write_health(msg.target, msg.error)
            case SaveAgain():
                self._save_retry = None
                self._persist()

    # -- the one place state changes ---------------------------------------------------------------

    def _transition(self, new: ServerState, **fields: Any) -> None:
        old = self.state
        check_transition(old, new)
        self.state = new
        self.state_since = self.clock.time()
        if new != S.BACKOFF:
            self.next_retry_at = None
        self._event("state", **{"from": str(old), "to": str(new)}, **fields)

    def _event(self, kind: str, **fields: Any) -> None:
        launch = self.launch
        record: dict[str, Any] = {"ts": utc_iso(self.clock.time()), "event": kind}
        if launch is not None:
            record.setdefault("config", launch.config.name)
            if launch.launch_id:
                record["launch_id"] = launch.launch_id
        record.update({k: v for k, v in fields.items() if v is not None})
        self.events.append(record)
        if self.events.write_error != self.write_errors.get("events"):
            self._write_health("events", self.events.write_error)
        for listener in self.event_listeners:
            try:
                listener(record)
            except Exception:
                log.exception("supervisor.event_listener_failed")
        log.info(f"server.{kind}", **{k: v for k, v in record.items() if k not in ("event", "ts")})

    def _spawn(
        self,
        coro: Coroutine[Any, Any, Any],
        launch: Launch | None = None,
        *,
        gen: int | None = None,
        deadline_s: float | None = None,
    ) -> asyncio.Task[Any]:
        """A helper task of the owner. Its failure is posted back (`TaskFailed`), never lost;
        one with a deadline that runs past it makes supervision count as stuck."""
        name = getattr(coro, "__qualname__", "task").rsplit(".", 1)[-1].lstrip("_")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        if gen is None:
            gen = launch.gen if launch is not None else 0
        task.add_done_callback(lambda t: self._task_done(t, gen))
        if deadline_s is not None:
            self._deadlines[task] = (name, time.monotonic() + deadline_s)
        if launch is not None:
            launch.tasks.add(task)
            task.add_done_callback(launch.tasks.discard)
        return task

    def _task_done(self, task: asyncio.Task[Any], gen: int) -> None:
        self._tasks.discard(task)
        self._deadlines.pop(task, None)
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.error("supervisor.task_failed", task=task.get_name(), exc_info=exc)
        self.post(TaskFailed(task.get_name(), gen, f"{type(exc).__name__}: {exc}"))

    def stuck(self) -> str | None:
        """Why supervision is stuck, or None. The watchdog is fed only while this is None."""
        if self._owner_task is not None and self._owner_task.done():
            return "the supervisor's owner task has ended"
        now = time.monotonic()
        since = self._handling_since
        if since is not None and now - since > OWNER_STALL_S:
            return f"the owner has been handling one message for {now - since:.0f} s"
        for name, deadline in list(self._deadlines.values()):
            if now > deadline:
                return f"the {name} task is {now - deadline:.0f} s past its deadline"
        return None

    def _timer(
        self, seconds: float, msg: Message, launch: Launch | None = None
    ) -> asyncio.Task[Any]:
        async def fire() -> None:
            await self.clock.sleep(seconds)
            self.post(msg)

        return self._spawn(fire(), launch)

    # -- boot ----------------------------------------------------------------------------------

    async def _boot(self) -> None:
        data, note = self.store.load()
        if note:
            self._event("state_file_corrupt", detail=note)
        intent = data.get("intent") or {}
        self.intent_config = intent.get("config")
        self.intent_running = bool(intent.get("running"))
        self.last_good_config = data.get("last_good_config")
        self.last_good_launch = data.get("last_good_launch")
        self.last_failed_launch = data.get("last_failed_launch")
        self._launch_seq = int(data.get("launch_seq", 0) or 0)
        self.launch_history = list(data.get("launches") or [])[-LAUNCH_HISTORY:]
        self.last_exit = data.get("last_exit")
        for item in data.get("known_processes") or []:
            with contextlib.suppress(TypeError, ValueError):
                pid, ct, lid = int(item[0]), float(item[1]), str(item[2])
                if childmod.is_alive(pid, ct):  # the dead are forgotten
                    self.known_ours[(pid, ct)] = lid
        current = data.get("current_launch") or {}
        stopped = await self._stop_previous_life(current or None)
        self._close_unobserved(str(current.get("launch_id") or "") if stopped else "")
        name = None
        if intent:
            if self.intent_running and self.intent_config:
                name = self.intent_config
        elif self.settings.default_config:
            name = self.settings.default_config
        if name:
            self._resume_swap(data.get("swap"), name)
            ticket = self._take_ticket()  # a stop while the boot preflights cancels the boot
            self._spawn(self._boot_start(name, ticket), deadline_s=BOOT_DEADLINE_S)

    async def _boot_start(self, name: str, ticket: int) -> None:
        """Preflight gates the boot too: run it off the owner, then post the start."""
        cfg: ResolvedConfig | None = None
        try:
            cfg, pre = await self._resolve_for_command(name, invalid_ok=True)
        except CommandError as exc:
            pre = PreflightResult(ok=False, problems=[exc.detail])
        if cfg is not None:
            pre = await self.preflight.check(cfg)
        msg = StartRequested(name, boot=True, preflight=pre, resolved=cfg, ticket=ticket)
        self.post(msg)
        with contextlib.suppress(CommandError):
            await msg.reply
        self._persist()

    def _close_unobserved(self, stopped_id: str) -> None:
        """Every launch ends with an exit record. Those the previous life did not see end get
        one now: the one this boot stopped, and the others, which ended while it was away."""
        for entry in self.launch_history:
            if not isinstance(entry, dict) or entry.get("exit") is not None:
                continue
            launch_id = entry.get("launch_id")
            if launch_id and launch_id == stopped_id:
                reason = "requested_stop"
                evidence = "stopped at the daemon's start: its previous life left it running"
            else:
                reason = "ended_unobserved"
                evidence = "ended while the daemon was away (exit code and signal unknown)"
            entry["exit"] = self._exit_record(reason, evidence, launch_id=launch_id)
            self.last_exit = entry["exit"]
            self.exits_by_reason[reason] = self.exits_by_reason.get(reason, 0) + 1
            fields = {k: v for k, v in entry["exit"].items() if k != "at"}
            self._event("exit", **{**fields, "config": entry.get("config")})
            self._persist()

    def _resume_swap(self, record: Any, name: str) -> None:
        """A swap the previous life did not finish (or whose probation it did not see out)
        goes on as that swap: rollback and probation included."""
        if not isinstance(record, dict) or not record.get("id") or not record.get("to"):
            return
        rolling_back = record.get("phase") == "rolling_back"
        if name != (record.get("rollback_name") if rolling_back else record.get("to")):
            return  # the intent moved on since: nothing to resume
        self.swap = Swap(
            id=str(record["id"]),
            from_config=record.get("from"),
            to_config=str(record["to"]),
            is_swap=bool(record.get("is_swap", True)),
            phase="rolling_back" if rolling_back else "waiting_gpu",
            rollback_name=record.get("rollback_name"),
        )
        self._event(
            "swap_resumed",
            swap_id=self.swap.id,
            from_config=self.swap.from_config,
            to_config=self.swap.to_config,
            phase=record.get("phase"),
            detail="the daemon stopped during this swap; it goes on as the same swap",
        )

    def _swap_record(self) -> dict[str, Any] | None:
        swap = self.swap
        if swap is None:
            return None
        launch = self.launch
        on_probation = launch is not None and launch.on_probation and launch.swap is swap
        if not swap.active and not on_probation:
            return None
        return {
            "id": swap.id,
            "from": swap.from_config,
            "to": swap.to_config,
            "is_swap": swap.is_swap,
            "phase": swap.phase if swap.active else "probation",
            "rollback_name": swap.rollback_name
            or (swap.rollback_to.name if swap.rollback_to else None),
        }

    async def _stop_previous_life(self, record: dict[str, Any] | None) -> bool:
        """A server group from the daemon's previous life, still alive, is stopped first."""
        if not record:
            return False
        pid = int(record.get("pid") or 0)
        same_boot = record.get("boot_id") == childmod.boot_id()
        alive = same_boot and pid > 0 and childmod.is_alive(pid, record.get("create_time"))
        launch_id = str(record.get("launch_id") or "")
        token = str(record.get("token") or "")
        leftovers = (
            childmod.find_leftovers(token, record.get("pgid") if alive else None)
            if (same_boot and (token or alive))
            else []
        )
        if not alive and not leftovers:
            return False
        self._event(
            "previous_server_found",
            pid=pid,
            launch_id=launch_id,
            detail="a server from the daemon's previous life is still running; stopping it",
        )
        if alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + self.settings.stop.grace_s
            # Not our child: its death is no event we can await.
            while time.monotonic() < deadline and childmod.is_alive(pid, record.get("create_time")):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(record.get("pgid") or pid), signal.SIGKILL)
        leftovers = childmod.find_leftovers(token, int(record.get("pgid") or pid))
        killed = await childmod.kill_leftovers(leftovers)
        self._event(
            "previous_server_stopped",
            pid=pid,
            killed=[{"pid": k.pid, "name": k.name} for k in killed],
        )
        return alive

    # -- persistence ---------------------------------------------------------------------------

    def _persist(self) -> None:
        """Mark the saved state stale; it is written once after the message being handled."""
        self._dirty = True

    def _save(self) -> None:
        """Snapshot the state here, on the loop; write it (fsync and all) on the writer thread,
        so a relaunch never waits for the disk. Writes stay in order: one writer."""
        self._dirty = False
        done = self._writer.submit(self.store.save, self._state_record())
        loop = asyncio.get_running_loop()

        def report(fut: Any) -> None:
            error = fut.result() if fut.exception() is None else repr(fut.exception())
            with contextlib.suppress(RuntimeError):  # the loop is gone: the daemon is exiting
                loop.call_soon_threadsafe(self.post, StateSaved(error))

        done.add_done_callback(report)

    def _state_record(self) -> dict[str, Any]:
        launch = self.launch
        current = None
        if launch is not None and launch.child is not None and not launch.exited:
            current = {
                "launch_id": launch.launch_id,
                "token": launch.token,
                "config": launch.config.name,
                "pid": launch.child.pid,
                "pgid": launch.child.pgid,
                "create_time": launch.child.create_time,
                "boot_id": childmod.boot_id(),
                "started_at": launch.started_at,
            }
        return {
            "intent": {"config": self.intent_config, "running": self.intent_running},
            "last_good_config": self.last_good_config,
            "last_good_launch": self.last_good_launch,
            "last_failed_launch": self.last_failed_launch,
            "failures": self.failures,
            "launch_seq": self._launch_seq,
            "current_launch": current,
            "last_exit": self.last_exit,
            "launches": list(self.launch_history[-LAUNCH_HISTORY:]),
            "swap": self._swap_record(),
            "known_processes": [
                [pid, ct, lid] for (pid, ct), lid in list(self.known_ours.items())[-500:]
            ],
        }

    def _set_intent(self, config: str | None, running: bool) -> None:
        self.intent_config = config
        self.intent_running = running
        self._persist()

    # -- commands ------------------------------------------------------------------------------

    async def _resolve(self, name: str | None) -> ResolvedConfig:
        """Read a config off the loop: parsing a large or hostile file must not stall probes,
        timers, the API or the watchdog (the reader's limits bound how long it takes)."""
        if not name:
            raise CommandError(
                400, "bad_request", "no config given, none running and no default_config set"
            )
        try:
            return await asyncio.to_thread(self.configs.load, name)
        except ConfigError as exc:
            raise CommandError(exc.status, _error_name(exc.status), str(exc)) from exc

    def _cancelled_by_stop(self, ticket: int, what: str) -> None:
        if ticket and ticket < self._stop_ticket:
            raise CommandError(
                409, "conflict", f"a stop was requested after this {what}; it was not carried out"
            )

    async def _on_start(self, msg: StartRequested) -> dict[str, Any]:
        self._cancelled_by_stop(msg.ticket, "start")
        if not msg.boot:  # a boot resumes an interrupted swap as that swap
            self._no_swap_under_way()
        if self.state in (S.WAITING_GPU, *RUNNING_STATES):
            current = self.launch.config.name if self.launch else self.intent_config
            raise CommandError(
                409,
                "conflict",
                f"a server is already {self.state} (config {current}); use restart to swap",
            )
        name = msg.config or self.intent_config or self.settings.default_config
        pre: PreflightResult | None = msg.preflight
        if pre is not None and not pre.ok:
            detail = "; ".join(pre.problems) or "preflight failed"
            self._refuse(name, detail)
            raise CommandError(
                422,
                "preflight_refused",
                detail,
                extra={"problems": pre.problems, "warnings": pre.warnings},
            )
        try:
            resolved: ResolvedConfig | None = msg.resolved
            cfg = resolved if resolved is not None and resolved.name == name else None
            cfg = cfg or await self._resolve(name)
        except CommandError as exc:
            if exc.status == 422 or msg.boot:
                self._refuse(name, exc.detail)
            raise
        self._cancel_backoff()
        self.failures = 0
        self.crash_loop = False
        self._set_intent(cfg.name, True)
        swap = self.swap
        self._begin_attempt(cfg, rollback=swap is not None and swap.phase == "rolling_back")
        return {"accepted": True, "config": cfg.name, "state": str(self.state)}

    def _no_swap_under_way(self, sweep_id: str | None = None) -> None:
        if self.active_sweep is not None and sweep_id != self.active_sweep:
            raise CommandError(
                409, "conflict", f"sweep {self.active_sweep} is under way; cancel it, or stop"
            )
        swap = self.swap
        if swap is not None and swap.active:
            raise CommandError(
                409,
                "conflict",
                f"swap {swap.id} ({swap.from_config} → {swap.to_config}) is under way "
                f"({swap.phase}); wait for it, or stop",
            )

    def _exit_record(
        self,
        reason: str,
        evidence: str | None,
        *,
        code: int | None = None,
        sig: int | None = None,
        launch_id: str | None = None,
    ) -> dict[str, Any]:
        """The shape of `last_exit` and of each history entry's `exit`, wherever one is made."""
        return {
            "code": code,
            "signal": sig,
            "reason": reason,
            "evidence": evidence,
            "at": utc_iso(self.clock.time()),
            "launch_id": launch_id,
        }

    def _refuse(self, name: str | None, detail: str) -> None:
        """A start whose preflight failed: `failed` with `preflight_refused`."""
        self.intent_config, self.intent_running = name, True
        self.last_exit = self._exit_record("preflight_refused", detail)
        self._event("preflight_refused", config=name, detail=detail)
        if self.state != S.FAILED:
            self._transition(S.FAILED, reason="preflight_refused")
        self._persist()

    def _on_stop(self, msg: StopRequested) -> dict[str, Any]:
        # Stop wins: whatever was asked before it and is still on its way (a preflight that
        # finishes later) is refused when it arrives.
        self._stop_ticket = max(self._stop_ticket, msg.ticket or self._ticket)
        self._set_intent(self.intent_config, False)
        if self.swap is not None and self.swap.active:
            self._settle_swap("failed", "requested_stop", "stopped on request during the swap")
        launch = self.launch
        if self.state in (S.STOPPED,):
            return {"accepted": True, "state": str(self.state)}
        if self.state in (S.FAILED, S.BACKOFF, S.WAITING_GPU):
            self._cancel_backoff()
            self._cancel_gpu_wait()
            self._transition(S.STOPPED, reason="requested_stop")
        elif self.state == S.STOPPING and launch is not None:
            launch.next, launch.next_config = Next.STOP, None  # stop wins over a relaunch
        elif launch is not None:
            self._begin_stop(launch, Next.STOP)
        return {"accepted": True, "state": str(self.state)}

    async def _on_restart(self, msg: RestartRequested) -> dict[str, Any]:
        self._cancelled_by_stop(msg.ticket, "restart")
        self._no_swap_under_way(msg.sweep_id)
        name = msg.config or self.intent_config or self.settings.default_config
        resolved: ResolvedConfig | None = msg.resolved
        cfg = resolved if resolved is not None and resolved.name == name else None
        cfg = cfg or await self._resolve(name)
        current = self._current_config()
        serving = self._serving()
        if serving is not None and serving.on_probation:
            # A swap away from a config on probation: its probation counts as passed, and it is
            # what this swap rolls back to (it was serving, not the older last-good).
            serving.on_probation = False
            self.last_good_config = serving.config.name
            self.last_good_launch = serving.launch_id
            self._event("probation_passed", detail="a swap began while it served")
        swap = Swap(
            id=f"swap-{self._launch_seq + 1}-{int(self.clock.time())}",
            from_config=current,
            to_config=cfg.name,
            is_swap=cfg.name != current,
            rollback_name=serving.config.name if serving else self.last_good_config,
            rollback_to=serving.config if serving else None,
        )
        self.swap = swap
        self.rolled_back_from = None
        self._event(
            "swap" if swap.is_swap else "restart",
            swap_id=swap.id,
            from_config=current,
            to_config=cfg.name,
        )
        self.failures = 0
        self.crash_loop = False
        self._set_intent(cfg.name, True)
        launch = self.launch
        if self.state in (S.STARTING, S.READY, S.UNHEALTHY) and launch is not None:
            self._begin_stop(launch, Next.RELAUNCH, next_config=cfg)
        elif self.state == S.STOPPING and launch is not None:
            launch.next, launch.next_config = Next.RELAUNCH, cfg
        else:
            self._cancel_backoff()
            self._cancel_gpu_wait()
            self._begin_attempt(cfg)
        return {
            "accepted": True,
            "config": cfg.name,
            "state": str(self.state),
            "swap_id": swap.id,
            "_swap": swap,
        }

    def _serving(self) -> Launch | None:
        """The launch serving requests now (ready, or ready and failing probes)."""
        launch = self.launch
        if launch is None or launch.exited or launch.ready_at is None:
            return None
        return launch if self.state in (S.READY, S.UNHEALTHY) else None

    def _settle_swap(self, outcome: str, reason: str | None, evidence: str | None) -> None:
        swap = self.swap
        if swap is None:
            return
        swap.outcome = {
            "outcome": outcome,
            "reason": reason,
            "evidence": evidence,
            "launch_ids": list(swap.launch_ids),
            "swap_id": swap.id,
            "config": self.intent_config,
        }
        swap.phase = "done"
        if not swap.settled.done():
            swap.settled.set_result(swap.outcome)
        self._event("swap_settled", swap_id=swap.id, outcome=outcome, reason=reason)

    def _on_shutdown(self, reply: asyncio.Future[Any]) -> None:
        launch = self.launch
        if self.state in RUNNING_STATES and launch is not None:
            self._shutdown_replies.append(reply)
            if self.state != S.STOPPING:
                self._begin_stop(launch, Next.SHUTDOWN)
            else:
                launch.next, launch.next_config = Next.SHUTDOWN, None
            return
        self._cancel_backoff()
        self._cancel_gpu_wait()
        self._running = False
        self._persist()
        reply.set_result(None)

    # -- a launch attempt -----------------------------------------------------------------------

    def _begin_attempt(self, cfg: ResolvedConfig, rollback: bool = False) -> None:
        self._gen += 1
        swap = self.swap if self.swap is not None and self.swap.active else None
        self.launch = Launch(gen=self._gen, config=cfg, swap=swap, rollback=rollback)
        if swap is not None and swap.phase != "rolling_back":
            swap.phase = "waiting_gpu"
        if self.state != S.WAITING_GPU:
            self._transition(S.WAITING_GPU, config=cfg.name)
        self._gpu_task = self._spawn(
            self._wait_for_gpus(self.launch),
            gen=self._gen,
            deadline_s=self.settings.gpu.release_timeout_s + self.sweep_deadline_s,
        )

    async def _wait_for_gpus(self, launch: Launch) -> None:
        cfg = self.settings.gpu
        deadline = self.clock.monotonic() + cfg.release_timeout_s
        announced = False
        while True:
            snap = await self._snapshot()
            self.gpu_snapshot = snap
            busy = busy_gpus(snap, launch.config.gpus, cfg.busy_above_mib)
            if not busy:
                self.post(GpuWaitDone(launch.gen, True))
                return
            await self._kill_gpu_orphans(busy)
            if not announced:
                announced = True
                self.post_event("gpu_wait", detail=describe_busy(busy))
            if self.clock.monotonic() >= deadline:
                self.post(GpuWaitDone(launch.gen, False, describe_busy(busy)))
                return
            await self.clock.sleep(cfg.poll_interval_s)

    async def _kill_gpu_orphans(self, gpus: list[Any]) -> list[dict[str, Any]]:
        """Holders that are ours (an earlier launch's, by pid and create time) are killed;
        foreign holders never are."""
        launch = self.launch
        running = launch.child.pid if launch and launch.child and not launch.exited else None
        targets = []
        for g in gpus:
            for p in g.processes:
                if p.pid == running:
                    continue
                launch_id = self.ours(p.pid)
                ct = childmod.create_time_of(p.pid)
                if launch_id is not None and ct is not None:
                    targets.append(
                        (childmod.Leftover(p.pid, ct, p.name, ""), g.index, p.used_mib, launch_id)
                    )
        if not targets:
            return []
        killed = await childmod.kill_leftovers([t[0] for t in targets])
        report = [
            {"pid": t[0].pid, "name": t[0].name, "gpu": t[1], "used_mib": t[2], "launch_id": t[3]}
            for t in targets
            if t[0] in killed
        ]
        if report:
            self.post(OrphansKilled(report))
        return report

    def post_event(self, kind: str, **fields: Any) -> None:
        """Record an event from a helper task: posted, so the owner records it and wakes waiters."""
        self.post(EventNoted(kind, fields))

    def _current(self, gen: int) -> Launch | None:
        launch = self.launch
        return launch if launch is not None and launch.gen == gen else None

    async def _on_gpu_wait_done(self, msg: GpuWaitDone) -> None:
        launch = self._current(msg.gen)
        if launch is None or self.state != S.WAITING_GPU:
            return
        if not msg.ok:
            await self._fail(
                launch,
                Classification(
                    "gpu_busy",
                    f"GPUs still busy after {self.settings.gpu.release_timeout_s:g} s: {msg.busy}",
                ),
            )
            return
        await self._launch_now(launch)

    def _new_launch_id(self) -> str:
        self._launch_seq += 1
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self.clock.time()))
        return f"{stamp}-{self._launch_seq:06d}"

    async def _launch_now(self, launch: Launch) -> None:
        cfg = launch.config
        launch.launch_id = self._new_launch_id()
        launch.redactor = Redactor(cfg.secret_values())
        path = self.settings.log_dir / cfg.name / f"{launch.launch_id}.log"
        header = [
            f"gpuwarden launch {launch.launch_id} at {utc_iso(self.clock.time())}",
            *redacted_header_lines(cfg),
        ]
        gen = launch.gen
        try:
            launch.log = LaunchLog(
                path,
                header,
                on_lines=lambda lines, parsed: self._on_lines(launch, lines, parsed),
                redact=launch.redactor.text,
                on_write=lambda error: self.post(WriteHealth("launch_log", error, gen)),
            )
        except LogUnwritable as exc:
            await self._fail(
                launch, Classification("log_unwritable", f"cannot create the log: {exc}")
            )
            return
        self._write_health("launch_log", None)  # a new file, written: any earlier gap is over
        env = cfg.process_env(os.environ)
        try:
            child = await childmod.spawn(
                cfg.argv, env, launch.launch_id, launch.log.feed, token=launch.token
            )
        except Exception as exc:  # OSError from exec; anything else must not strand the attempt
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else repr(exc)
            detail = f"cannot execute {cfg.argv[0]!r}: {reason}"
            launch.log.close(f"exec failed: {detail}")
            await self._fail(launch, Classification("exec_failed", detail))
            return
        launch.child = child
        if launch.swap is not None:
            launch.swap.launch_ids.append(launch.launch_id)
            if launch.swap.phase == "waiting_gpu":
                launch.swap.phase = "starting"
        launch.started_at = self.clock.time()
        launch.started_mono = self.clock.monotonic()
        child.exited.add_done_callback(
            lambda fut: self.post(ChildExited(gen, fut.result() if not fut.cancelled() else None))
        )
        self.launch_history.append(  # every launch is on record from its start; the exit fills in
            {
                "launch_id": launch.launch_id,
                "config": cfg.name,
                "pid": child.pid,
                "started_at": utc_iso(launch.started_at),
                "ready_at": None,
                "log_file": str(path),
                "exit": None,
            }
        )
        del self.launch_history[:-LAUNCH_HISTORY]
        self._transition(S.STARTING, pid=child.pid, log_file=str(path))
        self._event("launch", pid=child.pid, argv=cfg.redacted_argv(), log_file=str(path))
        self._persist()
        health = cfg.config.health
        self._timer(health.startup_timeout_s, StartupTimedOut(gen), launch)
        self._spawn(self._probe_loop(launch, readiness=True), launch)
        self._spawn(self._prune_logs())

    def _on_lines(
        self, launch: Launch, lines: list[str], parsed: list[tuple[str, ParsedLine]]
    ) -> None:
        """Called by the log pipeline once per chunk. Findings are log data kept on the launch;
        what changes state (the ready line) or status (decode metrics) is posted to the owner."""
        for listener in list(self.line_listeners):
            listener(lines)
        now = time.monotonic()
        for text, result in parsed:
            if result.death and launch.death_at is None:
                since = now - DEATH_CONTEXT_S
                launch.death_at = next(
                    (i for i, t in enumerate(launch.finding_times) if t >= since),
                    len(launch.findings),
                )
            if result.findings:
                launch.add_findings(
                    [Finding(f.kind, launch.redactor.text(f.line)) for f in result.findings], now
                )
            if result.ready or result.decode is not None or result.death:
                self.post(LineParsed(launch.gen, result, text))

    def _on_line_parsed(self, msg: LineParsed) -> None:
        launch = self._current(msg.gen)
        if launch is None:
            return
        if msg.parsed.decode is not None:
            self.server_metrics = {
                **decode_metrics(msg.parsed.decode),
                "at": utc_iso(self.clock.time()),
            }
        if msg.parsed.death:
            self._on_death_announced(launch, launch.redactor.text(strip_prefix(msg.line).strip()))
        elif msg.parsed.ready and self.state == S.STARTING:
            self._confirm_ready(launch, "ready line")

    def _on_death_announced(self, launch: Launch, line: str) -> None:
        """SGLang says a process of the server died. It is dead: what follows is diagnostics
        (5 s of settling, py-spy, up to 60 s waiting for CUDA coredumps) with its port open and
        requests hanging. No grace and no probe can change that, so the group is SIGKILLed now
        and the exit's evidence is SGLang's line."""
        if launch.announced is not None or launch.exited or launch.child is None:
            return
        launch.announced = line
        self._event("death_announced", line=line)
        if launch.next is None:
            # Not being stopped yet: a crash, retried by the policy. Already being stopped (on
            # request, or by us for a timeout, a probe, a foreign listener), that reason stands:
            # our SIGTERM may be what the line reports.
            launch.next = Next.RETRY
        launch.cancel_tasks()
        if self.state != S.STOPPING:
            # STARTING | READY | UNHEALTHY -> STOPPING
            self._transition(
                S.STOPPING, next=str(launch.next), reason="death_announced", detail=line
            )
        launch.child.kill_group()

    def _on_probe_ok(self, msg: ProbeSucceeded) -> None:
        launch = self._current(msg.gen)
        if launch is None:
            return
        if self.state == S.STARTING:
            self._confirm_ready(launch, msg.detail)
        elif self.state in (S.READY, S.UNHEALTHY):
            launch.probe_failures = 0

    def _confirm_ready(self, launch: Launch, how: str) -> None:
        """The ready line or a 200 says ready; neither proves that this launch answers (SGLang
        prints its ready line when its warm-up reached another server on its port, its own
        bind having failed). Ask who holds the health URL's socket first."""
        if launch.checking_listener or launch.child is None:
            return
        if not launch.config.config.health.check_listener:
            self._became_ready(launch, how)
            return
        launch.checking_listener = True
        self._spawn(self._check_listener(launch, how), launch)

    async def _check_listener(self, launch: Launch, how: str) -> None:
        assert launch.child is not None
        main = launch.child.pid
        url = launch.config.health_url

        def tree() -> list[int]:
            return [pid for pid, _ in _launch_tree(main)]

        check = await asyncio.to_thread(check_listener, url, tree)
        self.post(ListenerChecked(launch.gen, how, check))

    def _on_listener_checked(self, msg: ListenerChecked) -> None:
        launch = self._current(msg.gen)
        if launch is None or self.state != S.STARTING:
            return
        launch.checking_listener = False
        check: ListenerCheck = msg.check
        if check.ours is False:
            self._end_for_retry(launch, "port_in_use", check.detail)  # STARTING -> STOPPING
            return
        if check.nothing_listens and msg.how != "ready line" and not launch.listener_rechecked:
            # A 200, and then nobody listens: whoever answered may be gone. Not ready yet: probe
            # again. A second time it is taken as "cannot tell" (a port forwarded by the kernel,
            # as docker does without its proxy, has no listener here).
            launch.listener_rechecked = True
            self._spawn(self._probe_loop(launch, readiness=True), launch)
            return
        if check.ours is None and launch.config.name not in self._listener_warned:
            # Said once per config: the same reason holds for every launch of it.
            self._listener_warned.add(launch.config.name)
            self._event(
                "listener_unchecked",
                config=launch.config.name,
                detail=f"cannot check that this launch answers {launch.config.health_url}: "
                f"{check.detail}; readiness rests on the {msg.how}",
            )
        self._became_ready(launch, msg.how)

    def _became_ready(self, launch: Launch, how: str) -> None:
        launch.ready_at = self.clock.time()
        launch.ready_mono = self.clock.monotonic()
        launch.cancel_tasks()
        took = launch.ready_mono - (launch.started_mono or launch.ready_mono)
        self._transition(S.READY, via=how, time_to_ready_s=round(took, 3))
        self.ready_times = [*self.ready_times[-99:], took]
        swap = launch.swap
        if swap is not None and swap.active and launch.rollback:
            self._settle_swap("rolled_back", swap.outcome_reason, swap.outcome_evidence)
        elif swap is not None and swap.active:
            self._settle_swap("ready", None, f"{launch.config.name} is ready")
        probation = self.settings.restart.probation_s
        if swap is not None and swap.is_swap and not launch.rollback and probation > 0:
            # A swapped-in config becomes last-good only once it has stayed up.
            launch.on_probation = True
            self._timer(probation, ProbationOver(launch.gen), launch)
        else:
            self.last_good_config = launch.config.name
            self.last_good_launch = launch.launch_id
        self._persist()
        self._spawn(self._probe_loop(launch, readiness=False), launch)
        self._timer(self.settings.restart.reset_after_s, StableUptime(launch.gen), launch)
        self._spawn(self._refresh_gpus())

    async def _probe_loop(self, launch: Launch, readiness: bool) -> None:
        health = launch.config.config.health
        url = launch.config.health_url
        while True:
            await self.clock.sleep(
                health.interval_s if not readiness else min(health.interval_s, 1.0)
            )
            result = await self.prober.probe(url, health.timeout_s)
            if result.ok:
                if readiness or launch.probe_failures:
                    self.post(ProbeSucceeded(launch.gen, result.detail))
                if readiness:
                    return
            elif not readiness:
                self.post(ProbeFailed(launch.gen, result.detail))

    def _on_probe_failed(self, msg: ProbeFailed) -> None:
        launch = self._current(msg.gen)
        if launch is None or self.state not in (S.READY, S.UNHEALTHY):
            return
        launch.probe_failures += 1
        limit = launch.config.config.health.failures
        self._event("probe_failed", detail=msg.detail, consecutive=launch.probe_failures)
        if launch.probe_failures >= limit:
            self._transition(S.UNHEALTHY, detail=msg.detail)
            self._end_for_retry(
                launch, "liveness_failed", f"{limit} consecutive failed probes; last: {msg.detail}"
            )

    def _on_gpu_sample(self, msg: GpuSample) -> None:
        snap: GpuSnapshot = msg.snapshot
        self.gpu_snapshot = snap
        self._check_resolvable(snap)
        launch = self._current(msg.gen)
        if launch is None or launch.exited or not msg.tree:
            return
        tree_pids = {pid for pid, _ in msg.tree}
        holders = {p.pid for g in snap.gpus for p in g.processes}
        for key in msg.tree:
            if key[0] in holders and key not in self.known_ours:
                self.known_ours[key] = launch.launch_id
                self._persist()
        if self.state != S.READY:
            return
        held = {g.index: [p.pid for p in g.processes if p.pid in tree_pids] for g in snap.gpus}
        if launch.rank_gpus is None:
            launch.rank_gpus = {i: pids for i, pids in held.items() if pids}
            if launch.rank_gpus:
                self._event("ranks", gpus=sorted(launch.rank_gpus))
            self._persist()
            return
        lost = [i for i in launch.rank_gpus if not held.get(i)]
        if lost:
            i = lost[0]
            self._end_for_retry(
                launch,
                "rank_lost",
                f"GPU {i} no longer holds a process of this launch "
                f"(it held pid {', '.join(map(str, launch.rank_gpus[i]))} when ready)",
            )

    def _check_resolvable(self, snap: GpuSnapshot) -> None:
        """NVML in a container may report pids of another namespace: say so once, and never
        call such a holder ours (decisions fall back to memory alone)."""
        if self.gpu_pids_unresolved:
            return
        import psutil  # noqa: PLC0415

        missing = [p.pid for g in snap.gpus for p in g.processes if not psutil.pid_exists(p.pid)]
        if missing and self.gpu.name == "nvml":
            self.gpu_pids_unresolved = True
            self._event(
                "gpu_pids_unresolved",
                pids=missing[:8],
                detail="NVML reports pids this daemon cannot see (another pid namespace?); "
                "GPU holders are judged by memory only and none is treated as ours",
            )

    def ours(self, pid: int) -> str | None:
        """The launch id a live process belongs to, if it is ours (pid and create time)."""
        from gpuwarden.daemon.child import create_time_of  # noqa: PLC0415

        if self.gpu_pids_unresolved:
            return None
        ct = create_time_of(pid)
        if ct is None:
            return None
        for (kpid, kct), launch_id in self.known_ours.items():
            if kpid == pid and abs(kct - ct) < 0.05:
                return launch_id
        return None

    def _on_probation_over(self, msg: ProbationOver) -> None:
        launch = self._current(msg.gen)
        if launch is None or not launch.on_probation or self.state != S.READY:
            return
        launch.on_probation = False
        self.last_good_config = launch.config.name
        self.last_good_launch = launch.launch_id
        self._event("probation_passed", probation_s=self.settings.restart.probation_s)
        self._persist()

    def _on_startup_timeout(self, msg: StartupTimedOut) -> None:
        launch = self._current(msg.gen)
        if launch is None or self.state != S.STARTING:
            return
        timeout = launch.config.config.health.startup_timeout_s
        self._end_for_retry(
            launch, "startup_timeout", f"not ready within startup_timeout_s={timeout:g}"
        )

    def _on_stable_uptime(self, msg: StableUptime) -> None:
        if self._current(msg.gen) is None or self.state != S.READY:
            return
        if self.failures or self.crash_loop:
            self._event("failures_reset", after_failures=self.failures)
        self.failures = 0
        self.crash_loop = False
        self._persist()

    # -- stopping ------------------------------------------------------------------------------

    def _begin_stop(
        self,
        launch: Launch,
        nxt: Next,
        next_config: ResolvedConfig | None = None,
        imposed: Classification | None = None,
    ) -> None:
        launch.next, launch.next_config, launch.imposed = nxt, next_config, imposed
        if self.state != S.STOPPING:
            self._transition(S.STOPPING, next=str(nxt), reason=imposed.reason if imposed else None)
        if launch.exited or launch.child is None:
            return  # the exit is already being handled
        launch.cancel_tasks()
        launch.child.signal(signal.SIGTERM)
        self._timer(self.settings.stop.grace_s, GraceExpired(launch.gen), launch)

    def _end_for_retry(self, launch: Launch, reason: str, evidence: str) -> None:
        """We end this launch (it is not ready in time, not live, or lost a rank): stop it, and
        let the restart policy (or a swap's rollback) decide what follows."""
        self._begin_stop(launch, Next.RETRY, imposed=Classification(reason, evidence))

    def _on_grace_expired(self, msg: GraceExpired) -> None:
        launch = self._current(msg.gen)
        if launch is None or launch.exited or launch.child is None:
            return
        self._event(
            "stop_escalated",
            detail=f"still running after grace_s={self.settings.stop.grace_s:g}; "
            "SIGKILL to the group",
        )
        launch.child.kill_group()

    def _on_child_exited(self, msg: ChildExited) -> None:
        launch = self._current(msg.gen)
        if launch is None or launch.exited:
            return
        launch.exited = True
        launch.returncode = msg.returncode
        launch.cancel_tasks()
        if self.state != S.STOPPING:
            self._transition(S.STOPPING, returncode=msg.returncode, detail="the server exited")
        self._spawn(self._after_exit(launch), gen=launch.gen, deadline_s=self.sweep_deadline_s)

    async def _after_exit(self, launch: Launch) -> None:
        """Let the last output in (bounded: a grandchild may hold the pipes), then sweep."""
        child = launch.child
        assert child is not None
        await child.wait_pipes_closed(PIPE_DRAIN_S)
        killed: list[childmod.Leftover] = []
        if not (self._subreaper and childmod.nothing_left(child.pgid)):
            leftovers = await asyncio.to_thread(childmod.find_leftovers, launch.token, child.pgid)
            killed = await childmod.kill_leftovers(leftovers)
        report = [{"pid": k.pid, "name": k.name, "cmdline": k.cmdline} for k in killed]
        # Holders of ours the tree walk could not reach (an earlier launch's orphans).
        snap = await self._snapshot()
        report += await self._kill_gpu_orphans(list(snap.gpus))
        self.post(SweepDone(launch.gen, report))

    async def _on_sweep_done(self, msg: SweepDone) -> None:
        launch = self._current(msg.gen)
        if launch is None or launch.child is None:
            return
        if msg.killed:
            self.last_sweep_killed = msg.killed
            self._event("sweep", killed=msg.killed)
        requested = launch.next in (Next.STOP, Next.RELAUNCH, Next.SHUTDOWN)
        # After SGLang's death line, what it logged before (a request's traceback hours ago)
        # is no evidence of this exit.
        findings = launch.findings
        if launch.death_at is not None and launch.death_at < len(findings):
            findings = findings[launch.death_at :]
        verdict = classify_exit(
            launch.returncode,
            findings,
            requested_stop=requested and launch.imposed is None,
            imposed=launch.imposed,
        )
        self._record_exit(launch, verdict)
        if launch.log is not None:
            launch.log.close(f"exit: {self.last_exit and self.last_exit['evidence']}")
        launch.child.close()
        nxt = launch.next
        if nxt is None or nxt == Next.RETRY:
            await self._fail(launch, verdict, recorded=True)
        elif nxt == Next.STOP:
            self._transition(S.STOPPED, reason=verdict.reason)
        elif nxt == Next.RELAUNCH:
            assert launch.next_config is not None
            self.restarts += 1
            self._begin_attempt(launch.next_config)
        elif nxt == Next.SHUTDOWN:
            self._transition(S.STOPPED, reason="daemon shutdown")
            self._running = False
            for reply in self._shutdown_replies:
                if not reply.done():
                    reply.set_result(None)
        self._persist()

    def _record_exit(self, launch: Launch, verdict: Classification) -> None:
        from gpuwarden.daemon.policy import describe_returncode  # noqa: PLC0415

        code, sig, _ = describe_returncode(launch.returncode) if launch.exited else (None, None, "")
        self.last_exit = self._exit_record(
            verdict.reason,
            launch.redactor.text(verdict.evidence),
            code=code,
            sig=sig,
            launch_id=launch.launch_id or None,
        )
        self._event("exit", **{k: v for k, v in self.last_exit.items() if k not in ("at",)})
        if launch.launch_id:
            entry = next(
                (e for e in reversed(self.launch_history) if e["launch_id"] == launch.launch_id),
                None,
            )
            if entry is None:
                entry = {"launch_id": launch.launch_id}
                self.launch_history.append(entry)
                del self.launch_history[:-LAUNCH_HISTORY]
            entry.update(
                {
                    "config": launch.config.name,
                    "pid": launch.child.pid if launch.child else None,
                    "started_at": utc_iso(launch.started_at),
                    "ready_at": utc_iso(launch.ready_at),
                    "log_file": str(launch.log.path) if launch.log else None,
                    "exit": self.last_exit,
                }
            )

    # -- the daemon's own failures -----------------------------------------------------------------

    async def _on_task_failed(self, msg: TaskFailed) -> None:
        """A helper task raised (descriptors exhausted, /proc unreadable, a bug): record it, then
        recover so the machine never waits for a message that will not come."""
        self.internal_errors += 1
        self._event("internal_error", task=msg.name, error=msg.error)
        launch = self._current(msg.gen)
        evidence = f"the {msg.name} task failed: {msg.error}"
        if msg.name == "after_exit":
            if launch is not None and launch.exited and self.state == S.STOPPING:
                # Degrade: the exit is handled without the sweep (leftovers may remain; the
                # next launch's GPU wait still finds and kills holders of ours).
                await self._on_sweep_done(SweepDone(msg.gen, []))
        elif msg.name == "wait_for_gpus":
            if launch is not None and self.state == S.WAITING_GPU:
                await self._fail(launch, Classification("internal_error", evidence))  # retried
        elif msg.name == "boot_start":
            if self.state == S.STOPPED:
                self.last_exit = self._exit_record("internal_error", evidence)
                # STOPPED -> FAILED
                self._transition(S.FAILED, reason="internal_error", detail=evidence)
        elif (
            launch is not None
            and not launch.exited
            and launch.child is not None
            and self.state in (S.STARTING, S.READY, S.UNHEALTHY)
        ):
            # A probe loop or timer of this launch is gone: nothing would notice a hang or a
            # timeout any more, so end it and let the restart policy start it afresh.
            self._end_for_retry(launch, "internal_error", evidence)

    def _recover(self, message: str, exc: Exception) -> None:
        """An internal message whose handling raised (a bug): say so, and where the launch has
        already exited, go to failed rather than wait in stopping for ever."""
        self.internal_errors += 1
        evidence = f"handling {message} failed: {type(exc).__name__}: {exc}"
        with contextlib.suppress(Exception):
            self._event("internal_error", message=message, error=evidence)
            launch = self.launch
            if self.state == S.STOPPING and (launch is None or launch.exited):
                self._transition(S.FAILED, reason="internal_error", detail=evidence)  # -> FAILED

    # -- writes that fail ----------------------------------------------------------------------

    def _on_state_saved(self, msg: StateSaved) -> None:
        self._write_health("state", msg.error)
        if msg.error is not None and self._save_retry is None:
            # Keep trying: the state on disk is stale until a write succeeds.
            self._save_retry = self._timer(SAVE_RETRY_S, SaveAgain())

    def _write_health(self, target: str, error: str | None) -> None:
        """A file the daemon writes began failing or works again: an event, a log line, a
        status field and a metric, once per change (not once per failed write)."""
        before = self.write_errors.get(target)
        if error == before:
            return
        if error is None:
            del self.write_errors[target]
            self._event("write_resumed", target=target, detail=f"{target} is written again")
            log.warning("daemon.write_resumed", target=target)
            return
        self.write_errors[target] = error
        if before is None:
            self.write_failures[target] = self.write_failures.get(target, 0) + 1
            log.error("daemon.write_failed", target=target, error=error)
            self._event("write_failed", target=target, error=error)

    # -- failures and the restart policy --------------------------------------------------------

    async def _fail(self, launch: Launch, verdict: Classification, recorded: bool = False) -> None:
        if not recorded:
            self._record_exit(launch, verdict)
        self.exits_by_reason[verdict.reason] = self.exits_by_reason.get(verdict.reason, 0) + 1
        swap = launch.swap
        first_start = swap is not None and swap.is_swap and swap.active and not launch.rollback
        in_probation = launch.on_probation and launch.ready_mono is not None
        if first_start or in_probation:
            await self._roll_back(launch, verdict)
            return
        if swap is not None and swap.active:
            # A plain restart, or the rollback itself, failed: the policy takes it from here.
            self._settle_swap("failed", verdict.reason, verdict.evidence)
        policy = self.settings.restart
        self.failures += 1
        if launch.launch_id:
            self.last_failed_launch = launch.launch_id
        if self.failures >= policy.crash_loop_after and not self.crash_loop:
            self.crash_loop = True
            self._event("crash_loop", failures=self.failures, reason=verdict.reason)
        if verdict.reason in NOT_RETRIED:
            self._transition(S.FAILED, reason=verdict.reason, detail="not retried: fix the config")
        elif policy.max_failures is not None and self.failures >= policy.max_failures:
            self._transition(
                S.FAILED,
                reason=verdict.reason,
                detail=f"{self.failures} consecutive failures (max_failures)",
            )
        else:
            delay = backoff_delay(policy, self.failures, self.rng)
            self.next_retry_at = self.clock.time() + delay
            self._transition(
                S.BACKOFF, reason=verdict.reason, delay_s=round(delay, 3), failures=self.failures
            )
            self.next_retry_at = self.clock.time() + delay
            # Even with no delay the retry is a message of its own: its config read is awaited
            # there, not inside the handling of this exit.
            self._backoff_task = self._timer(max(delay, 0.0), BackoffElapsed(launch.gen))
        self._persist()

    async def _roll_back(self, launch: Launch, verdict: Classification) -> None:
        """A swapped-in config failed its first start or its probation: back at once, no
        backoff, to the config that served when the swap began (else the last good one)."""
        failed = launch.config.name
        if launch.launch_id:
            self.last_failed_launch = launch.launch_id
        began = launch.swap
        target_cfg = began.rollback_to if began is not None else None
        target = (began.rollback_name if began is not None else None) or self.last_good_config
        swap = launch.swap
        if swap is None or swap.outcome is not None:
            swap = Swap(
                id=f"rollback-{self._launch_seq}",
                from_config=failed,
                to_config=target or failed,
                is_swap=True,
            )
            self.swap = swap
        swap.outcome = None
        swap.outcome_reason, swap.outcome_evidence = verdict.reason, verdict.evidence
        if not target or target == failed:
            self._transition(
                S.FAILED,
                reason=verdict.reason,
                detail=f"swap to {failed} failed and there is no last good config",
            )
            self._settle_swap("failed", verdict.reason, verdict.evidence)
            self._persist()
            return
        try:
            cfg = target_cfg if target_cfg is not None else await self._resolve(target)
        except CommandError as exc:
            self._transition(S.FAILED, reason="preflight_refused", detail=exc.detail)
            self._settle_swap("failed", verdict.reason, verdict.evidence)
            return
        swap.phase = "rolling_back"
        self.rolled_back_from = failed
        self._event(
            "rollback",
            swap_id=swap.id,
            from_config=failed,
            to_config=target,
            reason=verdict.reason,
            evidence=verdict.evidence,
        )
        self._set_intent(target, True)
        self._begin_attempt(cfg, rollback=True)

    async def _on_backoff_elapsed(self, msg: BackoffElapsed) -> None:
        if self._current(msg.gen) is None or self.state != S.BACKOFF:
            return
        name = self.intent_config
        try:
            cfg = await self._resolve(name)
        except CommandError as exc:
            self._refuse(name, exc.detail)
            return
        self.restarts += 1
        self._begin_attempt(cfg)

    def _cancel_backoff(self) -> None:
        if self._backoff_task is not None:
            self._backoff_task.cancel()
            self._backoff_task = None

    def _cancel_gpu_wait(self) -> None:
        if self._gpu_task is not None:
            self._gpu_task.cancel()
            self._gpu_task = None

    # -- background ------------------------------------------------------------------------------

    async def _snapshot(self) -> GpuSnapshot:
        """NVML calls can block (a wedged driver): off the loop. The others are cheap."""
        if getattr(self.gpu, "blocking", True):
            return await asyncio.to_thread(self.gpu.snapshot)
        return self.gpu.snapshot()

    async def _refresh_gpus(self) -> None:
        with contextlib.suppress(Exception):
            self.gpu_snapshot = await asyncio.to_thread(self.gpu.snapshot)

    async def _poll_gpus(self) -> None:
        """Once a second: a GPU snapshot and the running launch's process tree, posted to the
        owner (which attributes holders, notes ranks at ready and notices a lost rank)."""
        while True:
            launch = self.launch
            if self.state != S.WAITING_GPU:  # the wait polls faster on its own
                try:
                    snap = await self._snapshot()
                    tree: frozenset[tuple[int, float]] = frozenset()
                    holders = any(g.processes for g in snap.gpus)
                    running = launch is not None and launch.child is not None and not launch.exited
                    watching = launch is not None and bool(launch.rank_gpus)
                    # The tree walk reads /proc: only worth it when some GPU lists a process, or
                    # when ranks are watched (a lost rank shows as a GPU that lists none).
                    if (holders or watching) and running and launch is not None and launch.child:
                        tree = await asyncio.to_thread(_launch_tree, launch.child.pid)
                    self.post(GpuSample(launch.gen if launch else 0, snap, tree))
                except Exception:
                    log.exception("gpu.poll_failed")
            await asyncio.sleep(1.0)

    async def _prune_logs(self) -> None:
        protect = {
            x
            for x in (
                self.launch.launch_id if self.launch else None,
                self.last_good_launch,
                self.last_failed_launch,
            )
            if x
        }
        keep = self.settings.log_retention
        removed = await asyncio.to_thread(
            prune_logs, self.settings.log_dir, keep.launches, keep.max_bytes, protect
        )
        if removed:
            self.post_event("logs_pruned", files=len(removed))

    # -- read-only views -------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        launch = self.launch
        child = launch.child if launch else None
        running = child is not None and launch is not None and not launch.exited
        now = self.clock.monotonic()
        uptime = None
        if running and launch is not None and launch.ready_mono is not None:
            uptime = round(now - launch.ready_mono, 3)
        gpus = []
        ours = self._our_pids()
        for g in self.gpu_snapshot.gpus:
            gpus.append(
                {
                    "index": g.index,
                    "uuid": g.uuid,
                    "used_mib": g.used_mib,
                    "total_mib": g.total_mib,
                    "utilization_pct": g.utilization_pct,
                    "processes": [
                        {
                            "pid": p.pid,
                            "name": p.name,
                            "used_mib": p.used_mib,
                            "ours": p.pid in ours,
                        }
                        for p in g.processes
                    ],
                }
            )
        return {
            "state": str(self.state),
            "config": launch.config.name if launch else self.intent_config,
            "intent": {"config": self.intent_config, "running": self.intent_running},
            "pid": child.pid if running and child else None,
            "launch_id": launch.launch_id or None if launch else None,
            "started_at": utc_iso(launch.started_at) if launch else None,
            "ready_at": utc_iso(launch.ready_at) if launch else None,
            "uptime_s": uptime,
            "restarts": self.restarts,
            "failures": self.failures,
            "crash_loop": self.crash_loop,
            "next_retry_at": utc_iso(self.next_retry_at),
            "last_exit": self.last_exit,
            "log_file": str(launch.log.path) if launch and launch.log else None,
            "last_good_config": self.last_good_config,
            "rolled_back_from": self.rolled_back_from,
            "swap": self.swap.view() if self.swap is not None and self.swap.active else None,
            "sweep": self._sweep_status(),
            "last_sweep_killed": self.last_sweep_killed,
            "gpus": gpus,
            "gpu_backend": self.gpu.name,
            "gpu_error": self.gpu_snapshot.error,
            "gpu_snapshot_age_s": round(max(0.0, time.monotonic() - self.gpu_snapshot.taken_at), 3),
            "gpu_pids_unresolved": self.gpu_pids_unresolved,
            "server_metrics": self.server_metrics or None,
            "write_errors": dict(self.write_errors),
            "internal_errors": self.internal_errors,
            "supervising": self.stuck() is None,
        }

    def _sweep_status(self) -> dict[str, Any] | None:
        if self.active_sweep is None or self.sweep_view is None:
            return None
        v = self.sweep_view()
        return {"id": v["id"], "done": v["done"], "total": v["total"], "current": v["current"]}

    def _our_pids(self) -> set[int]:
        """The running launch's process tree, walked at most once a second (a /proc scan)."""
        launch = self.launch
        if launch is None or launch.child is None or launch.exited:
            return set()
        now = time.monotonic()
        cached = self._tree_cache
        if cached is not None and cached[0] == launch.gen and now - cached[1] < 1.0:
            return cached[2]
        pids = {launch.child.pid}
        with contextlib.suppress(Exception):
            import psutil  # noqa: PLC0415

            pids.update(c.pid for c in psutil.Process(launch.child.pid).children(recursive=True))
        self._tree_cache = (launch.gen, now, pids)
        return pids

    def kill_server_now(self) -> None:
        """The last resort of a shutdown that did not finish: SIGKILL to the server's group."""
        launch = self.launch
        if launch is not None and launch.child is not None and not launch.exited:
            launch.child.kill_group()

    def ring_lines(self, n: int) -> list[str]:
        launch = self.launch
        if launch is None or launch.log is None:
            return []
        return [launch.redactor.text(e.text) for e in launch.log.ring.tail(n)]

    def current_redactor(self) -> Redactor:
        return self.launch.redactor if self.launch is not None else Redactor()

    def redactor_for(self, config: str | None) -> Redactor:
        """A redactor for an earlier launch's log: its config's secrets (if it still resolves)
        and the generic key=value rules."""
        redactor = Redactor()
        if config:
            with contextlib.suppress(ConfigError):
                cfg = self.configs.load(config)
                redactor.add(cfg.secret_values())
        if self.launch is not None:
            redactor.add(self.launch.redactor._secrets)
        return redactor

    @property
    def log_path(self) -> Path | None:
        launch = self.launch
        return launch.log.path if launch and launch.log else None


def _error_name(status: int) -> str:
    return {400: "bad_request", 404: "not_found", 409: "conflict", 422: "invalid_config"}.get(
        status, "error"
    )
