"""A part of the host: a launch's server, from its exec to its end. The exec happens in the
machine's own turn (no task's turn of the loop on the way to it); the log, the pipes and the
first slice of CPU are the spawn task's, which posts `Spawned` (then what the server printed
meanwhile, then its exit) or `SpawnFailed`. Its lines are parsed as they come: findings are
kept on the launch, and what changes state or status is posted. Then the signals, and the
launch let go of.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .clock import Clock
from .launchlog import LaunchLog, LogUnwritable, header_bytes
from .logfiles import read_tail
from .logring import RING_LINES
from .messages import (
    Adopted,
    LineParsed,
    Message,
    ServerExited,
    Spawned,
    SpawnFailed,
    TaskFailed,
    WriteHealthChanged,
)
from .model import utc_iso
from .resolvedconfig import redacted_header_lines
from .server import local, reaper
from .server.shimclient import ShimClient, ShimError, ShimFile, ShimServer
from .sglanglines import Finding, ParsedLine
from .tasks import Tasks

if TYPE_CHECKING:
    from .effects import ServerHandle, ServerLog
    from .model import Launch

# Findings logged this long before SGLang's death line are evidence of that death (its
# scheduler watchdog logs the timeout, then waits 5 s before the SIGQUIT); older ones are not.
DEATH_CONTEXT_S = 60.0
FIRST_SLICE_S = 0.01
SHIM_REFUSALS = ("exec_failed", "log_unwritable")  # the shim's words for a spawn it refused
SHIM_RESTART_WAIT_S = 15.0  # a launch waits this long for a lost shim's successor


class Launching:
    def __init__(
        self,
        *,
        log_dir: Path,
        log_max_bytes: int,
        clock: Clock,
        tasks: Tasks,
        post: Callable[[Message], None],
        after_exec: Callable[[], None],
        shim: Callable[[], ShimClient | asyncio.Future[Any] | None] = lambda: None,
    ) -> None:
        self.log_dir, self.log_max_bytes = log_dir, log_max_bytes
        self.clock, self.tasks, self.post = clock, tasks, post
        self.after_exec = after_exec  # once the server runs: what the relaunch held back
        # The shim that runs the servers (a future: it is being started again; None: none
        # can be had, and the daemon runs them itself, `server/local.py`).
        self.shim = shim
        self.line_listeners: set[Callable[[list[str]], None]] = set()  # raw: redact to serve
        self._early: dict[int, list[Message]] = {}  # lines read before the spawn was posted
        # The servers' base environment: the daemon's, as it started (the daemon never changes
        # its own). Read once: decoding os.environ at each launch cost the restart path ~0.1 ms.
        self.base_env = dict(os.environ)
        # What else a launch's environment gets (the compile caches' folders), given its argv,
        # its environment and its GPUs; nothing where the host sets nothing.
        self.extra_env: Callable[[list[str], dict[str, str], list[str] | None], dict[str, str]]
        self.extra_env = lambda argv, env, gpus: {}

    def spawn(self, launch: Launch, wait: bool = True) -> None:
        shim = self.shim()
        if isinstance(shim, asyncio.Future):  # the shim is being started again: the exec waits
            if wait:  # (once: a shim that does not come back leaves the launch to the daemon)
                self.tasks.task(self._spawn_when(launch, shim), gen=launch.gen, name="spawn")
                return
            shim = None
        self._early[launch.gen] = []
        # The exec in this very turn (posix_spawn returns at it): the server does not wait for
        # a task's turn of the loop. Its log, its pipes and its first slice are the task's.
        cfg = launch.config
        path = self.log_dir / cfg.name / f"{launch.launch_id}.log"
        header = [] if shim is None else self._header(launch)  # the shim writes it first
        try:
            env = cfg.process_env(self.base_env)
            env.update(self.extra_env(cfg.argv, env, cfg.gpus))
            if shim is None:
                child: ServerHandle | Exception = local.start(
                    cfg.argv, env, launch.launch_id, token=launch.token
                )
            else:
                child = shim.spawn(
                    launch_id=launch.launch_id,
                    token=launch.token,
                    path=local.executable(cfg.argv[0], env),
                    argv=cfg.argv,
                    env=env,
                    log=path,
                    head=header_bytes(header, launch.redactor.text).decode(),
                    max_bytes=self.log_max_bytes,
                )
        except Exception as exc:  # OSError from exec; anything else must not strand it
            child = exc
        header = header or self._header(launch)
        task = self.tasks.task(self._spawn(launch, path, header, child), gen=launch.gen)
        task.add_done_callback(lambda t: self._spawn_ended(t, launch.gen, child))

    async def _spawn_when(self, launch: Launch, shim: asyncio.Future[Any]) -> None:
        """The shim was lost and is being started again: the launch is executed once it is up
        (or, if it cannot be had, by the daemon itself, as that was said)."""
        await asyncio.wait([shim], timeout=SHIM_RESTART_WAIT_S)
        if not shim.cancelled():  # (cancelled: the daemon is closing, nothing is to start)
            self.spawn(launch, wait=False)

    def _header(self, launch: Launch) -> list[str]:
        header = [f"gpuwarden launch {launch.launch_id} at {utc_iso(self.clock.time())}"]
        try:
            header += redacted_header_lines(launch.config)
        except Exception as exc:  # the server runs: it must reach the task that watches it
            header.append(f"(the config's lines could not be written: {exc!r})")
        return header

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
        self, launch: Launch, path: Path, header: list[str], child: ServerHandle | Exception
    ) -> None:
        cfg, gen = launch.config, launch.gen

        def open_log() -> LaunchLog:
            return LaunchLog(
                path,
                header,
                on_lines=lambda lines, parsed: self._on_lines(launch, lines, parsed),
                starting=lambda: launch.ready_at is None,
                redact=launch.redactor.text,
                on_write=self._on_write,
                max_bytes=self.log_max_bytes,
                file=ShimFile(child, self._on_write) if isinstance(child, ShimServer) else None,
            )

        posted = False
        try:
            if isinstance(child, ShimServer):  # the shim's answer: its exec and its log
                try:
                    await child.spawned
                except ShimError as refused:
                    why = refused.reason if refused.reason in SHIM_REFUSALS else "internal_error"
                    child = refused  # nothing of it runs, unless the shim went after its exec:
                    if why == "internal_error":  # what carries its token goes
                        found = await asyncio.to_thread(reaper.find_leftovers, launch.token)
                        await reaper.kill_leftovers(found)
                    said = refused.detail or str(refused)
                    detail = {
                        "exec_failed": f"cannot execute {cfg.argv[0]!r}: {said}",
                        "log_unwritable": f"cannot create the log: {said}",
                    }.get(why, f"the shim: {said}")
                    self.post(SpawnFailed(gen, why, detail))
                    return
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
            child.on_exit(lambda returncode: self.post(_exited(gen, child, returncode)))
            self.after_exec()
        finally:
            if not posted and not isinstance(child, Exception):
                child.kill_group()  # no log, or the daemon is going: it must not run on unseen
                child.close()
            for msg in self._early.pop(gen, []):
                self.post(msg)

    def adopt(self, launch: Launch) -> None:
        """A previous life's server, taken over (`boot.py` attached to it): its log's tail in
        the ring, its lines from now on, then its exit (now, if it ended while away)."""
        self._early[launch.gen] = []
        task = self.tasks.task(self._adopt(launch), gen=launch.gen)
        task.add_done_callback(lambda t: self._early.pop(launch.gen, None))

    async def _adopt(self, launch: Launch) -> None:
        child = launch.child
        assert isinstance(child, ShimServer)
        log = LaunchLog(
            child.log_path,
            [],
            on_lines=lambda lines, parsed: self._on_lines(launch, lines, parsed),
            starting=lambda: launch.ready_at is None,
            redact=launch.redactor.text,
            file=ShimFile(child, self._on_write),
        )
        try:
            child.forget_early()  # it is in the file (the shim writes, then sends): in the tail
            tail = await asyncio.to_thread(read_tail, child.log_path, RING_LINES)
            log.ring.extend(tail, self.clock.time())
            await child.read_output(log.feed)
            self.post(Adopted(launch.gen, log))
            for msg in self._early.pop(launch.gen, []):
                self.post(msg)
        finally:  # whatever failed above, its exit reaches the machine
            child.on_exit(lambda returncode: self.post(_exited(launch.gen, child, returncode)))

    def _on_write(self, error: str | None) -> None:
        """The launch log's writes fail (the error) or work again (None), ours or the shim's."""
        self.post(WriteHealthChanged("launch_log", error))

    def _on_lines(
        self, launch: Launch, lines: list[str], parsed: list[tuple[str, ParsedLine]]
    ) -> None:
        """Called by the log pipeline once per chunk. Findings are log data kept on the launch;
        what changes state (the ready line, a death line) or status (decode metrics) is posted."""
        for listener in list(self.line_listeners):
            listener(lines)
        now = self.tasks.real.monotonic()
        early = self._early.get(launch.gen)
        for text, result in parsed:
            if result.phase is not None:
                launch.phases.mark(result.phase, now)
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

    def abandon(self, server: ServerHandle, log: ServerLog) -> None:
        server.kill_group()
        server.close()
        if isinstance(log, LaunchLog):
            log.close("abandoned: no launch attempt wants it")

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


def _exited(gen: int, child: ServerHandle, returncode: int | None) -> ServerExited:
    lost = child.lost_reason if isinstance(child, ShimServer) else None
    return ServerExited(gen, returncode, lost)
