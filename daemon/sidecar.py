"""The host's part that runs SGLang's weight cache daemon beside a config that asks for it
(`weight_cache: true`; what runs and its fingerprint: `weightcache.py`).

Before a launch's GPU wait (`prepare`): a sidecar of another fingerprint, or one the config does
not ask for, is stopped (its GPU memory is the next weights'); one the config asks for is
started once the GPUs are free, and awaited until it serves (its launcher's "weight cache
daemons ... are ready" line), then the GPU wait goes on with its memory discounted, and its
processes are never killed as orphans (`kept`). An engine's crash or a swap to a config of the
same fingerprint keeps it; `stop` (the machine's, on a stop or the daemon's shutdown) ends it
with SIGINT, as its launcher expects, then SIGKILL to its group. A sidecar that fails to start
is an event: the engine then loads from disk (SGLang's client falls back where no socket is).
Leftover socket and ready files of a dead daemon are removed first, since SGLang's client
refuses a socket nobody answers. Its pid is kept in `state_dir/weight-cache.json`, so the
daemon's next life finds it running and keeps it (live restore), or stops it (without).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from . import weightcache
from .gpustate import select_gpus
from .messages import EventNoted, GpuWaitEnded
from .model import utc_iso, utc_stamp
from .server import reaper

if TYPE_CHECKING:
    from .gpustate import KnownOurs
    from .gpuwatch import GpuWatch
    from .messages import Message
    from .model import Launch
    from .tasks import Tasks
    from .weightcache import SidecarSpec

READY = re.compile(r"weight cache daemons? .*\b(?:is|are) ready")
STOP_GRACE_S = 15.0  # its launcher gives each daemon 5 s after SIGTERM
READY_TIMEOUT_S = 1800.0  # SGLang's --weight-cache-timeout default
POLL_S = 0.1
RECORD = "weight-cache.json"
NO_PYTHON = "the Python its server runs under is not known, so its weight cache daemon cannot run"


@dataclass
class Running:
    """A sidecar: started here, or found running from a previous life."""

    spec: SidecarSpec
    pid: int
    create_time: float
    log_path: Path
    started_at: float
    state: str = "starting"  # starting | ready | stopping
    ready_s: float | None = None
    env: dict[str, str] = field(default_factory=dict)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    became_ready: asyncio.Event = field(default_factory=asyncio.Event)

    def alive(self) -> bool:
        try:
            return abs(psutil.Process(self.pid).create_time() - self.create_time) < 0.05
        except psutil.Error:
            return False

    def view(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "fingerprint": self.spec.fingerprint,
            "state": self.state,
            "config": self.spec.config,
            "log_file": str(self.log_path),
            "started_at": utc_iso(self.started_at),
            "ready_s": self.ready_s,
        }


class Sidecar:
    def __init__(
        self,
        *,
        log_dir: Path,
        state_dir: Path,
        tasks: Tasks,
        post: Callable[[Message], None],
        gpus: GpuWatch,
        interpreter: Callable[[list[str], Mapping[str, str]], str | None],
    ) -> None:
        self.log_dir, self.record = log_dir / "weight-cache", state_dir / RECORD
        self.tasks, self.post, self.gpus, self.interpreter = tasks, post, gpus, interpreter
        self.current: Running | None = None
        self._stopping: asyncio.Task[None] | None = None
        gpus.kept = self.kept

    def _event(self, kind: str, **fields: Any) -> None:
        self.post(EventNoted(kind, fields))

    def view(self) -> dict[str, Any] | None:
        return self.current.view() if self.current is not None else None

    def kept(self) -> frozenset[int]:
        """The sidecar's processes (its launcher and its daemons): never waited for, never
        killed as orphans."""
        cur = self.current
        if cur is None:
            return frozenset()
        try:
            proc = psutil.Process(cur.pid)
            return frozenset({cur.pid, *(c.pid for c in proc.children(recursive=True))})
        except psutil.Error:
            return frozenset()

    def involved(self, launch: Launch) -> bool:
        return launch.config.config.weight_cache or self.current is not None

    # -- before a launch's GPU wait ----------------------------------------------------------

    async def prepare(
        self, launch: Launch, env: dict[str, str], known_ours: KnownOurs, unresolved: bool
    ) -> bool:
        """The sidecar `launch` wants runs and serves (False: its GPU wait failed, posted)."""
        cfg = launch.config
        spec = weightcache.spec_of(cfg, self.interpreter(cfg.argv, env), env)
        cur = self.current
        if cur is not None and cur.state == "stopping":  # (its stop under way ends first)
            await cur.ended.wait()
            cur = self.current
        if cur is not None and not cur.alive():
            self._gone(cur, None)
            cur = None
        if cur is not None and (spec is None or spec.fingerprint != cur.spec.fingerprint):
            why = "does not use it" if spec is None else "needs its GPU memory for other weights"
            await self.stop(f"{cfg.name} {why}")
            cur = None
        if spec is None:
            if cfg.config.weight_cache:  # its server's Python is not known: it loads from disk
                self._event("weight_cache_failed", detail=f"{cfg.name}: {NO_PYTHON}")
            return True
        if cur is None:
            busy = await self.gpus.gpus_free(launch, known_ours, unresolved)
            if busy is not None:
                self.post(GpuWaitEnded(launch.gen, False, busy))
                return False
            self._clean_stale(cfg.config.gpus, env)
            try:
                cur = await self._start(spec, env)
            except OSError as exc:  # (the engine then loads from disk)
                self._event("weight_cache_failed", detail=f"{spec.argv[0]}: {exc}")
                return True
        if cur.state == "starting":
            await self._until_ready(cur)
        if not cur.alive():
            self._clean_stale(cfg.config.gpus, env)  # the engine then loads from disk
        return True

    async def _start(self, spec: SidecarSpec, env: dict[str, str]) -> Running:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{spec.fingerprint}-{utc_stamp(time.time())}.log"
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            proc = await asyncio.create_subprocess_exec(
                *spec.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        finally:
            os.close(log)
        reaper.own(proc.pid)  # ours: no launch's sweep takes it, the orphan reaper leaves it
        try:
            create_time = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            create_time = 0.0
        cur = Running(spec, proc.pid, create_time, log_path, time.time(), env=dict(env))
        self.current = cur
        self._save(cur)
        self._event(
            "weight_cache_started",
            pid=proc.pid,
            fingerprint=spec.fingerprint,
            config=spec.config,
            log_file=str(log_path),
        )
        self.tasks.task(self._watch(cur, proc), name="weight_cache")
        return cur

    async def _watch(self, cur: Running, proc: asyncio.subprocess.Process | None) -> None:
        """Its log until it says it serves; its exit."""
        began = time.monotonic()
        offset = 0
        while not cur.ended.is_set():
            if cur.state == "starting":
                text = _read_from(cur.log_path, offset)
                offset += len(text)
                if READY.search(text.decode(errors="replace")):
                    cur.state, cur.ready_s = "ready", round(time.monotonic() - began, 3)
                    cur.became_ready.set()
                    self._event(
                        "weight_cache_ready",
                        pid=cur.pid,
                        fingerprint=cur.spec.fingerprint,
                        load_s=cur.ready_s,
                    )
            if proc is not None and proc.returncode is not None:
                break
            if proc is None and not cur.alive():
                break
            with contextlib.suppress(TimeoutError):
                wait = proc.wait() if proc is not None else asyncio.sleep(1.0)
                await asyncio.wait_for(wait, POLL_S if cur.state == "starting" else 1.0)
        self._gone(cur, proc.returncode if proc is not None else None)

    async def _until_ready(self, cur: Running) -> None:
        ended = asyncio.ensure_future(cur.ended.wait())
        ready = asyncio.ensure_future(cur.became_ready.wait())
        try:
            await asyncio.wait(
                {ended, ready}, timeout=READY_TIMEOUT_S, return_when="FIRST_COMPLETED"
            )
        finally:
            ended.cancel()
            ready.cancel()

    def _gone(self, cur: Running, returncode: int | None) -> None:
        """It ended (asked to, or on its own)."""
        if cur.ended.is_set():
            return
        cur.ended.set()
        reaper.disown(cur.pid)
        if self.current is cur:
            self.current = None
            with contextlib.suppress(OSError):
                self.record.unlink()
        if cur.state != "stopping":
            self._event(
                "weight_cache_exited",
                pid=cur.pid,
                fingerprint=cur.spec.fingerprint,
                returncode=returncode,
                detail=_last_line(cur.log_path),
            )

    # -- its end -------------------------------------------------------------------------------

    def stop_soon(self, reason: str) -> None:
        """The machine's: stop it (a stop, the daemon's shutdown), in a task of its own."""
        if self.current is not None and (self._stopping is None or self._stopping.done()):
            self._stopping = self.tasks.task(self.stop(reason), name="stop_weight_cache")

    async def stop(self, reason: str) -> None:
        cur = self.current
        if cur is None:
            return
        cur.state = "stopping"
        with contextlib.suppress(ProcessLookupError):
            os.kill(cur.pid, signal.SIGINT)  # its launcher stops its daemons on SIGINT
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(cur.ended.wait(), STOP_GRACE_S)  # (its watcher sees it)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(cur.pid, signal.SIGKILL)  # what is left of its group
        self._gone(cur, None)
        self._clean_stale(None, cur.env)
        self._event(
            "weight_cache_stopped", pid=cur.pid, fingerprint=cur.spec.fingerprint, reason=reason
        )

    async def close(self) -> None:
        """The daemon ends: a stop under way finishes (a kept sidecar runs on)."""
        if self._stopping is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._stopping

    # -- records -------------------------------------------------------------------------------

    def _save(self, cur: Running) -> None:
        data = {
            "pid": cur.pid,
            "create_time": cur.create_time,
            "spec": cur.spec.view(),
            "log_file": str(cur.log_path),
            "started_at": cur.started_at,
            "env": {k: cur.env[k] for k in weightcache.ENV if k in cur.env},
        }
        with contextlib.suppress(OSError):
            self.record.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.record.with_suffix(".tmp")
            tmp.write_text(json.dumps(data))
            tmp.replace(self.record)

    def restore(self, live_restore: bool) -> None:
        """A sidecar the previous life left running is this life's (else its record goes);
        without `live_restore` it is stopped, as that life's server is."""
        try:
            data = json.loads(self.record.read_text())
            spec = weightcache.SidecarSpec(
                str(data["spec"]["fingerprint"]),
                tuple(str(a) for a in data["spec"]["argv"]),
                str(data["spec"]["config"]),
            )
            cur = Running(
                spec,
                int(data["pid"]),
                float(data["create_time"]),
                Path(str(data["log_file"])),
                float(data["started_at"]),
                state="ready",
                env={str(k): str(v) for k, v in dict(data.get("env") or {}).items()},
            )
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            self._event("weight_cache_record_unreadable", detail=f"{self.record}: {exc}")
            with contextlib.suppress(OSError):
                self.record.unlink()
            return
        if not cur.alive():
            with contextlib.suppress(OSError):
                self.record.unlink()
            return
        cur.became_ready.set()
        self.current = cur
        reaper.own(cur.pid)
        self._event("weight_cache_adopted", pid=cur.pid, fingerprint=spec.fingerprint)
        self.tasks.task(self._watch(cur, None), name="weight_cache")
        if not live_restore:  # nothing of the previous life runs on: as its server, stopped
            self.stop_soon("the previous life's, and live_restore is off")

    def _clean_stale(self, wanted: list[int | str] | None, env: Mapping[str, str]) -> None:
        """Remove the socket and ready files of weight cache daemons that are gone."""
        snap = self.gpus.latest
        if snap is None:
            return
        for gpu in select_gpus(snap, [str(w) for w in wanted] if wanted else None):
            sock, ready = (Path(p) for p in weightcache.socket_paths(gpu.uuid, env))
            try:
                text = ready.read_text()
            except OSError:
                continue
            found = re.search(r"^pid=(\d+)", text, re.M)
            if found and psutil.pid_exists(int(found.group(1))):
                continue
            for path in (sock, ready):
                with contextlib.suppress(OSError):
                    path.unlink()
            self._event("weight_cache_stale_files", socket=str(sock), ready=str(ready))


def _read_from(path: Path, offset: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return b""


def _last_line(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    return lines[-1][-500:] if lines else None
