"""The shim found or started: the daemon connects to the shim of its state directory (a
previous life's, still running its servers) or starts one, once, at its own start and never
on the restart path.

The shim is started by a bare interpreter (`python -I -S shim.py`: no site, no package imports
but its two sibling files) in a session of its own, so it outlives the daemon. While this life
of the daemon is its parent, its pid is owned (the reaper and the exit sweep leave it and the
servers under it alone) and its exit is read from its pidfd.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import sys
from pathlib import Path

from . import reaper
from .shimclient import ShimClient

SHIM = Path(__file__).with_name("shim.py")
START_TIMEOUT_S = 10.0
CONNECT_TRIES = 5
# Set (to the unit's name) where the shim runs in a systemd unit of its own: the daemon then
# connects to it, waiting for it, and never starts one in its own cgroup.
EXTERNAL_ENV = "GPUWARDEN_SHIM_UNIT"
EXTERNAL_WAIT_S = 30.0
CONNECT_RETRY_S = 0.05


async def connect_or_start(folder: Path) -> tuple[ShimClient, int | None]:
    """The shim of `folder`, connected: one already running (None), or one started now (its
    pid). OSError or ConnectionError when neither works."""
    with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
        return _adopted_child(await _connect(folder)), None
    pid = await asyncio.to_thread(_start, folder)
    if pid is not None:
        _reap_when_done(pid)
    return await _connect(folder), pid


def _adopted_child(shim: ShimClient) -> ShimClient:
    """A shim found running may be this process's own child (the daemon executed itself again
    since it started it, keeping its pid): owned again, so no sweep takes it for a leftover, and
    reaped when it ends."""
    with contextlib.suppress(OSError, ValueError):
        stat = Path(f"/proc/{shim.shim_pid}/stat").read_text()
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
            reaper.own(shim.shim_pid)
            _reap_when_done(shim.shim_pid)
    return shim


async def _connect(folder: Path) -> ShimClient:
    """A shim killed a moment ago may still accept a connection and then reset it: it is
    tried again (a few times, briefly) before its successor is started."""
    for _ in range(CONNECT_TRIES - 1):
        try:
            return await ShimClient.connect(folder)
        except (ConnectionResetError, BrokenPipeError):
            await asyncio.sleep(CONNECT_RETRY_S)
    return await ShimClient.connect(folder)


def command(folder: Path) -> list[str]:
    """The shim's command line: a bare interpreter (no site, no package imports) on its file."""
    return [sys.executable, "-I", "-S", str(SHIM), "--dir", str(folder)]


def environment() -> dict[str, str]:
    """The shim's environment: the daemon's locale and path. (A server's environment is the
    one sent with it.)"""
    return {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TZ")}


async def connect_external(folder: Path, wait_s: float = EXTERNAL_WAIT_S) -> ShimClient:
    """The shim of `folder`, started by another (its own systemd unit): connected, waiting up to
    `wait_s` for it to listen. Never started here."""
    deadline = asyncio.get_running_loop().time() + wait_s
    while True:
        try:
            return await _connect(folder)
        except (FileNotFoundError, ConnectionRefusedError):
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


def _start(folder: Path) -> int | None:
    """Start a shim; return once it listens (its pid), or once another is found to (None)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    read_end, write_end = os.pipe()
    try:
        argv = command(folder)
        pid = reaper.spawn_owned(
            argv[0],
            argv,
            environment(),
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, write_end, 1),
            ],
            setsid=True,
        )
    finally:
        os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], START_TIMEOUT_S)
        said = os.read(read_end, 256) if ready else b""
    finally:
        os.close(read_end)
    if said.startswith(b"listening "):
        return pid
    _reap(pid)  # it ended (another shim holds the folder) or is wedged: not ours to keep
    if said.startswith(b"running already"):
        return None
    raise OSError(f"the shim did not start: {said.decode(errors='replace').strip() or 'silent'}")


def _reap(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    reaper.disown(pid)


def _reap_when_done(pid: int) -> None:
    """Read the shim's exit while this life is its parent (else it would linger a zombie)."""
    loop = asyncio.get_running_loop()
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return  # gone already; the orphan reaper takes it

    def exited() -> None:
        loop.remove_reader(pidfd)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
        os.close(pidfd)
        reaper.disown(pid)

    loop.add_reader(pidfd, exited)
