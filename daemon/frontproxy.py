"""The host's part that runs the front proxy (`proxy:` in the settings; the proxy itself is
`proxy/`) and tells it, on every change, what the server is doing: `open` while it is ready,
`hold` while it is on its way back, `reject` while it is failed or stopped.

The proxy is a process of its own, in a session of its own, so it outlives the daemon: the
daemon's next life connects to its control socket (`<state_dir>/proxy/proxy.sock`) and adopts
it, and clients held meanwhile stay held. Under systemd it runs in a unit of its own
(`gpuwarden-proxy.service`, named by `GPUWARDEN_PROXY_UNIT`): the daemon then only connects.
A proxy that ends is said and started again. At the daemon's stop without `live_restore` it
is told to exit (held clients get 503: no server will come back for them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import views
from .messages import EventNoted
from .server import reaper
from .states import ServerState

if TYPE_CHECKING:
    from .messages import Message
    from .settings import ProxySettings
    from .tasks import Tasks
    from .views import Snapshot

EXTERNAL_ENV = "GPUWARDEN_PROXY_UNIT"
START_TIMEOUT_S = 10.0
EXTERNAL_WAIT_S = 30.0
EXIT_WAIT_S = 12.0  # the proxy's own drain (10 s) and a little
RETRY_MAX_S = 30.0
HOLD = frozenset(
    {ServerState.WAITING_GPU, ServerState.STARTING, ServerState.BACKOFF, ServerState.UNHEALTHY}
)


def gate_word(snap: Snapshot, now_mono: float) -> dict[str, Any]:
    """What the proxy does with a request now, from the machine's snapshot."""
    state = snap.state
    word: dict[str, Any] = {"state": str(state), "config": snap.current_config, "model": snap.model}
    if state == ServerState.READY and snap.upstream is not None:
        return {**word, "mode": "open", "upstream": list(snap.upstream)}
    if state in HOLD or (state == ServerState.STOPPING and snap.intent_running):
        eta = None
        if state == ServerState.BACKOFF and snap.next_retry_at is not None:
            eta = snap.next_retry_at - time.time()
        elif state == ServerState.STARTING:
            eta = (views.phase(snap, now_mono) or {}).get("eta_s")
        reason = "a swap" if snap.swap else None
        retry = round(eta) if isinstance(eta, (int, float)) and eta > 0 else None
        return {**word, "mode": "hold", "reason": reason, "retry_after_s": retry}
    reason = "stopping" if state == ServerState.STOPPING else None
    if state == ServerState.FAILED and snap.last_exit:
        reason = str(snap.last_exit.get("reason") or "") or None
    return {**word, "mode": "reject", "reason": reason}


def socket_path(state_dir: Path) -> Path:
    return state_dir / "proxy" / "proxy.sock"


def command(settings: ProxySettings, socket: Path) -> list[str]:
    """The proxy's command line (the daemon's child, or `gpuwarden proxy` in its own unit)."""
    argv = [sys.executable, "-m", "gpuwarden.daemon.proxy", "--listen", settings.listen]
    argv += ["--control", str(socket), "--hold-timeout-s", str(settings.hold_timeout_s)]
    argv += ["--max-held", str(settings.max_held), "--max-held-bytes", str(settings.max_held_bytes)]
    return argv + (["--continue-streams"] if settings.continue_streams else [])


class FrontProxy:
    def __init__(
        self,
        settings: ProxySettings,
        *,
        state_dir: Path,
        log_dir: Path,
        tasks: Tasks,
        post: Callable[[Message], None],
    ) -> None:
        self.settings = settings
        self.socket = socket_path(state_dir)
        self.log_path = log_dir / "proxy.log"
        self.tasks, self.post = tasks, post
        self.external = os.environ.get(EXTERNAL_ENV)
        self.writer: asyncio.StreamWriter | None = None
        self.figures: dict[str, Any] | None = None  # its last stats
        self.pid: int | None = None
        self.word: dict[str, Any] | None = None  # the last word, sent again on a reconnection
        self._key: tuple[Any, ...] | None = None
        self._closing = False
        self._proc: asyncio.subprocess.Process | None = None
        self._ended = asyncio.Event()  # its connection ended

    def _event(self, kind: str, **fields: Any) -> None:
        self.post(EventNoted(kind, fields))

    # -- its process -----------------------------------------------------------------------

    async def start(self) -> None:
        """The proxy found (a previous life's) or started; one that cannot be had is said, and
        sought again in the background."""
        if not await self._connect_or_start():
            self.tasks.task(self._again(1.0), name="proxy")

    async def _connect_or_start(self) -> bool:
        try:
            reader, writer = await self._connect(EXTERNAL_WAIT_S if self.external else 0.0)
            adopted = True
        except OSError:
            adopted = False
            try:
                reader, writer = await self._spawn()
            except OSError as exc:
                self._event("proxy_failed", listen=self.settings.listen, error=str(exc))
                return False
        try:
            hello = json.loads(await asyncio.wait_for(reader.readline(), START_TIMEOUT_S))["hello"]
            int(hello["pid"])
        except (OSError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            writer.close()  # (what answers at its socket is no proxy of this version)
            error = f"{self.socket} did not answer as a proxy: {type(exc).__name__}: {exc}"
            self._event("proxy_failed", listen=self.settings.listen, error=error)
            return False
        if adopted and hello.get("listen") != self.settings.listen:  # the setting changed
            writer.write(b'{"exit": true}\n')
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(reader.read(), EXIT_WAIT_S)
            writer.close()
            return await self._connect_or_start()
        self.writer, self.figures, self.pid = writer, hello, int(hello["pid"])
        self._ended = asyncio.Event()
        limits = {
            k: getattr(self.settings, k) for k in ("hold_timeout_s", "max_held", "max_held_bytes")
        }
        self._send({"settings": {**limits, "continue_streams": self.settings.continue_streams}})
        if self.word is not None:
            self._send({"gate": self.word})
        kind = "proxy_adopted" if adopted else "proxy_started"
        self._event(kind, pid=self.pid, listen=self.settings.listen, held=hello.get("held"))
        self.tasks.task(self._read(reader, writer), name="proxy")
        return True

    async def _connect(self, wait_s: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return await asyncio.open_unix_connection(str(self.socket), limit=1 << 20)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.1)

    async def _spawn(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.external:
            raise OSError(
                f"{self.external} runs the proxy, and its socket {self.socket} is not there"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            proc = await asyncio.create_subprocess_exec(
                *command(self.settings, self.socket),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # it outlives the daemon
            )
        finally:
            os.close(log)
        reaper.own(proc.pid)  # no sweep takes it for a leftover
        self._proc = proc
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
                return await asyncio.open_unix_connection(str(self.socket), limit=1 << 20)
            if proc.returncode is not None or time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
                reaper.disown(proc.pid)
                raise OSError(f"it exited ({proc.returncode}): {_last_line(self.log_path)}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 0.05)

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Its figures, until the connection ends; a proxy lost is started again."""
        try:
            while line := await reader.readline():
                message = json.loads(line)
                if not isinstance(message, dict):
                    raise ValueError(f"a line that is not an object: {line[:80]!r}")
                if isinstance(message.get("stats"), dict):
                    self.figures = message["stats"]
                elif "error" in message:
                    self._event("proxy_error", error=str(message["error"])[:500])
        except (OSError, ValueError) as exc:
            if not isinstance(exc, OSError):  # (its socket closing is said below)
                self._event("proxy_error", error=f"its control line: {exc}"[:500])
            writer.close()
        if self.writer is writer:
            self.writer = None
            self._ended.set()
        if not self._closing:
            self._event("proxy_lost", pid=self.pid, detail=_last_line(self.log_path))
            await self._again(0.0)

    async def _again(self, delay_s: float) -> None:
        while not self._closing:
            await asyncio.sleep(delay_s)
            if await self._connect_or_start():
                return
            delay_s = min(max(2 * delay_s, 1.0), RETRY_MAX_S)

    # -- the server's state, told --------------------------------------------------------------

    def publish(self, machine: Any, snapshot: Callable[[], Snapshot], now_mono: float) -> None:
        """After a handled message: the gate's word, sent when the machine's state, launch or
        intent moved. While the boot restores the previous life, the proxy keeps its last
        word (a server adopted as ready goes on serving through it)."""
        key = (machine.state, machine.gen, machine.intent.running, machine.booting.active)
        if key == self._key:
            return
        self._key = key
        try:  # (on the owner's path: a fault here is said, never raised)
            snap = snapshot()
            if snap.booting:
                return
            word = gate_word(snap, now_mono)
        except Exception as exc:
            self._event("proxy_error", error=f"the gate's word: {type(exc).__name__}: {exc}")
            return
        if word != self.word:
            self.word = word
            self._send({"gate": word})

    def _send(self, message: dict[str, Any]) -> None:
        if self.writer is not None:
            with contextlib.suppress(OSError):
                self.writer.write(json.dumps(message).encode() + b"\n")

    def view(self) -> dict[str, Any]:
        out = {
            "listen": self.settings.listen,
            "pid": self.pid,
            "connected": self.writer is not None,
        }
        return {**out, **(self.figures or {})}

    async def close(self, live_restore: bool) -> None:
        """The daemon stops: with `live_restore` the proxy runs on (holding while the daemon
        is away); without, it exits."""
        self._closing = True
        writer = self.writer
        if writer is None:
            return
        if not live_restore and not self.external:
            self._send({"exit": True})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ended.wait(), EXIT_WAIT_S)
            if self._proc is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._proc.wait(), 1.0)
        writer.close()


def _last_line(path: Path) -> str | None:
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return None
    return lines[-1] if lines else None
