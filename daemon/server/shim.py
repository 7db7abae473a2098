"""The shim: the servers' parent, so that they can outlive the daemon (`live_restore`).

One long-lived process per state directory, started by the daemon and never on the restart
path: it executes each server when the daemon asks, in a session of its own, writes the
server's output to the launch's log itself (`logfile.py`'s rules, so nothing the server
writes waits on the daemon), hands the daemon those lines as they are written, takes its
signals, and records each exit (code or signal, time, log size) the moment the server ends,
in memory and in `<dir>/<launch_id>.exit`. The daemon may stop, crash or be replaced
meanwhile: a later daemon connects again, lists what runs and attaches to it.

Run as a file by a bare interpreter (`python -I -S shim.py --dir DIR`): standard library
only, with `shimwire.py`, `shimproc.py`, `shimout.py` and `logfile.py` loaded by their paths,
so it stays small. It listens on `<dir>/shim.sock` (mode 0600) and serves one request at a
time from each of its clients (see `shimwire.py` and `shimclient.py`). A client that does not
read is never waited for: past its room, the middle of a flood is dropped for it (the file has
it) and it is told, and it gets the flood's end (`shimout.py`).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import selectors
import signal
import socket
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name: str, path: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_gpuwarden_shim_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


wire = _load("wire", os.path.join(_HERE, "shimwire.py"))
proc = _load("proc", os.path.join(_HERE, "shimproc.py"))
logfile = _load("logfile", os.path.join(os.path.dirname(_HERE), "logfile.py"))
out = _load("out", os.path.join(_HERE, "shimout.py"))

READ_SIZE = 256 * 1024  # a flood moves in few reads (the pipes hold 1 MiB)
PIPE_SIZE = 1 << 20
F_SETPIPE_SZ = 1031


class Shim:
    def __init__(self, folder: str, idle_exit_s: float) -> None:
        self.dir, self.idle_exit_s = folder, idle_exit_s
        self.sel = selectors.DefaultSelector()
        self.servers: dict[str, Any] = {}  # launch id -> `shimproc.Server`
        self.clients: set[Any] = set()
        self.idle_since = time.monotonic()
        self.done = False
        self.accept_paused: float | None = None
        self.term_asked = False  # SIGTERM: end once nothing runs (the servers never go with it)
        self.moved = False  # output went through since the heap was last trimmed
        os.makedirs(folder, mode=0o700, exist_ok=True)
        path = os.path.join(folder, "shim.sock")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # the caller holds the lock: a socket left here is a dead shim's
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.listener.bind(path)  # mode 0600
        finally:
            os.umask(old)
        self.listener.listen(16)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, ("accept", None))

    # -- the loop ---------------------------------------------------------------------------------

    def run(self) -> None:
        while not self.done:
            ready = self.sel.select(timeout=1.0)
            if not ready and self.moved:  # a quiet second after output: give its buffers back
                self.moved = False
                proc.trim_heap()
            for key, mask in ready:
                what, obj = key.data
                if what == "accept":
                    self._accept()
                elif what == "client":
                    if mask & selectors.EVENT_READ:
                        self._client_readable(obj)
                    if mask & selectors.EVENT_WRITE and obj in self.clients:
                        self._flush(obj)
                elif what == "pipe" and key.fd in obj.pipes:  # not closed earlier in the batch
                    self._pipe_readable(obj, key.fd)
                elif what == "exit" and obj.pidfd == key.fd and obj.running:
                    self._exited(obj)
            if self.accept_paused is not None and time.monotonic() - self.accept_paused > 1:
                self.accept_paused = None
                self.sel.register(self.listener, selectors.EVENT_READ, ("accept", None))
            running = any(s.running or s.pipes for s in self.servers.values())
            if self.term_asked and not running:
                self.done = True
            busy = self.clients or running
            if busy:
                self.idle_since = time.monotonic()
            elif self.idle_exit_s and time.monotonic() - self.idle_since > self.idle_exit_s:
                self.done = True

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        except OSError:  # out of descriptors: stop accepting for a second, not spin
            self.sel.unregister(self.listener)
            self.accept_paused = time.monotonic()
            return
        sock.setblocking(False)
        client = out.Client(sock, wire.Reader(), wire.json_frame)
        self.clients.add(client)
        self.sel.register(sock, selectors.EVENT_READ, ("client", client))

    def _client_readable(self, client: Any) -> None:
        try:
            data = client.sock.recv(READ_SIZE)
            frames = client.reader.feed(data) if data else None
        except (OSError, ValueError):  # gone, or a broken frame: that client goes
            frames = None
        if frames is None:
            self._drop_client(client)
            return
        for kind, message in frames:
            if kind != wire.JSON or client not in self.clients:
                continue
            try:
                reply = self._request(client, message)
            except Exception as exc:  # a bad request never ends the shim
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            self._send(client, wire.json_frame({"req": message.get("req"), **reply}))

    def _drop_client(self, client: Any) -> None:
        self.clients.discard(client)
        for server in self.servers.values():
            server.watchers.discard(client)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(client.sock)
        client.sock.close()

    def _send(self, client: Any, frame: Any, output_of: str | None = None) -> None:
        """Send `frame` (bytes, or its parts) to `client`, or queue it (`shimout.py`)."""
        if client in self.clients:
            parts = frame if isinstance(frame, tuple) else (frame,)
            self._watch(client, client.send(parts, output_of))

    def _flush(self, client: Any) -> None:
        self._watch(client, client.flush())

    def _watch(self, client: Any, waiting: bool | None) -> None:
        """After a send: a client that is to go goes; one with output waiting is watched for
        its socket to take more."""
        if waiting is None:
            self._drop_client(client)
            return
        if waiting != client.writing:  # (a change only: not a system call per frame)
            client.writing = waiting
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if waiting else 0)
            self.sel.modify(client.sock, events, ("client", client))

    def _notify(self, server: Any, event: str, **extra: Any) -> None:
        for client in list(server.watchers):
            self._send(client, wire.json_frame({"event": event, **server.view(), **extra}))

    # -- requests ---------------------------------------------------------------------------------

    def _request(self, client: Any, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "hello":
            return {"version": list(wire.VERSION), "pid": os.getpid()}
        if op == "list":
            return {"servers": [s.view() for s in self.servers.values()]}
        if op == "spawn":
            return self._spawn(client, msg)
        server = self.servers.get(str(msg.get("launch_id")))
        if op == "exit":
            if any(s.running or s.pipes for s in self.servers.values()):
                return {"error": "servers are running"}
            self.done = True
            return {"ok": True}
        if server is None:
            return {"error": f"no server {msg.get('launch_id')!r}"}
        if op == "attach":
            server.watchers.add(client)
            view: dict[str, Any] = server.view()
            return view
        if op == "signal":
            return {"ok": self._signal(server, int(msg["sig"]), bool(msg.get("group")))}
        if op == "release":
            self._release(server, str(msg.get("trailer") or ""))
            return {"ok": True}
        return {"error": f"unknown op {op!r}"}

    def _spawn(self, client: Any, msg: dict[str, Any]) -> dict[str, Any]:
        req = wire.spawn_request(msg)  # checked before anything is made of it
        launch_id = req["launch_id"]
        if launch_id in self.servers:
            return {"error": f"launch {launch_id} exists"}
        try:
            ends, pid = proc.execute(req)
        except Exception as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            return {"error": "exec_failed", "detail": why}
        server = proc.Server(launch_id, req["token"], req["argv"], pid)
        self.servers[launch_id] = server
        self._watch_exit(server)  # from its exec on, its exit is read whatever follows
        try:  # after the exec: the server need not wait for a file to be created
            server.log = logfile.LogFile(req["log"], req["head"], max_bytes=req["max_bytes"])
            server.log.on_write = lambda error: self._notify(server, "write", error=error)
        except Exception as exc:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            for r, _ in ends:
                os.close(r)
            server.log, server.released = None, True
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            return {"error": "log_unwritable", "detail": f"{req['log']}: {why}"}
        for (r, _), stream in zip(ends, (1, 2), strict=True):
            with contextlib.suppress(OSError):  # room for bursts while the shim is busy
                fcntl.fcntl(r, F_SETPIPE_SZ, PIPE_SIZE)
            os.set_blocking(r, False)
            server.pipes[r] = stream
            self.sel.register(r, selectors.EVENT_READ, ("pipe", server))
        server.watchers.add(client)
        return {"pid": pid}

    def _watch_exit(self, server: Any) -> None:
        server.pidfd = os.pidfd_open(server.pid)
        self.sel.register(server.pidfd, selectors.EVENT_READ, ("exit", server))

    def _signal(self, server: Any, sig: int, group: bool) -> bool:
        if not server.running:
            return False
        try:
            if group:
                os.killpg(server.pid, sig)
            else:
                signal.pidfd_send_signal(server.pidfd, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def _release(self, server: Any, trailer: str) -> None:
        """The daemon is done with it: a server still running is killed first (nothing the
        shim started runs on unseen), its log closed with `trailer`, its record removed."""
        if server.running or server.pipes:  # its group: also what its exited leader left
            with contextlib.suppress(OSError):
                os.killpg(server.pid, signal.SIGKILL)
        for fd in list(server.pipes):
            self._close_pipe(server, fd)
        if server.log is not None:
            server.log.close(f"# {trailer}\n".encode() if trailer else b"")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.dir, f"{server.launch_id}.exit"))
        server.released = True
        server.watchers.clear()
        if not server.running:
            self.servers.pop(server.launch_id, None)  # else its exit, still to come, does

    # -- a server's output and exit ---------------------------------------------------------------

    def _pipe_readable(self, server: Any, fd: int) -> None:
        try:
            data = os.read(fd, READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close_pipe(server, fd)
            return
        self.moved = True
        lines = server.log.feed(data, server.pipes[fd])
        if lines:
            frame = wire.output_parts(server.launch_id, server.pipes[fd], lines)
            for client in list(server.watchers):
                self._send(client, frame, output_of=server.launch_id)

    def _close_pipe(self, server: Any, fd: int) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(fd)
        with contextlib.suppress(OSError):
            os.close(fd)
        stream = server.pipes.pop(fd)
        if server.log is not None and not server.log.closed:
            ended = server.log.end_stream(stream)
            if ended:
                frame = wire.output_parts(server.launch_id, stream, ended)
                for client in list(server.watchers):
                    self._send(client, frame, output_of=server.launch_id)
        if not server.pipes:
            self._notify(server, "closed")

    def _exited(self, server: Any) -> None:
        self.sel.unregister(server.pidfd)
        proc.reap(server)
        self._notify(server, "exit")  # first: the daemon's restart path waits on it
        if server.released:
            self.servers.pop(server.launch_id, None)
            return
        proc.write_record(server, self.dir)


def main(argv: list[str]) -> int:
    opts = dict(zip(argv[::2], argv[1::2], strict=False))
    folder, idle = opts.get("--dir", ""), float(opts.get("--idle-exit-s", 0))
    if not folder or len(argv) % 2:
        print("usage: shim.py --dir DIR [--idle-exit-s S]", file=sys.stderr)
        return 2
    # A terminal's, the daemon's, a file-size limit's (the write fails, and is said): ignored.
    for sig in (signal.SIGPIPE, signal.SIGINT, signal.SIGHUP, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_IGN)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    # One shim a folder, for its life: a second one started beside it says so and ends (its
    # starter connects to the first).
    lock = os.open(os.path.join(folder, "shim.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.write(1, b"running already\n")
        return 0
    # Its own errors go to <dir>/shim.log; stdout says once that it listens, then goes.
    err = os.open(os.path.join(folder, "shim.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(err, 2)
    os.close(err)
    shim = Shim(folder, idle)
    os.write(1, f"listening {os.getpid()}\n".encode())
    os.dup2(os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC), 1)

    def asked_to_end(signum: int, frame: object) -> None:
        shim.term_asked = True  # once no server runs: its servers never end with it

    signal.signal(signal.SIGTERM, asked_to_end)
    shim.run()
    for server in shim.servers.values():  # unfinished lines ended, files closed
        if server.log is not None:
            server.log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
