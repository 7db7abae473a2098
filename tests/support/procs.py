"""Real child processes for tests: `Proc` (a child in its own session, its output read line by
line), free ports, `wait_until` for conditions no event announces, and `owned_processes`, the
guard that no process group or launched server started by a test outlives it."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import psutil
import pytest

PY = sys.executable


def require_tool(name: str) -> str:
    """The path of a system tool a test needs. Where it is missing the test is skipped, saying
    why; in CI (`CI=true`, set by .ci/run, which installs the tools) that is a failure."""
    path = shutil.which(name)
    if path is None:
        why = f"{name} is not installed (.ci/run installs it from Debian)"
        if os.environ.get("CI") == "true":
            pytest.fail(why + "; CI requires it")
        pytest.skip(why)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    """True while `pid` runs; zombies (nobody reaps them here: PID 1 does not) count as dead."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    members = []
    for proc in psutil.process_iter(["pid", "status"]):
        # A process may end between the listing and getpgid (ProcessLookupError).
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
    return members


def wait_until(
    predicate: Callable[[], bool], timeout: float, what: str, step: float = 0.01
) -> None:
    """Poll a condition that no event announces (a process disappearing, a file changing)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


class Proc:
    """A child in its own session; stdout and stderr read by threads into one list of lines."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=env,
        )
        self.pid = self.popen.pid
        self.lines: list[tuple[str, str]] = []  # (stream, line)
        self.raw: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self._cond = threading.Condition()
        self._open = 2
        for name, stream in (("stdout", self.popen.stdout), ("stderr", self.popen.stderr)):
            threading.Thread(target=self._read, args=(name, stream), daemon=True).start()

    def _read(self, name: str, stream: object) -> None:
        buf = b""
        fd = stream.fileno()  # type: ignore[attr-defined]
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            self.raw[name].extend(chunk)
            buf += chunk
            *complete, buf = buf.split(b"\n")
            if complete:
                with self._cond:
                    self.lines.extend((name, c.decode(errors="replace")) for c in complete)
                    self._cond.notify_all()
        with self._cond:
            if buf:
                self.lines.append((name, buf.decode(errors="replace")))
            self._open -= 1
            self._cond.notify_all()

    def text(self, stream: str | None = None) -> str:
        with self._cond:
            return "\n".join(line for s, line in self.lines if stream in (None, s))

    def wait_for(self, pattern: str, timeout: float = 20.0, start: int = 0) -> re.Match[str]:
        """Block until a line matches `pattern` (searched from line `start`)."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            i = start
            while True:
                while i < len(self.lines):
                    m = rx.search(self.lines[i][1])
                    if m:
                        self.matched_at = i
                        return m
                    i += 1
                if self._open == 0:
                    raise AssertionError(
                        f"{pattern!r} never appeared; output ended (rc={self.popen.poll()}):\n"
                        + self._tail()
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"{pattern!r} not seen within {timeout} s:\n" + self._tail()
                    )
                self._cond.wait(left)

    def _tail(self, n: int = 40) -> str:
        return "\n".join(line[:300] for _, line in self.lines[-n:])

    def index_of(self, pattern: str) -> int:
        rx = re.compile(pattern)
        with self._cond:
            for i, (_, line) in enumerate(self.lines):
                if rx.search(line):
                    return i
        return -1

    def wait(self, timeout: float = 20.0) -> int:
        return self.popen.wait(timeout)

    def wait_output_closed(self, timeout: float = 10.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._open == 0, timeout):
                raise AssertionError("output pipes still open")

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)


TEST_MARK = "GPUWARDEN_TEST_MARK"


def launched_since(t0: float, mark: str) -> list[int]:
    """Live servers a daemon of this test launched: they carry a launch id and this test's mark
    (inherited through the daemon), so other test runs on the same host are left alone."""
    found = []
    needle = f"{TEST_MARK}={mark}\0".encode()
    for pid in psutil.pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
                if b"GPUWARDEN_LAUNCH_ID=" not in environ or needle not in environ:
                    continue
            proc = psutil.Process(pid)
            if proc.create_time() >= t0 and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(pid)
        except (OSError, psutil.Error):
            continue
    return found


@contextlib.contextmanager
def owned_processes() -> Iterator[list[Proc]]:
    """The body of `procs`, for fixtures of a wider scope (a server shared by a module)."""
    t0 = time.time() - 1
    mark = uuid.uuid4().hex
    os.environ[TEST_MARK] = mark  # children inherit it, and the servers of their daemons too
    started: list[Proc] = []
    try:
        yield started
    finally:
        os.environ.pop(TEST_MARK, None)
    leftovers: dict[int, list[int]] = {}
    for proc in started:
        if proc.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(20)
        if proc.popen.poll() is None:
            proc.kill_group()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(5)
        # Parent-death kills take a moment to land after the parent is reaped.
        with contextlib.suppress(AssertionError):
            wait_until(lambda p=proc: not group_members(p.pid), 5, "the group to empty")
        members = group_members(proc.pid)
        if members:
            leftovers[proc.pid] = members
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    servers = launched_since(t0, mark)
    for pid in servers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
    assert not leftovers, f"process groups outlived the test: {leftovers}"
    assert not servers, f"servers outlived the test: {servers}"


# Forks an orphan that sleeps (in this process's group, or with argv[1] "setsid" in a session
# of its own), prints its pid and exits: the orphan is no descendant of the test's.
ORPHAN = """
import os, sys, time
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    if sys.argv[1] == "setsid":
        os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.write(w, b"x")
    time.sleep(600)
    os._exit(0)
os.read(r, 1)
print(pid)
"""


@contextlib.contextmanager
def orphans() -> Iterator[list[int]]:
    """Pids of orphans a test starts, killed afterwards whatever the outcome."""
    pids: list[int] = []
    try:
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
