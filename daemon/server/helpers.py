"""Helper processes: short-lived children that are not the server (the server's option
introspection, the benchmark's client), each run through `run_helper`.

A helper runs in a process group of its own and is marked owned for its life (asyncio's child
watcher reaps it, not the orphan reaper; the sweep counts neither it nor its children as a
launch's). However it ends (its exit, its timeout, a cancellation, an error), its whole group
is killed and its main process reaped before `run_helper` returns or raises: nothing of it
runs on unseen. Its exit is taken from the process (`process_exited`), never from pipe EOF; its
output is then drained with a bound, since one that left its group may hold the pipes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from . import reaper

OUTPUT_LIMIT = 8 << 20  # bytes kept of each captured stream; the rest is read and dropped
DRAIN_S = 1.0  # after the group is killed, how long its pipes may stay open


@dataclass(frozen=True)
class HelperResult:
    returncode: int  # -N for signal N (after a timeout: the SIGKILL's)
    stdout: str  # captured streams, decoded with replacement; empty when sent to a descriptor
    stderr: str
    timed_out: bool


class _Helper(asyncio.SubprocessProtocol):
    """A helper's captured output, its exit, and the end of it all (exit and pipes closed)."""

    def __init__(self, limit: int) -> None:
        loop = asyncio.get_running_loop()
        self.limit = limit
        self.output = {1: bytearray(), 2: bytearray()}
        self.transport: asyncio.SubprocessTransport | None = None
        self.exited: asyncio.Future[int] = loop.create_future()
        self.closed = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.SubprocessTransport)
        self.transport = transport

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        kept = self.output[fd]
        room = self.limit - len(kept)
        if room > 0:
            kept += data[:room]

    def process_exited(self) -> None:
        assert self.transport is not None
        code = self.transport.get_returncode()
        if not self.exited.done():
            self.exited.set_result(255 if code is None else code)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()


async def run_helper(
    argv: list[str],
    *,
    env: dict[str, str],
    timeout_s: float,
    cwd: str | os.PathLike[str] | None = None,
    output_fd: int | None = None,
    output_limit: int = OUTPUT_LIMIT,
) -> HelperResult:
    """Run `argv` (no shell, stdin /dev/null) in a new session for up to `timeout_s`.

    Its stdout and stderr are captured (the first `output_limit` bytes of each), or both
    written to `output_fd` (which the caller keeps and closes). Raises OSError when it cannot
    be started; a cancellation is raised once its group is killed and it is reaped."""
    loop = asyncio.get_running_loop()
    transport, helper = await loop.subprocess_exec(
        lambda: _Helper(output_limit),
        *argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if output_fd is None else output_fd,
        stderr=subprocess.PIPE if output_fd is None else subprocess.STDOUT,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    pid = transport.get_pid()
    with reaper.owned(pid):
        try:
            done, _ = await asyncio.wait([helper.exited], timeout=timeout_s)
        finally:
            await _through_cancellation(_end(pid, transport, helper))
    stdout, stderr = (helper.output[fd].decode(errors="replace") for fd in (1, 2))
    return HelperResult(helper.exited.result(), stdout, stderr, timed_out=not done)


async def _end(pid: int, transport: asyncio.SubprocessTransport, helper: _Helper) -> None:
    """Kill the helper's group (it may have exited, leaving children in it), reap it, and let
    its last output in, bounded."""
    # Its pid is not reused while it is a group's id, and an empty group answers ESRCH.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    try:
        await helper.exited
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(helper.closed.wait(), DRAIN_S)
    finally:
        transport.close()


async def _through_cancellation(step: Coroutine[Any, Any, None]) -> None:
    """Run `step` to its end even when the caller is cancelled meanwhile; then raise that
    cancellation."""
    task = asyncio.ensure_future(step)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError from task.exception()
    task.result()
