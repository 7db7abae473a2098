"""The host: the one seam every side effect of the machine leaves through.

The machine calls these methods while it decides; each returns at once. What takes time
(executing the server, the GPU wait, probes, the sweep, timers, config reads, the state
file's write) runs in a task of the host, which posts its outcome to the inbox as a message.
An outcome known without waiting (a sweep with nothing to sweep, GPUs free at the first look
of a backend that answers at once, no backoff and an unchanged config) is posted at once, in
the same form: the machine cannot tell the two apart, and a relaunch takes no task's turns of
the loop on its way to the exec. Tasks that belong to one launch live and die with it
(`end_tasks`); every task's failure is posted (`TaskFailed`), never lost; the ones with a
deadline make supervision count as stuck when they overrun it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from gpuwarden.daemon import logsetup

from . import boot, ownership
from .clock import Clock
from .configs import ConfigError, ConfigStore, redacted_header_lines
from .gpu import GpuBackend
from .gpuwatch import GpuWatch
from .health import Prober
from .launchlog import LaunchLog, LogUnwritable
from .listener import check_listener
from .logfiles import prune_logs
from .messages import (
    BackoffElapsed,
    EventNoted,
    LineParsed,
    ListenerChecked,
    Message,
    PreviousServerStopped,
    ProbeFailed,
    ProbeSucceeded,
    SaveDelayElapsed,
    ServerExited,
    Spawned,
    SpawnFailed,
    StateSaved,
    SweepFinished,
    TaskFailed,
    WriteHealthChanged,
)
from .model import utc_iso
from .server import local, reaper
from .settings import Settings
from .sglanglines import Finding, ParsedLine
from .store import EventLog, StateStore
from .tasks import Tasks

if TYPE_CHECKING:
    from .effects import ServerHandle, ServerLog
    from .gpustate import KnownOurs
    from .model import Launch, PreviousServer
    from .preflight import Preflight
    from .views import Snapshot

log = logsetup.get_logger("gpuwarden.supervisor")

# Findings logged this long before SGLang's death line are evidence of that death (its
# scheduler watchdog logs the timeout, then waits 5 s before the SIGQUIT); older ones are not.
DEATH_CONTEXT_S = 60.0
PIPE_DRAIN_S = 0.2  # after an exit, how long to wait for the last output before classifying
# How long the post-exit sweep may take before it counts as overdue (it normally takes well
# under a second: pipes, a /proc walk, a GPU snapshot, the kills' own grace).
SWEEP_DEADLINE_S = 120.0
SAVE_RETRY_S = 2.0
SETTLED_KEPT = 32  # outcomes of settled swaps kept for `restart --wait` callers
# Between a server's end and the next exec, records wait for the exec (they are written right
# after it), but never longer than this.
HOLD_RECORDS_S = 0.25
FIRST_SLICE_S = 0.01


class Host:
    def __init__(
        self,
        settings: Settings,
        *,
        gpu: GpuBackend,
        prober: Prober,
        store: StateStore,
        events: EventLog,
        configs: ConfigStore,
        preflight: Preflight,
        clock: Clock,
        post: Callable[[Message], None],
        view: Callable[[], Snapshot],
    ) -> None:
        self.tasks = Tasks(clock, post)  # every task of the host, scoped and reported
        self.clock, self.post, self.real = clock, post, self.tasks.real
        self.settings, self.gpu, self.prober = settings, gpu, prober
        self.store, self.events, self.configs = store, events, configs
        self.preflight = preflight
        self.view = view
        self.line_listeners: set[Callable[[list[str]], None]] = set()  # raw: redact to serve
        self.event_listeners: list[Callable[[dict[str, Any]], None]] = []
        self.sweep_deadline_s = SWEEP_DEADLINE_S
        self.gpus = GpuWatch(
            settings=settings,
            gpu=gpu,
            tasks=self.tasks,
            post=post,
            view=view,
            sweep_deadline_s=SWEEP_DEADLINE_S,
        )
        self.subreaper = reaper.is_subreaper()
        self._retry_task: asyncio.Task[Any] | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-writer")
        self._events_error: str | None = None
        self._saving = False  # a state.json write is under way on the writer thread
        self._save_next: dict[str, Any] | None = None  # the newest record, behind it
        self._closing = False
        self._records: list[dict[str, Any]] = []  # the owner's turn's records, not yet written
        self._flush_timer: asyncio.TimerHandle | None = None
        self._settled: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._early: dict[int, list[Message]] = {}  # lines read before the spawn was posted
        # The servers' base environment: the daemon's, as it started (the daemon never changes
        # its own). Read once: decoding os.environ at each launch cost the restart path ~0.1 ms.
        self.base_env = dict(os.environ)

    # -- the parts, as the machine and the supervisor ask for them ------------------------------

    def timer(self, seconds: float, msg: Message, launch: Launch | None = None) -> None:
        self.tasks.timer(seconds, msg, launch)

    def end_tasks(self, launch: Launch) -> None:
        self.tasks.end_tasks(launch)

    def overdue(self) -> str | None:
        return self.tasks.overdue()

    def wait_for_gpus(self, launch: Launch, known_ours: KnownOurs, unresolved: bool) -> None:
        self.gpus.wait_for_gpus(launch)

    def cancel_gpu_wait(self) -> None:
        self.gpus.cancel_gpu_wait()

    def refresh_gpus(self) -> None:
        self.gpus.refresh_gpus()

    def poll_gpus(self) -> None:
        self.gpus.poll_gpus()

    async def close(self) -> None:
        self.flush_records()
        self._closing = True
        await asyncio.to_thread(self._writer.shutdown, wait=True)
        if self._save_next is not None:  # the last change, behind the write then under way
            await asyncio.to_thread(self.store.save, self._save_next)
            self._save_next = None
        self.tasks.cancel_all()
        await self.prober.close()

    # -- records -------------------------------------------------------------------------------

    def record(self, record: dict[str, Any]) -> None:
        """A record of the machine's: kept in order and written (events.jsonl, listeners, the
        daemon's log) when the owner's turn ends (`flush_records`), or, between a server's end
        and the next exec, right after that exec (`hold_records`)."""
        self._records.append(record)

    def hold_records(self) -> None:
        """A relaunch is under way: its records wait for the exec, at most `HOLD_RECORDS_S`."""
        if self._records and self._flush_timer is None:
            self._flush_timer = asyncio.get_running_loop().call_later(
                HOLD_RECORDS_S, self.flush_records
            )

    def flush_records(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        records, self._records = self._records, []
        for record in records:
            try:
                self._write_record(record)
            except Exception:  # a record that cannot be written must not cost the others
                log.exception("daemon.record_failed", record_event=str(record.get("event")))

    def _write_record(self, record: dict[str, Any]) -> None:
        self.events.append(record)
        if self.events.needs_prune():
            self.tasks.task(self._prune_events())
        if self.events.write_error != self._events_error:
            self._events_error = self.events.write_error
            self.post(WriteHealthChanged("events", self._events_error))
        for listener in self.event_listeners:
            try:
                listener(record)
            except Exception:
                log.exception("supervisor.event_listener_failed")
        fields = {k: v for k, v in record.items() if k not in ("event", "ts")}
        log.log(logsetup.record_level(record), f"server.{record['event']}", **fields)

    def save(self, record: dict[str, Any]) -> None:
        """Write state.json (fsync and all) on the writer thread, so a relaunch never waits
        for the disk. One write at a time: a record that comes while one is being written waits
        for it, and a newer one replaces it there (the file only ever needs the newest)."""
        if self._saving:
            self._save_next = record
            return
        self._saving = True
        done = self._writer.submit(self.store.save, record)
        loop = asyncio.get_running_loop()

        def report(fut: Any) -> None:
            error = fut.result() if fut.exception() is None else repr(fut.exception())
            with contextlib.suppress(RuntimeError):  # the loop is gone: the daemon is exiting
                loop.call_soon_threadsafe(self._saved, error)

        done.add_done_callback(report)

    def _saved(self, error: str | None) -> None:
        self._saving = False
        self.post(StateSaved(error))
        if self._closing:
            return  # `close` writes the newest, once the writer has stopped
        record, self._save_next = self._save_next, None
        if record is not None:
            self.save(record)

    def save_again(self) -> None:
        self.tasks.timer(SAVE_RETRY_S, SaveDelayElapsed())

    def swap_settled(self, swap_id: str, outcome: dict[str, Any]) -> None:
        fut = self.settled(swap_id)
        if not fut.done():
            fut.set_result(outcome)
        while len(self._settled) > SETTLED_KEPT:
            del self._settled[next(iter(self._settled))]

    def settled(self, swap_id: str) -> asyncio.Future[dict[str, Any]]:
        """A swap's outcome, once it has one."""
        fut = self._settled.get(swap_id)
        if fut is None:
            fut = self._settled[swap_id] = asyncio.get_running_loop().create_future()
        return fut

    # -- the GPU wait and the launch -------------------------------------------------------------

    def spawn(self, launch: Launch) -> None:
        self._early[launch.gen] = []
        # The exec in this very turn (posix_spawn returns at it): the server does not wait for
        # a task's turn of the loop. Its log, its pipes and its first slice are the task's.
        cfg = launch.config
        try:
            env = cfg.process_env(self.base_env)
            child: ServerHandle | Exception = local.start(
                cfg.argv, env, launch.launch_id, token=launch.token
            )
        except Exception as exc:  # OSError from exec; anything else must not strand it
            child = exc
        header = [
            f"gpuwarden launch {launch.launch_id} at {utc_iso(self.clock.time())}",
            *redacted_header_lines(cfg),
        ]
        task = self.tasks.task(self._spawn(launch, header, child), gen=launch.gen)
        task.add_done_callback(lambda t: self._spawn_ended(t, launch.gen, child))

    def _spawn_ended(
        self, task: asyncio.Task[Any], gen: int, child: ServerHandle | Exception
    ) -> None:
        """The machine waits for the spawn's outcome. A spawn task cancelled gave none (it is
        cancelled before it posts or not at all), and one cancelled before its first step never
        ran its `finally` either: its server is ended here, and the machine is told."""
        if not task.cancelled():
            return
        # Its `_early` entry is still there only if the body's `finally` (which ends the
        # server it had not handed on) never ran.
        if self._early.pop(gen, None) is not None and not isinstance(child, Exception):
            child.kill_group()
            child.close()
        self.post(TaskFailed("spawn", gen, "cancelled before the server was watched"))

    async def _spawn(
        self, launch: Launch, header: list[str], child: ServerHandle | Exception
    ) -> None:
        cfg, gen = launch.config, launch.gen
        path = self.settings.log_dir / cfg.name / f"{launch.launch_id}.log"

        def open_log() -> LaunchLog:
            return LaunchLog(
                path,
                header,
                on_lines=lambda lines, parsed: self._on_lines(launch, lines, parsed),
                redact=launch.redactor.text,
                on_write=lambda error: self.post(WriteHealthChanged("launch_log", error)),
                max_bytes=self.settings.log_retention.max_bytes,
            )

        posted = False
        try:
            if isinstance(child, Exception):
                exc = child
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else repr(exc)
                detail = f"cannot execute {cfg.argv[0]!r}: {why}"
                with contextlib.suppress(LogUnwritable):
                    open_log().close(f"exec failed: {detail}")
                self.post(SpawnFailed(gen, "exec_failed", detail))
                return
            # The log is created right after the exec: a filesystem can take a few hundred
            # microseconds to create a file, and the server need not wait for them. Nothing of
            # its output is read before the file exists; one that cannot be created ends the
            # server at once (its group, SIGKILL), before it has done anything.
            try:
                launch_log = open_log()
            except LogUnwritable as exc:
                self.post(SpawnFailed(gen, "log_unwritable", f"cannot create the log: {exc}"))
                return
            await child.read_output(launch_log.feed)
            # The new server's first slice of CPU before the launch's bookkeeping (records, the
            # state save, probes): on a host with few cores that work otherwise keeps the
            # server waiting for a CPU as it starts. It ends early at the server's first output
            # or its exit (which then waits in `_early` no longer than that).
            await child.wait_started(FIRST_SLICE_S)
            # The machine hears of the process, then of what it printed, then of its exit.
            self.post(Spawned(gen, child, launch_log))
            posted = True
            for msg in self._early.pop(gen, []):
                self.post(msg)
            child.on_exit(lambda returncode: self.post(ServerExited(gen, returncode)))
            self.flush_records()  # what the relaunch held back, now that the server runs
        finally:
            if not posted and not isinstance(child, Exception):
                child.kill_group()  # no log, or the daemon is going: it must not run on unseen
                child.close()
            for msg in self._early.pop(gen, []):
                self.post(msg)

    def abandon(self, server: ServerHandle, log: ServerLog) -> None:
        server.kill_group()
        server.close()
        if isinstance(log, LaunchLog):
            log.close("abandoned: no launch attempt wants it")

    def _on_lines(
        self, launch: Launch, lines: list[str], parsed: list[tuple[str, ParsedLine]]
    ) -> None:
        """Called by the log pipeline once per chunk. Findings are log data kept on the launch;
        what changes state (the ready line, a death line) or status (decode metrics) is posted."""
        for listener in list(self.line_listeners):
            listener(lines)
        now = self.real.monotonic()
        early = self._early.get(launch.gen)
        for text, result in parsed:
            if result.death and launch.death_at is None:
                since = now - DEATH_CONTEXT_S
                launch.death_at = next(
                    (i for i, t in enumerate(launch.finding_times) if t >= since),
                    len(launch.findings),
                )
            if result.findings:
                found = [Finding(f.kind, launch.redactor.text(f.line)) for f in result.findings]
                launch.add_findings(found, now)
            if result.ready or result.decode is not None or result.death:
                msg = LineParsed(launch.gen, result, text)
                if early is not None:  # the machine has not heard of the process yet
                    early.append(msg)
                else:
                    self.post(msg)

    def terminate(self, launch: Launch) -> None:
        if launch.child is not None:
            launch.child.signal(signal.SIGTERM)

    def kill_group(self, launch: Launch) -> None:
        if launch.child is not None:
            launch.child.kill_group()

    def close_launch(self, launch: Launch, note: str) -> None:
        if launch.log is not None:
            launch.log.close(note)
        if launch.child is not None:
            launch.child.close()

    # -- probes ----------------------------------------------------------------------------------

    def probe(self, launch: Launch, readiness: bool) -> None:
        self.tasks.task(self._probe_loop(launch, readiness), launch=launch)

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

    def check_listener(self, launch: Launch, how: str) -> None:
        self.tasks.task(self._check_listener(launch, how), launch=launch)

    async def _check_listener(self, launch: Launch, how: str) -> None:
        assert launch.child is not None
        main = launch.child.pid

        def tree() -> list[int]:
            return [pid for pid, _ in ownership.launch_tree(main)]

        check = await asyncio.to_thread(check_listener, launch.config.health_url, tree)
        self.post(ListenerChecked(launch.gen, how, check))

    # -- after an exit ---------------------------------------------------------------------------

    def sweep(self, launch: Launch, known_ours: KnownOurs, unresolved: bool) -> None:
        # Right after this turn, whose records (the exit's notice) go out first.
        asyncio.get_running_loop().call_soon(self._sweep, launch)

    def _sweep(self, launch: Launch) -> None:
        # A callback's failure would reach only the loop's exception handler, while the machine
        # waits in stopping for the sweep: it hears of it as of the task's own failure.
        coro = None
        try:
            if not self._swept_at_once(launch):
                coro = self._after_exit(launch)
                self.tasks.task(coro, gen=launch.gen, deadline_s=self.sweep_deadline_s)
        except Exception as exc:
            if coro is not None:
                coro.close()
            self.tasks.report_failure("after_exit", launch.gen, exc)

    def _swept_at_once(self, launch: Launch) -> bool:
        """The usual end of a server, known without a wait: its output is all in and nothing of
        it is left (we are the subreaper, so every process of ours is our child). Posted at
        once, with no task's turns of the loop on the way to the relaunch; the rest is
        `_after_exit`'s.

        The GPUs: a backend that answers at once is asked whether any GPU lists a process (a
        holder of ours from an earlier life of the daemon is the task's to kill). NVML is not
        asked here: no process of ours is alive (the previous life's were swept at boot), and
        the GPU wait that comes before any launch samples NVML anyway, killing holders of ours
        on the GPUs it waits for."""
        child = launch.child
        if child is None or not self.subreaper or not child.output_closed:
            return False
        try:
            if not reaper.nothing_left(child.pgid):
                return False
            if self.gpus.gpus_answer_at_once and any(g.processes for g in self.gpu.snapshot().gpus):
                return False
        except Exception:  # the task's path tries again, and reports what fails
            return False
        self.post(SweepFinished(launch.gen, []))
        return True

    async def _after_exit(self, launch: Launch) -> None:
        """Let the last output in (bounded: a grandchild may hold the pipes), then sweep."""
        child = launch.child
        assert child is not None
        await child.wait_output_closed(PIPE_DRAIN_S)
        killed: list[reaper.Leftover] = []
        if not (self.subreaper and reaper.nothing_left(child.pgid)):
            leftovers = await asyncio.to_thread(reaper.find_leftovers, launch.token, child.pgid)
            killed = await reaper.kill_leftovers(leftovers)
        report = [{"pid": k.pid, "name": k.name, "cmdline": k.cmdline} for k in killed]
        # Holders of ours the tree walk could not reach (an earlier launch's orphans).
        snap = await self.gpus.gpu_snapshot()
        report += await self.gpus.kill_gpu_orphans(list(snap.gpus))
        self.post(SweepFinished(launch.gen, report))

    # -- the boot -----------------------------------------------------------------------------

    def stop_previous(self, previous: PreviousServer) -> None:
        self.tasks.task(self._stop_previous(previous))

    async def _stop_previous(self, previous: PreviousServer) -> None:
        killed = await boot.stop_previous(previous, self.settings.stop.grace_s)
        self.post(PreviousServerStopped(previous, killed))

    def boot_start(self, config: str, rollback: str | None) -> None:
        self.tasks.task(self._boot_start(config, rollback), deadline_s=boot.BOOT_DEADLINE_S)

    async def _boot_start(self, config: str, rollback: str | None) -> None:
        self.post(await boot.boot_start(self.configs, self.preflight, config, rollback))

    def retry_after(self, delay_s: float, gen: int, config: str | None) -> None:
        if delay_s <= 0 and config and self._retry_unchanged(gen, config):
            self._retry_task = None  # no delay and nothing to read: posted now
            return
        self._retry_task = self.tasks.task(self._retry(delay_s, gen, config), gen=gen)

    def _retry_unchanged(self, gen: int, config: str) -> bool:
        """A config whose files did not change is known by a stat of each: no thread hop on
        the restart path. Posts the retry and says True; False when it must be read."""
        resolved = self.configs.unchanged(config)
        if resolved is None:
            return False
        self.post(BackoffElapsed(gen, resolved))
        return True

    def cancel_retry(self) -> None:
        if self._retry_task is not None:
            self._retry_task.cancel()
            self._retry_task = None

    async def _retry(self, delay_s: float, gen: int, config: str | None) -> None:
        if delay_s > 0:
            await self.clock.sleep(delay_s)
        if not config:
            error = "no config given, none running and no default_config set"
            self.post(BackoffElapsed(gen, None, error))
            return
        if self._retry_unchanged(gen, config):
            return
        # Reading one is off the loop: a large or hostile file must not stall it.
        try:
            resolved = await asyncio.to_thread(self.configs.load, config)
        except ConfigError as exc:
            self.post(BackoffElapsed(gen, None, str(exc), unreadable=True))
            return
        self.post(BackoffElapsed(gen, resolved))

    async def _prune_events(self) -> None:
        """events.jsonl back to its newest `retention.events` lines, on a thread."""
        try:
            dropped = await asyncio.to_thread(self.events.prune)
        except OSError as exc:
            self.post(EventNoted("events_prune_failed", {"error": f"{exc.strerror or exc}"}))
            return
        self.post(EventNoted("events_pruned", {"lines": dropped, "kept": self.events.lines}))

    def prune_logs(self, protect: set[str], order: list[str]) -> None:
        self.tasks.task(self._prune_logs(protect, order))

    async def _prune_logs(self, protect: set[str], order: list[str]) -> None:
        keep = self.settings.log_retention
        removed = await asyncio.to_thread(
            prune_logs, self.settings.log_dir, keep.launches, keep.max_bytes, protect, order
        )
        if removed:
            self.post(EventNoted("logs_pruned", {"files": len(removed)}))
