"""The host's launching part with real children: the exec, the log, the first output parsed,
the outcome posted (`Spawned`, `SpawnFailed`), the signals and the launch let go of."""

from __future__ import annotations

import signal
from pathlib import Path, PurePath

from gpuwarden.daemon.clock import SystemClock
from gpuwarden.daemon.launching import Launching
from gpuwarden.daemon.messages import (
    LineParsed,
    Message,
    ServerExited,
    Spawned,
    SpawnFailed,
)
from gpuwarden.daemon.model import Launch
from gpuwarden.daemon.sglanglines import READY_LINE

from .support.host import launch_of, posted, tasks_posting
from .support.procs import PY, Proc, alive

# Says it is ready (SGLang's line), then waits to be ended.
SERVES = f"import time; print({READY_LINE!r}, flush=True); time.sleep(600)"


def read(path: PurePath) -> str:
    return Path(path).read_text()


def launching(log_dir: Path, messages: list[Message], flushed: list[bool]) -> Launching:
    return Launching(
        log_dir=log_dir,
        log_max_bytes=1 << 20,
        clock=SystemClock(),
        tasks=tasks_posting(messages),
        post=messages.append,
        after_exec=lambda: flushed.append(True),
    )


async def started(part: Launching, launch: Launch, messages: list[Message]) -> Spawned:
    """Spawn `launch` and hand its server and log to it, as the machine does at `Spawned`."""
    part.spawn(launch)
    spawned = await posted(messages, Spawned, gen=launch.gen)
    launch.child, launch.log = spawned.server, spawned.log
    return spawned


async def test_a_spawn_posts_spawned_with_a_running_server_then_its_ready_line_and_exit(
    procs: list[Proc], tmp_path: Path
) -> None:
    messages: list[Message] = []
    flushed: list[bool] = []
    part = launching(tmp_path / "logs", messages, flushed)
    seen: list[str] = []
    part.line_listeners.add(seen.extend)
    launch = launch_of(tmp_path, [PY, "-c", SERVES])
    spawned = await started(part, launch, messages)
    assert alive(spawned.server.pid)
    assert flushed == [True]  # the records held for the exec go out once it runs
    ready = await posted(messages, LineParsed, gen=launch.gen)
    assert ready.parsed.ready and READY_LINE in ready.line
    assert any(READY_LINE in line for line in seen)
    # The machine hears of the process before anything it printed.
    assert messages.index(spawned) < messages.index(ready)
    part.terminate(launch)
    exited = await posted(messages, ServerExited, gen=launch.gen)
    assert exited.returncode == -signal.SIGTERM
    part.close_launch(launch, "exit: test")
    text = read(tmp_path / "logs" / launch.config.name / f"{launch.launch_id}.log")
    assert f"gpuwarden launch {launch.launch_id}" in text
    assert READY_LINE in text
    assert "exit: test" in text


async def test_a_program_that_cannot_execute_posts_exec_failed(tmp_path: Path) -> None:
    messages: list[Message] = []
    part = launching(tmp_path / "logs", messages, [])
    launch = launch_of(tmp_path, [str(tmp_path / "no-such-program")])
    part.spawn(launch)
    failed = await posted(messages, SpawnFailed, gen=launch.gen)
    assert failed.reason == "exec_failed"
    assert "cannot execute" in failed.detail and "No such file or directory" in failed.detail
    assert not any(isinstance(m, Spawned) for m in messages)


async def test_a_log_dir_that_cannot_be_created_posts_log_unwritable_and_ends_the_server(
    procs: list[Proc], tmp_path: Path
) -> None:
    (tmp_path / "notadir").write_text("a regular file")
    messages: list[Message] = []
    flushed: list[bool] = []
    part = launching(tmp_path / "notadir" / "logs", messages, flushed)
    launch = launch_of(tmp_path, [PY, "-c", SERVES])
    part.spawn(launch)
    failed = await posted(messages, SpawnFailed, gen=launch.gen)
    assert failed.reason == "log_unwritable"
    assert "cannot create the log" in failed.detail
    assert not flushed  # no server runs: nothing held for it is let out on its account
    # Its server was killed at its exec (SIGKILL to its group) and let go of: the `procs`
    # guard fails the test if it, or anything it started, still runs.


async def test_abandon_ends_a_server_nobody_wants_and_closes_its_log(
    procs: list[Proc], tmp_path: Path
) -> None:
    messages: list[Message] = []
    part = launching(tmp_path / "logs", messages, [])
    launch = launch_of(tmp_path, [PY, "-c", SERVES])
    spawned = await started(part, launch, messages)
    part.abandon(spawned.server, spawned.log)
    exited = await posted(messages, ServerExited, gen=launch.gen)
    assert exited.returncode == -signal.SIGKILL
    assert "abandoned" in read(spawned.log.path)
