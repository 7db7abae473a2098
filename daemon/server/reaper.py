"""Processes that are not a server's handle: orphans, helpers, and what a launch left behind.

* Every launch carries ``GPUWARDEN_LAUNCH_ID`` in its environment (and a random token, for the
  sweep). Descendants inherit it, so whatever a launch left behind (even after ``setsid`` and
  a double fork) can be found by it.
* The daemon is a child subreaper: orphans of its servers reparent to it, and `reap_orphans`
  reaps them (only pids nobody else waits for: never ``waitpid(-1)``). Zombies count as dead.
* A pid someone waits for (a server's pidfd, asyncio's child watcher for a helper) is marked
  owned (`own`, `owned`): the reaper and the sweep leave it alone.
* A server that a previous life of the daemon left running is stopped here (`stop_foreign`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

LAUNCH_ENV = "GPUWARDEN_LAUNCH_ID"  # for people: the launch id
# For the sweep: a random token per launch. Launch ids are unique per daemon only, and two
# daemons on one host may start launches in the same second.
TOKEN_ENV = "GPUWARDEN_LAUNCH_TOKEN"
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37

# Pids whose exit someone waits for (a server's pidfd, asyncio's child watcher for a helper):
# the reaper must not take them.
_OWNED: set[int] = set()
# Held from a helper's spawn until it is owned, and while the sweep tells the launch's
# processes from ours: a helper just started (the shim) is never taken for a leftover.
_SPAWNING = threading.Lock()


def spawn_owned(path: str, argv: list[str], env: dict[str, str], **kw: Any) -> int:
    """`os.posix_spawn` a helper of ours, owned from its first instant (see `own`)."""
    with _SPAWNING:
        pid = os.posix_spawn(path, argv, env, **kw)
        own(pid)
    return pid


def own(pid: int) -> None:
    """`pid`'s exit is waited for by its owner (a server's handle): the reaper leaves it."""
    _OWNED.add(pid)


def disown(pid: int) -> None:
    """`pid` is reaped, or left to the orphan reaper."""
    _OWNED.discard(pid)


@contextlib.contextmanager
def owned(pid: int) -> Iterator[None]:
    """Mark a helper child as ours while it runs: the reaper and the sweep leave it alone."""
    own(pid)
    try:
        yield
    finally:
        disown(pid)


def helper_pids() -> frozenset[int]:
    """Children of ours whose exit someone waits for (a server's handle, a helper)."""
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


def is_subreaper() -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        flag = ctypes.c_int(0)
        libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)
        return bool(flag.value)
    except (OSError, AttributeError):
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


def name_of(pid: int) -> str | None:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return None


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
    mine: set[int] = set()
    with _SPAWNING:  # no helper is between its spawn and its owning
        for pid in list(_OWNED):  # other children of ours still running (not this launch's)
            helpers.add(pid)
            with contextlib.suppress(psutil.Error):
                helpers.update(c.pid for c in psutil.Process(pid).children(recursive=True))
        with contextlib.suppress(psutil.Error):
            mine = {c.pid for c in psutil.Process(me).children(recursive=True)} - helpers
    found: list[Leftover] = []
    for pid in psutil.pids():
        if pid == me or pid in _OWNED:
            continue
        # A process of the launch's group or with its token is the launch's, wherever it hangs
        # (a server whose shim was just killed is still the dying shim's child for a moment).
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
