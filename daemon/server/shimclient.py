"""The daemon's side of the shim (`shim.py`): one connection (`ShimClient`) over which servers
are started, watched and signalled, each behind `ShimServer`, a second `effects.ServerHandle`.

Requests are written at once from the caller's turn (a spawn's request leaves in the machine's
own turn, as `local.start`'s exec does) and answered in order; the shim's notices (an exit,
the pipes closed, output dropped for want of room) and the output frames go to the handle of
their launch. A connection that ends (the shim gone) ends every handle's wait: each is told
its exit is unknown (None), so nothing waits on a shim that will not answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import reaper, shimwire

LOST = "the shim's connection ended"
DROPPED = "# gpuwarden: {} bytes of output not handed to the daemon (behind): the log has them\n"
EARLY_MAX = 4 * 1024 * 1024  # output held for a handle not read yet (the file has all of it)


class ShimError(Exception):
    """A request the shim refused (`reason`: `exec_failed`, `log_unwritable`, ...)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


class ShimVersionError(ConnectionError):
    """The shim speaks another major version of the protocol."""


class ShimClient(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = shimwire.Reader()
        self.replies: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.servers: dict[str, ShimServer] = {}
        self.req = 0
        self.version: tuple[int, int] = (0, 0)
        self.shim_pid = 0
        self.lost = asyncio.get_running_loop().create_future()  # set to the reason it ended

    @classmethod
    async def connect(cls, folder: Path) -> ShimClient:
        """Connect to the shim of `folder` and greet it; ConnectionError when its protocol's
        major version is not this one's."""
        loop = asyncio.get_running_loop()
        _, client = await loop.create_unix_connection(cls, str(folder / "shim.sock"))
        try:
            hello = await client.request("hello", version=list(shimwire.VERSION))
        except ConnectionError as exc:  # it went at once (a shim killed a moment ago)
            client.close()
            raise ConnectionResetError(f"the shim ended the connection at once: {exc}") from exc
        client.version = (int(hello["version"][0]), int(hello["version"][1]))
        client.shim_pid = int(hello["pid"])
        if client.version[0] != shimwire.VERSION[0]:
            client.close()
            raise ShimVersionError(
                f"shim protocol {client.version}, this daemon's {shimwire.VERSION}"
            )
        return client

    # -- the connection ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.reader.feed(data)
        except ValueError as exc:
            self._end(f"the shim sent a broken frame: {exc}")
            return
        for kind, body in frames:
            if kind == shimwire.OUTPUT:
                launch_id, stream, chunk = body
                server = self.servers.get(launch_id)
                if server is not None:
                    server.output(chunk, stream)
            elif "req" in body and body["req"] is not None:
                reply = self.replies.pop(int(body["req"]), None)
                if reply is not None and not reply.done():
                    reply.set_result(body)
            elif (server := self.servers.get(str(body.get("launch_id")))) is not None:
                server.notice(body)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(LOST if exc is None else f"{LOST}: {exc}")

    def _end(self, why: str) -> None:
        if self.transport is not None:
            self.transport.close()
        if not self.lost.done():
            self.lost.set_result(why)
        for reply in self.replies.values():
            if not reply.done():
                reply.set_exception(ConnectionError(why))
        self.replies.clear()
        for server in list(self.servers.values()):
            server.lost(why)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- requests ---------------------------------------------------------------------------------

    def send(self, op: str, **fields: Any) -> asyncio.Future[dict[str, Any]]:
        """Write the request now; its reply (a shim's error raised as `ShimError`) later."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        if self.lost.done() or self.transport is None:
            future.set_exception(ConnectionError(self.lost.result() if self.lost.done() else LOST))
            return future
        self.req += 1
        self.replies[self.req] = future
        self.transport.write(shimwire.json_frame({"op": op, "req": self.req, **fields}))
        return future

    def tell(self, op: str, **fields: Any) -> None:
        """A request whose answer nobody waits for (a signal, a release): a connection that
        has ended says so through `lost`."""
        self.send(op, **fields).add_done_callback(_consume)

    async def request(self, op: str, **fields: Any) -> dict[str, Any]:
        reply = await self.send(op, **fields)
        if "error" in reply:
            raise ShimError(str(reply["error"]), str(reply.get("detail") or ""))
        return reply

    def spawn(
        self,
        *,
        launch_id: str,
        token: str,
        path: str,
        argv: list[str],
        env: dict[str, str],
        log: Path,
        head: str,
        max_bytes: int | None,
    ) -> ShimServer:
        """Ask for the server now; its handle waits for the shim's answer (`spawned`)."""
        full_env = {**env, reaper.LAUNCH_ENV: launch_id, reaper.TOKEN_ENV: token}
        server = ShimServer(self, launch_id, log)
        self.servers[launch_id] = server
        reply = self.send(
            "spawn",
            launch_id=launch_id,
            token=token,
            path=path,
            argv=argv,
            env=full_env,
            log=str(log),
            head=head,
            max_bytes=max_bytes,
        )
        reply.add_done_callback(server.answered)
        return server

    async def attach(self, launch_id: str, log: Path) -> ShimServer:
        """Take over a server the shim runs (a previous life's): its handle, as it is now."""
        server = ShimServer(self, launch_id, log)
        self.servers[launch_id] = server
        try:
            server.answered_with(await self.request("attach", launch_id=launch_id))
        except BaseException:
            self.servers.pop(launch_id, None)
            raise
        return server


class ShimServer:
    """A server the shim runs: an `effects.ServerHandle`."""

    survives_daemon = True  # the shim's child: with live_restore a later life adopts it

    def __init__(self, client: ShimClient, launch_id: str, log: Path) -> None:
        loop = asyncio.get_running_loop()
        self.client, self.launch_id, self.log_path = client, launch_id, log
        self.pid = 0
        self.create_time = 0.0
        self.spawned: asyncio.Future[None] = loop.create_future()  # the shim's answer
        self.exited: asyncio.Future[int | None] = loop.create_future()
        self.first_output: asyncio.Future[None] = loop.create_future()
        self.closed = asyncio.Event()
        self.released = False
        self.on_write: Callable[[str | None], None] = lambda error: None  # set by `ShimFile`
        self.on_output: Callable[[bytes, int], None] = self._held  # until `read_output`
        self._early: list[tuple[bytes, int]] = []  # what came before: handed on then
        self._early_bytes = 0
        self._on_exit: Callable[[int | None], None] | None = None
        self.dropped_bytes = 0  # output the shim did not hand on (the file has it)
        self.write_error: str | None = None  # the shim's writes to its log fail (at attach)
        self.lost_reason: str | None = None  # the shim was lost while it ran: exit unknown

    @property
    def pgid(self) -> int:
        return self.pid  # the shim starts each server in a session of its own

    # -- what the shim says -------------------------------------------------------------------

    def answered(self, reply: asyncio.Future[dict[str, Any]]) -> None:
        if self.spawned.done():
            return
        try:
            body = reply.result()
        except Exception as exc:  # the connection ended first
            self.spawned.set_exception(ShimError("internal_error", str(exc)))
            return
        if "error" in body:
            self.spawned.set_exception(ShimError(str(body["error"]), str(body.get("detail", ""))))
        else:
            self.answered_with(body)

    def answered_with(self, body: dict[str, Any]) -> None:
        self.pid = int(body["pid"])
        self.write_error = str(body["write_error"]) if body.get("write_error") else None
        if not self.spawned.done():
            self.spawned.set_result(None)
        if body.get("running") is False:
            self._exit(body.get("returncode"))
        if body.get("closed"):
            self.closed.set()

    def output(self, chunk: bytes, stream: int) -> None:
        if not self.first_output.done():
            self.first_output.set_result(None)
        self.on_output(chunk, stream)

    def notice(self, body: dict[str, Any]) -> None:
        event = body.get("event")
        if event == "exit":
            self._exit(body.get("returncode"))
            if body.get("closed"):
                self.closed.set()
        elif event == "closed":
            self.closed.set()
        elif event == "dropped":  # the shim held back what the daemon could not take
            lost = int(body.get("bytes") or 0)
            self.dropped_bytes += lost
            self.on_output(DROPPED.format(lost).encode(), 2)  # the ring and the dump say so
        elif event == "write":  # its log's writes fail (the error), or work again (None)
            self.on_write(str(body["error"]) if body.get("error") else None)

    def lost(self, why: str) -> None:
        """The shim is gone: this server's output and exit will not come through it."""
        if not self.spawned.done():
            self.spawned.set_exception(ShimError("internal_error", why))
        if not self.exited.done():
            self.lost_reason = f"the shim running it was lost ({why}): its exit is unknown"
        self._exit(None)
        self.closed.set()

    def _exit(self, returncode: Any) -> None:
        if self.exited.done():
            return
        code = int(returncode) if isinstance(returncode, int) else None
        self.exited.set_result(code)
        if not self.first_output.done():
            self.first_output.set_result(None)
        if self._on_exit is not None:
            self._on_exit(code)

    # -- ServerHandle -------------------------------------------------------------------------

    def signal(self, sig: signal.Signals) -> bool:
        if self.exited.done() or not self.pid:
            return False
        self.client.tell("signal", launch_id=self.launch_id, sig=int(sig), group=False)
        return True

    def kill_group(self) -> None:
        if self.pid and not self.released:
            self.client.tell("signal", launch_id=self.launch_id, sig=signal.SIGKILL, group=True)

    def on_exit(self, notify: Callable[[int | None], None]) -> None:
        if self.exited.done():
            notify(self.exited.result())
        else:
            self._on_exit = notify

    async def wait_started(self, timeout_s: float) -> None:
        started: list[asyncio.Future[Any]] = [self.first_output, self.exited]
        await asyncio.wait(started, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)

    def _held(self, chunk: bytes, stream: int) -> None:
        """Output that came before anyone reads it (the exec's first lines arrive with the
        spawn's answer): kept for `read_output`, up to `EARLY_MAX` (beyond, the file has it)."""
        if self._early_bytes + len(chunk) > EARLY_MAX:
            self.dropped_bytes += len(chunk)
            return
        self._early.append((chunk, stream))
        self._early_bytes += len(chunk)

    def forget_early(self) -> None:
        """What came so far is read from the file instead (an adoption reads its tail)."""
        self._early, self._early_bytes = [], 0

    async def read_output(self, on_output: Callable[[bytes, int], None]) -> None:
        early, self._early, self._early_bytes = self._early, [], 0
        self.on_output = on_output
        for chunk, stream in early:
            on_output(chunk, stream)
        create_time = await asyncio.to_thread(reaper.create_time_of, self.pid)
        self.create_time = create_time or time.time()

    @property
    def output_closed(self) -> bool:
        return self.closed.is_set()

    async def wait_output_closed(self, timeout_s: float) -> bool:
        if self.closed.is_set():
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.closed.wait(), timeout_s)
        return self.closed.is_set()

    def release(self, trailer: str) -> None:
        """Done with it: the shim closes its log with `trailer` (killing it if it runs)."""
        if not self.released:
            self.released = True
            self.client.servers.pop(self.launch_id, None)
            self.client.tell("release", launch_id=self.launch_id, trailer=trailer)

    def close(self) -> None:
        self.release("")


class ShimFile:
    """A launch's log file as the shim writes it (a `launchlog.FileWriter`): what arrives is
    whole lines, already in the file; closing it releases the server, with its trailer."""

    def __init__(
        self, server: ShimServer, on_write: Callable[[str | None], None] | None = None
    ) -> None:
        self.server = server
        self.closed = False
        if on_write is not None:  # the shim's writes to it failing, and working again
            server.on_write = on_write
            if server.write_error:  # (failing already: an adopted server's)
                on_write(server.write_error)

    def feed(self, chunk: bytes, stream: int = 2) -> bytes:
        return chunk

    def flush_partials(self) -> list[tuple[int, bytes]]:
        return []  # the shim ends the unfinished lines as the pipes close

    def close(self, trailer: bytes = b"") -> None:
        self.closed = True
        self.server.release(trailer.decode(errors="replace").removeprefix("# ").rstrip("\n"))


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
