"""The shim's side of one server process (`shim.py` loads this file by its path): its exec,
its record, its reaping and the exit record written the moment it ends; and the shim's heap
given back after a flood. Standard library only and no package imports.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from typing import Any


class Server:
    """One server the shim runs, until the daemon releases it."""

    def __init__(self, launch_id: str, token: str, argv: list[str], pid: int) -> None:
        self.launch_id, self.token, self.argv, self.pid = launch_id, token, argv, pid
        self.started_at = time.time()
        self.log: Any = None
        self.pipes: dict[int, int] = {}  # read end -> stream
        self.pidfd = -1
        self.returncode: int | None = None
        self.exited_at: float | None = None
        self.watchers: set[Any] = set()  # the clients told of its output and exit
        self.released = False  # the daemon is done with it: forgotten once it has exited

    @property
    def running(self) -> bool:
        return self.exited_at is None

    def view(self) -> dict[str, Any]:
        return {
            "launch_id": self.launch_id,
            "token": self.token,
            "argv": self.argv,
            "pid": self.pid,
            "started_at": self.started_at,
            "running": self.running,
            "returncode": self.returncode,
            "exited_at": self.exited_at,
            "closed": not self.pipes,
            "log": self.log.path if self.log is not None else None,
            "size": self.log.size if self.log is not None else 0,
            "write_error": self.log.write_error if self.log is not None else None,
        }


def execute(req: dict[str, Any]) -> tuple[list[tuple[int, int]], int]:
    """Execute a checked spawn request (`shimwire.spawn_request`) in a session of its own,
    stdin /dev/null, stdout and stderr on two pipes: the pipes' ends, and its pid. The write
    ends are closed here; the read ends are the caller's. Raises what the exec raised."""
    ends = [os.pipe(), os.pipe()]
    try:
        pid = os.posix_spawn(
            req["path"],
            req["argv"],
            req["env"],
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, ends[0][1], 1),
                (os.POSIX_SPAWN_DUP2, ends[1][1], 2),
            ],
            setsid=True,
            # What the shim ignores is the default again in the server.
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGHUP),
        )
    except BaseException:
        for r, w in ends:
            os.close(r)
            os.close(w)
        raise
    for _, w in ends:
        os.close(w)
    return ends, pid


def reap(server: Server) -> None:
    """Its pidfd says it has exited: its status read, its pidfd closed."""
    try:
        info = os.waitid(os.P_PIDFD, server.pidfd, os.WEXITED)
    except ChildProcessError:
        info = None
    os.close(server.pidfd)
    if info is not None:
        code = info.si_status
        server.returncode = code if info.si_code == os.CLD_EXITED else -code
    server.exited_at = time.time()


def write_record(server: Server, folder: str) -> None:
    """Its exit, on disk (`<folder>/<launch_id>.exit`, written whole): a daemon away now
    finds it later."""
    record = {k: v for k, v in server.view().items() if k != "argv"}
    path = os.path.join(folder, f"{server.launch_id}.exit")
    with contextlib.suppress(OSError):
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)


def trim_heap() -> None:
    """Give the heap's free memory back (glibc): a flood's buffers, and a slow client's, are
    not kept for the shim's life. Elsewhere, nothing."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes  # noqa: PLC0415 - half a MiB, only once output has gone through

            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = lambda pad: 0  # noqa: E731
    _malloc_trim(0)


_malloc_trim: Any = None
