"""The local server's handle: a server this daemon starts and watches itself, the fallback
for when no shim can be had (`shimstart.py`; the shim is every launch's parent otherwise).

* The server runs in its own session (so its group can be signalled without touching us),
  stdin closed, stdout and stderr on pipes read in chunks by the event loop.
* Its exit is taken from the process itself (its pidfd, then waitpid), never from pipe EOF:
  a grandchild can hold the pipes open for ever.
* It inherits only descriptors 0, 1 and 2, and the launch's id and token in its environment
  (`reaper.LAUNCH_ENV`, `reaper.TOKEN_ENV`), by which whatever it leaves behind is found.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import reaper

F_SETPIPE_SZ = 1031
PIPE_SIZE = 1 << 20
READ_SIZE = 64 * 1024


class _Protocol:
    """The server's two output pipes and its exit, as one: what `LocalServer` waits on."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.on_output: Callable[[bytes, int], None] = lambda data, fd: None
        self.unread: list[int] = []  # the pipes' read ends, until `read_output` takes them
        self.exited: asyncio.Future[int | None] = loop.create_future()
        # Set by the first output: the server is running (see `host._spawn`'s first slice).
        self.first_output: asyncio.Future[None] = loop.create_future()
        self.pipes_closed = asyncio.Event()
        self._open = 2
        self.pipes: list[asyncio.ReadTransport] = []
        # Told of the exit in the same turn (a future's callbacks wait for the next one).
        self.on_exit: Callable[[int | None], None] | None = None

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        if not self.first_output.done():
            self.first_output.set_result(None)
        self.on_output(data, fd)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self._open -= 1
        if self._open <= 0:
            self.pipes_closed.set()

    def process_exited(self, returncode: int | None) -> None:
        if not self.exited.done():
            self.exited.set_result(returncode)
            if self.on_exit is not None:
                self.on_exit(returncode)

    def watch_exit(self, pid: int) -> None:
        """Reap `pid` when it exits: its pidfd on the loop, or (a kernel before 5.3, with no
        pidfd) a thread blocked in waitpid."""
        loop = asyncio.get_running_loop()
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            threading.Thread(
                target=self._wait_thread, args=(loop, pid), name=f"wait-{pid}", daemon=True
            ).start()
            return

        def readable() -> None:
            loop.remove_reader(pidfd)
            try:
                returncode = _reap(pid, pidfd)  # it has exited: this does not block
            finally:
                os.close(pidfd)
                reaper.disown(pid)  # reaped: the pid is no longer ours
            self.process_exited(returncode)

        loop.add_reader(pidfd, readable)

    def _wait_thread(self, loop: asyncio.AbstractEventLoop, pid: int) -> None:
        returncode = _reap(pid)
        reaper.disown(pid)
        with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon is exiting
            loop.call_soon_threadsafe(self.process_exited, returncode)


def _reap(pid: int, pidfd: int | None = None) -> int | None:
    """The exit code of our child `pid` (-N for signal N), waiting for it; None when it was
    reaped elsewhere. With its pidfd, that very process is reaped, whatever its pid has become
    (waitid P_PIDFD, Linux 5.4+)."""
    if pidfd is not None and hasattr(os, "P_PIDFD"):
        try:
            info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
        except ChildProcessError:
            return None
        except OSError:  # a kernel with pidfd_open but without P_PIDFD (5.3)
            pass
        else:
            if info is None:
                return None
            return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return None
    return os.waitstatus_to_exitcode(status)


class _Pipe(asyncio.Protocol):
    """One output stream of the server, read by the loop in chunks of at most `READ_SIZE`."""

    def __init__(self, owner: _Protocol, fd: int) -> None:
        self.owner, self.fd = owner, fd

    def data_received(self, data: bytes) -> None:
        self.owner.pipe_data_received(self.fd, data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.pipe_connection_lost(self.fd, exc)


@dataclass
class LocalServer:
    """A server this daemon started (`start`): an `effects.ServerHandle`."""

    pid: int
    create_time: float
    started_mono: float
    launch_id: str
    protocol: _Protocol
    signals_sent: list[str] = field(default_factory=list)
    survives_daemon = False  # the daemon's own child (no shim could be had): it ends with it

    @property
    def exited(self) -> asyncio.Future[int | None]:
        return self.protocol.exited

    @property
    def pgid(self) -> int:
        return self.pid  # start_new_session: the server leads its own group

    def signal(self, sig: signal.Signals) -> bool:
        """Signal the main process only (SGLang drains on SIGTERM in its main process)."""
        if self.exited.done():
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)
            self.signals_sent.append(sig.name)
            return True
        return False

    def on_exit(self, notify: Callable[[int | None], None]) -> None:
        """`notify(returncode)` once the process has exited: now if it has, else in the very
        turn its exit is read (a future's callbacks would wait for the next one)."""
        if self.exited.done():
            notify(None if self.exited.cancelled() else self.exited.result())
        else:
            self.protocol.on_exit = notify

    def kill_group(self) -> None:
        """SIGKILL the whole process group (the server and the children still in it)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signal.SIGKILL)
            self.signals_sent.append("SIGKILL(group)")

    @property
    def output_closed(self) -> bool:
        return self.protocol.pipes_closed.is_set()

    async def wait_output_closed(self, timeout_s: float) -> bool:
        if self.protocol.pipes_closed.is_set():
            return True  # the usual case after an exit: no timer, no task
        try:
            await asyncio.wait_for(self.protocol.pipes_closed.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def wait_started(self, timeout_s: float) -> None:
        """Return at its first output or its exit, or after `timeout_s`."""
        started: list[asyncio.Future[Any]] = [self.protocol.first_output, self.exited]
        await asyncio.wait(started, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)

    async def read_output(self, on_output: Callable[[bytes, int], None]) -> None:
        """Hand the output to `on_output` (chunks, with 1 or 2 for the stream) from now on, and
        learn the process's create time."""
        loop = asyncio.get_running_loop()
        protocol = self.protocol
        protocol.on_output = on_output
        for fd in (1, 2):
            # Each read end passes to its transport (which closes it, also on failure); the
            # ones not yet passed stay in `unread`, for `close`.
            read_end = protocol.unread.pop(0)
            # Room for bursts: the child blocks less while we process a chunk.
            with contextlib.suppress(OSError):
                fcntl.fcntl(read_end, F_SETPIPE_SZ, PIPE_SIZE)
            pipe, _ = await loop.connect_read_pipe(
                lambda fd=fd: _Pipe(protocol, fd),  # type: ignore[misc]
                open(read_end, "rb", buffering=0),  # noqa: SIM115, ASYNC230 - the transport closes it
            )
            # Smaller reads than asyncio's 256 KiB let other callbacks (the API) run between
            # chunks during a flood; the cost per byte barely changes.
            pipe.max_size = READ_SIZE  # type: ignore[attr-defined]
            protocol.pipes.append(pipe)
        # Read off the loop: /proc/PID/stat answers only once the exec is through (a
        # millisecond or two of a Python server's), and the loop has other work meanwhile.
        create_time = await asyncio.to_thread(reaper.create_time_of, self.pid)
        self.create_time = create_time or time.time()

    def close(self) -> None:
        """Drop our ends of the pipes (a grandchild may hold the other ends for ever). A main
        process still running is killed: nothing of ours may outlive its handle (its exit is
        still read, from its pidfd)."""
        self.signal(signal.SIGKILL)
        for pipe in self.protocol.pipes:
            with contextlib.suppress(Exception):
                pipe.close()
        for fd in self.protocol.unread:
            os.close(fd)
        self.protocol.unread = []


SYS_CLOSE_RANGE = 436  # the same number on x86-64 and arm64
CLOSE_RANGE_CLOEXEC = 4
_libc: ctypes.CDLL | None = None


def _close_on_exec_above_stdio() -> None:
    """Mark every descriptor above 2 close-on-exec, so the server inherits only 0, 1 and 2
    (subprocess's close_fds, which posix_spawn lacks). Python's own are already; C libraries'
    may not be (NVML's device files). One close_range(2) call on Linux 5.11+; a scan of
    /proc/self/fd on older kernels."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        if _libc.syscall(SYS_CLOSE_RANGE, 3, 0xFFFFFFFF, CLOSE_RANGE_CLOEXEC) == 0:
            return
    except (OSError, AttributeError):
        pass
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                if int(name) > 2 and os.get_inheritable(int(name)):
                    os.set_inheritable(int(name), False)


def _pipe() -> tuple[int, int]:
    """A pipe whose ends are not 0, 1 or 2 (a daemon started with those closed would get
    them, and the server's dup2 onto them would then be a no-op that keeps close-on-exec)."""
    ends = list(os.pipe())
    try:
        for i, end in enumerate(ends):
            if end <= 2:
                ends[i] = fcntl.fcntl(end, fcntl.F_DUPFD_CLOEXEC, 3)
                os.close(end)
    except OSError:
        for end in ends:
            with contextlib.suppress(OSError):
                os.close(end)
        raise
    return ends[0], ends[1]


def executable(name: str, env: dict[str, str]) -> str:
    """`name` as exec finds it: a path when it has a slash, else searched in the server's own
    PATH as subprocess does (not the daemon's PATH; an empty entry is the working directory).
    Not found: FileNotFoundError; found only without the right to run it: PermissionError."""
    if "/" in name:
        return name
    denied = False
    for folder in os.get_exec_path(env):
        candidate = os.path.join(folder, name)
        if os.path.isfile(candidate):
            if os.access(candidate, os.X_OK):
                return candidate
            denied = True
    if denied:
        raise PermissionError(errno.EACCES, "Permission denied", name)
    raise FileNotFoundError(errno.ENOENT, "No such file or directory", name)


def start(argv: list[str], env: dict[str, str], launch_id: str, *, token: str = "") -> LocalServer:
    """Start `argv` (no shell) in a new session, stdin /dev/null, stdout and stderr on pipes;
    return at its exec. Raises OSError when it cannot be executed. Nothing of its output is
    read until `read_output`.

    posix_spawn (a vfork and the exec, the environment converted in C) from the loop's own
    thread, and the exit read from a pidfd on the loop: on the restart path nothing runs
    between the decision and the exec but this, and the exit reaches the owner in the turn the
    pidfd turns readable. The server inherits only the three descriptors it is given."""
    full_env = {**env, reaper.LAUNCH_ENV: launch_id, reaper.TOKEN_ENV: token}
    path = executable(argv[0], full_env)
    protocol = _Protocol()
    started = time.monotonic()
    out_r, out_w = _pipe()
    try:
        err_r, err_w = _pipe()
    except OSError:
        os.close(out_r)
        os.close(out_w)
        raise
    _close_on_exec_above_stdio()
    try:
        pid = os.posix_spawn(
            path,
            argv,
            full_env,
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, out_w, 1),
                (os.POSIX_SPAWN_DUP2, err_w, 2),
            ],
            setsid=True,
            # What Python ignores (SIGPIPE) and the daemon too (SIGXFSZ) is the default again
            # in the server, as subprocess's restore_signals did: `| head` ends a shell quietly.
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
        )
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
    reaper.own(pid)
    try:
        protocol.watch_exit(pid)
    except BaseException:  # nothing would read its exit: it must not run on unseen
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        reaper.disown(pid)  # the orphan reaper takes its exit status
        os.close(out_r)
        os.close(err_r)
        raise
    protocol.unread = [out_r, err_r]
    return LocalServer(
        pid=pid, create_time=0.0, started_mono=started, launch_id=launch_id, protocol=protocol
    )
