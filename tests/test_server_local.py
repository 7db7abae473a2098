"""The server's process as `local.start` makes it: what it inherits, how its exit is read."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.daemon.server import local, reaper

from .support.procs import PY

# Prints what the server was given: its descriptors, its session, its stdin, two variables.
INTROSPECT = """
import json, os, sys
fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
print(json.dumps({
    "fds": fds,
    "leader": os.getsid(0) == os.getpid(),
    "stdin": os.readlink("/proc/self/fd/0"),
    "launch": os.environ.get("GPUWARDEN_LAUNCH_ID"),
    "extra": os.environ.get("GW_EXTRA"),
}), flush=True)
"""


async def run(argv: list[str], env: dict[str, str]) -> tuple[int | None, bytes, bytes]:
    """Start `argv`, read all of its output; its exit code, stdout and stderr."""
    out: dict[int, bytes] = {1: b"", 2: b""}

    def on_output(data: bytes, fd: int) -> None:
        out[fd] += data

    child = local.start(argv, env, "L-1", token="tok")
    try:
        await child.read_output(on_output)
        code = await asyncio.wait_for(asyncio.shield(child.exited), 30)
        assert await child.wait_output_closed(30)
    finally:
        child.close()
    return code, out[1], out[2]


async def test_the_server_inherits_stdio_alone_in_a_session_of_its_own() -> None:
    # An inheritable descriptor of the daemon's (a C library's, like NVML's device files).
    leaked = os.open(os.devnull, os.O_RDONLY)
    os.set_inheritable(leaked, True)
    try:
        env = {**os.environ, "GW_EXTRA": "yes"}
        code, out, _ = await run([PY, "-c", INTROSPECT], env)
    finally:
        os.close(leaked)
    seen = json.loads(out)
    assert code == 0
    # 0-2, and the descriptor its own listdir held open; never the daemon's.
    assert seen["fds"] == [0, 1, 2, 3], seen["fds"]
    assert seen["leader"] is True
    assert seen["stdin"] == os.devnull
    assert (seen["launch"], seen["extra"]) == ("L-1", "yes")


async def test_a_bare_command_is_found_in_the_servers_path_not_the_daemons(
    tmp_path: Path,
) -> None:
    tool = tmp_path / "bin" / "gw-only-here"
    tool.parent.mkdir()
    tool.write_text('#!/bin/sh\necho found "$@"\n')
    tool.chmod(0o755)
    assert str(tool.parent) not in os.environ.get("PATH", "")
    env = {**os.environ, "PATH": f"{tool.parent}:/usr/bin:/bin"}
    code, out, _ = await run(["gw-only-here", "x"], env)
    assert (code, out) == (0, b"found x\n")
    with pytest.raises(FileNotFoundError) as err:
        local.start(["gw-only-here"], dict(os.environ), "L-2")
    assert err.value.strerror == "No such file or directory"


async def test_a_command_on_path_without_the_right_to_run_it_is_permission_denied(
    tmp_path: Path,
) -> None:
    (tmp_path / "gw-not-runnable").write_text("#!/bin/sh\n")  # no x bit
    env = {**os.environ, "PATH": str(tmp_path)}
    with pytest.raises(PermissionError) as err:
        local.start(["gw-not-runnable"], env, "L-6")
    assert err.value.strerror == "Permission denied"


async def test_signals_the_daemon_ignores_are_the_default_again_in_the_server() -> None:
    # Python ignores SIGPIPE; the daemon ignores SIGXFSZ too (serve.py). The server's tools
    # must die of them as usual: `producer | head` ends quietly.
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN
        code, out, _ = await run(["/bin/sh", "-c", "grep SigIgn /proc/self/status"], {})
    finally:
        signal.signal(signal.SIGXFSZ, previous)
    ignored = int(out.split()[1], 16)
    assert code == 0
    assert not ignored & (1 << (signal.SIGPIPE - 1)), out
    assert not ignored & (1 << (signal.SIGXFSZ - 1)), out


async def test_exit_codes_and_signals_are_read_from_the_process() -> None:
    code, _, err = await run([PY, "-c", "import sys; sys.stderr.write('bye'); sys.exit(3)"], {})
    assert (code, err) == (3, b"bye")
    code, _, _ = await run([PY, "-c", "import os; os.kill(os.getpid(), 9)"], {})
    assert code == -signal.SIGKILL


async def test_a_child_closed_while_it_runs_is_killed_and_reaped() -> None:
    child = local.start([PY, "-c", "import time; time.sleep(60)"], {}, "L-3")
    await child.read_output(lambda data, fd: None)
    assert child.pid in reaper.helper_pids()  # the reaper leaves it to its pidfd
    child.close()
    assert await asyncio.wait_for(asyncio.shield(child.exited), 30) == -signal.SIGKILL
    assert child.pid not in reaper.helper_pids()
    with pytest.raises(ChildProcessError):
        os.waitpid(child.pid, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG; reaped: no zombie


async def test_a_child_never_read_leaves_no_descriptor_open() -> None:
    before = set(os.listdir("/proc/self/fd"))
    child = local.start([PY, "-c", "pass"], {}, "L-4")
    await asyncio.wait_for(asyncio.shield(child.exited), 30)
    child.close()
    assert set(os.listdir("/proc/self/fd")) <= before


async def test_a_child_whose_exit_cannot_be_watched_is_killed_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_watch(self: object, pid: int) -> None:
        raise RuntimeError("can't start new thread")

    spawned: list[int] = []
    real_spawn = os.posix_spawn

    def spawn(*args: Any, **kwargs: Any) -> int:
        spawned.append(real_spawn(*args, **kwargs))
        return spawned[-1]

    monkeypatch.setattr(local._Protocol, "watch_exit", no_watch)
    monkeypatch.setattr(os, "posix_spawn", spawn)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(RuntimeError):
        local.start([PY, "-c", "import time; time.sleep(60)"], {}, "L-5")
    assert set(os.listdir("/proc/self/fd")) <= before
    assert spawned[0] not in reaper.helper_pids()  # left to the orphan reaper
    _, status = await asyncio.to_thread(os.waitpid, spawned[0], 0)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL


async def test_wait_started_returns_at_the_first_output_or_the_exit() -> None:
    # Bounded far below its timeout: it returns at the event, not at the timeout's end.
    talker = local.start(
        [PY, "-c", "print('up', flush=True); import time; time.sleep(60)"], {}, "L-7"
    )
    silent = local.start([PY, "-c", "pass"], {}, "L-8")
    try:
        for child in (talker, silent):
            await child.read_output(lambda data, fd: None)
            await asyncio.wait_for(child.wait_started(600), 30)
        assert talker.protocol.first_output.done() and not talker.exited.done()
        assert silent.exited.done()
    finally:
        talker.close()
        silent.close()
    assert await asyncio.wait_for(asyncio.shield(talker.exited), 30) == -signal.SIGKILL
