"""The only code that starts, signals or reaps processes.

* The server runs in its own session (so its group can be signalled without touching us),
  stdin closed, stdout and stderr on pipes read in chunks by the event loop.
* Its exit is taken from the process itself (its pidfd, then waitpid), never from pipe EOF:
  a grandchild can hold the pipes open for ever.
* Every launch carries ``GPUWARDEN_LAUNCH_ID`` in its environment. Descendants inherit it, so
  whatever a launch left behind (even after ``setsid`` and a double fork) can be found by it.
* The daemon is a child subreaper: orphans of its servers reparent to it, and `reap_orphans`
  reaps them (only pids nobody else waits for: never ``waitpid(-1)``). Zombies count as dead.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

LAUNCH_ENV = "GPUWARDEN_LAUNCH_ID"  # for people: the launch id
# For the sweep: a random token per launch. Launch ids are unique per daemon only, and two
# daemons on one host may start launches in the same second.
TOKEN_ENV = "GPUWARDEN_LAUNCH_TOKEN"
F_SETPIPE_SZ = 1031
PIPE_SIZE = 1 << 20
READ_SIZE = 64 * 1024
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37

# Pids whose exit someone waits for (a server's pidfd, asyncio's child watcher for a helper):
# the reaper must not take them.
_OWNED: set[int] = set()


@contextlib.contextmanager
def owned(pid: int) -> Iterator[None]:
    """Mark a helper child as ours while it runs: the reaper and the sweep leave it alone."""
    _OWNED.add(pid)
    try:
        yield
    finally:
        _OWNED.discard(pid)


def helper_pids() -> frozenset[int]:
    """Children of ours that are helpers (an introspection, a benchmark), not a server."""
    return frozenset(_OWNED)


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def reap_orphans() -> list[int]:
    """Reap zombie children that nobody else waits for (orphans that reparented to us).

    The children are read from the main thread's /proc children list (a full /proc scan where
    the kernel lacks it); a child that is not a zombie is left alone, one waited for
    (`_OWNED`) too."""
    reaped: list[int] = []
    kids = _direct_children()
    if -1 in kids:
        try:
            kids = {c.pid for c in psutil.Process().children()}
        except psutil.Error:
            return reaped
    for pid in kids - _OWNED:
        with contextlib.suppress(ChildProcessError, OSError, ValueError, IndexError):
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            if state == b"Z":
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done:
                    reaped.append(done)
    return reaped


class OrphanReaper:
    """SIGCHLD's handler: reaps orphans a little later, once per burst of signals.

    A SIGCHLD mostly announces our own server's exit, which its pidfd reports;
    reaping orphans right then would put a walk of our children in front of that exit's
    handling and the relaunch. They are zombies already: a few tens of milliseconds more costs
    nothing."""

    DELAY_S = 0.05

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pending: asyncio.TimerHandle | None = None

    def __call__(self) -> None:
        if self._pending is None:
            self._pending = self._loop.call_later(self.DELAY_S, self._reap)

    def _reap(self) -> None:
        self._pending = None
        reap_orphans()

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None


def is_alive(pid: int, create_time: float | None = None) -> bool:
    """Running and not a zombie; with `create_time`, also the same process (no pid reuse)."""
    try:
        proc = psutil.Process(pid)
        if create_time is not None and abs(proc.create_time() - create_time) > 0.05:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def create_time_of(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


class _Protocol:
    """The server's two output pipes and its exit, as one: what `ChildProcess` waits on."""

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
                _OWNED.discard(pid)  # reaped: the pid is no longer ours
            self.process_exited(returncode)

        loop.add_reader(pidfd, readable)

    def _wait_thread(self, loop: asyncio.AbstractEventLoop, pid: int) -> None:
        returncode = _reap(pid)
        _OWNED.discard(pid)
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
class ChildProcess:
    pid: int
    create_time: float
    started_mono: float
    launch_id: str
    protocol: _Protocol
    signals_sent: list[str] = field(default_factory=list)

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

    def detach(self) -> None:
        """Let go of the server without ending it: our pipe ends are dropped (its output is no
        longer read here) and its exit is no longer reported."""
        self.protocol.on_exit = None
        for pipe in self.protocol.pipes:
            with contextlib.suppress(Exception):
                pipe.close()
        for fd in self.protocol.unread:
            os.close(fd)
        self.protocol.unread = []

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
        create_time = await asyncio.to_thread(create_time_of, self.pid)
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


def start(argv: list[str], env: dict[str, str], launch_id: str, *, token: str = "") -> ChildProcess:
    """Start `argv` (no shell) in a new session, stdin /dev/null, stdout and stderr on pipes;
    return at its exec. Raises OSError when it cannot be executed. Nothing of its output is
    read until `read_output`.

    posix_spawn (a vfork and the exec, the environment converted in C) from the loop's own
    thread, and the exit read from a pidfd on the loop: on the restart path nothing runs
    between the decision and the exec but this, and the exit reaches the owner in the turn the
    pidfd turns readable. The server inherits only the three descriptors it is given."""
    full_env = {**env, LAUNCH_ENV: launch_id, TOKEN_ENV: token}
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
    _OWNED.add(pid)
    try:
        protocol.watch_exit(pid)
    except BaseException:  # nothing would read its exit: it must not run on unseen
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        _OWNED.discard(pid)  # the orphan reaper takes its exit status
        os.close(out_r)
        os.close(err_r)
        raise
    protocol.unread = [out_r, err_r]
    return ChildProcess(
        pid=pid, create_time=0.0, started_mono=started, launch_id=launch_id, protocol=protocol
    )


# -- finding and killing what a launch left behind ------------------------------------------------


@dataclass(frozen=True)
class Leftover:
    pid: int
    create_time: float
    name: str
    cmdline: str


def _environ_has(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read()
    except OSError:
        return False


def _direct_children() -> set[int]:
    """This process's children, from its main thread's /proc children list (no /proc scan).

    The main thread's list holds them all: every process of ours is started from the loop's
    thread (the other threads only read files and call NVML), and the kernel hands an orphan
    to a subreaper's first live thread, the main one (kernel/exit.c, find_new_reaper)."""
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return {int(p) for p in f.read().split()}
    except OSError:
        return {-1}  # unknown: make the caller do the full scan


def nothing_left(pgid: int | None) -> bool:
    """Fast path: the launch's group is empty and we have no child that is not a helper.

    Only meaningful in a subreaper, where every orphan of the server becomes our child."""
    if pgid is not None:
        try:
            os.killpg(pgid, 0)
            return False
        except ProcessLookupError:
            pass
        except PermissionError:
            return False
    return not (_direct_children() - _OWNED)


def is_subreaper() -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        flag = ctypes.c_int(0)
        libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)
        return bool(flag.value)
    except (OSError, AttributeError):
        return False


def find_leftovers(token: str, pgid: int | None = None) -> list[Leftover]:
    """Live processes a launch left behind.

    A process belongs to the launch when it is in the launch's process group, when it is a
    descendant of this daemon that no other running child of ours accounts for (the daemon is
    a subreaper and runs one server at a time, so orphans of the server, even after ``setsid``
    and a double fork, reparent to it), or when it carries the launch id in its environment
    (the fallback where the daemon is not a subreaper; ``setproctitle`` can overwrite the
    environment, so it is not the primary rule).
    """
    marker = f"{TOKEN_ENV}={token}\0".encode() if token else None
    me = os.getpid()
    helpers: set[int] = set()
    for pid in _OWNED:  # other children of ours still running (not this launch's main)
        helpers.add(pid)
        with contextlib.suppress(psutil.Error):
            helpers.update(c.pid for c in psutil.Process(pid).children(recursive=True))
    mine: set[int] = set()
    with contextlib.suppress(psutil.Error):
        mine = {c.pid for c in psutil.Process(me).children(recursive=True)} - helpers
    found: list[Leftover] = []
    for pid in psutil.pids():
        if pid == me or pid in helpers:
            continue
        belongs = pid in mine
        if not belongs and pgid is not None:
            with contextlib.suppress(OSError):
                belongs = os.getpgid(pid) == pgid
        if not belongs and marker is not None:
            belongs = _environ_has(pid, marker)
        if not belongs:
            continue
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            found.append(
                Leftover(pid, proc.create_time(), proc.name(), " ".join(proc.cmdline())[:200])
            )
        except psutil.Error:
            continue
    return found


async def kill_leftovers(leftovers: list[Leftover], timeout_s: float = 5.0) -> list[Leftover]:
    """SIGKILL each leftover (pid and create time must still match); wait until they are gone."""
    killed = []
    for item in leftovers:
        if is_alive(item.pid, item.create_time):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(item.pid, signal.SIGKILL)
                killed.append(item)
    deadline = time.monotonic() + timeout_s
    while killed and time.monotonic() < deadline:
        reap_orphans()
        if not any(is_alive(k.pid, k.create_time) for k in killed):
            break
        # Death after SIGKILL is not an event we can await for a process that is not our child.
        await asyncio.sleep(0.005)
    reap_orphans()
    return killed


async def stop_foreign(pid: int, create_time: float | None, pgid: int, grace_s: float) -> None:
    """Stop a server group that is not our child (a previous life of the daemon left it):
    SIGTERM to its main process, up to `grace_s` for it to go, then SIGKILL to the group."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    # Not our child: its death is no event we can await.
    while time.monotonic() < deadline and is_alive(pid, create_time):  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
