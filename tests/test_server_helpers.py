"""`helpers.run_helper` with real processes: output, exit codes, and its group killed and reaped
however it ends (an exit, a timeout, a cancellation), a grandchild included."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.daemon.server import helpers, reaper

from .support.procs import PY, alive, group_members, wait_until

# Forks a grandchild that sleeps, in the helper's group or ("escape") in a session of its own;
# writes "MAIN GRANDCHILD" to the file named by argv[1] once the grandchild is set; then sleeps
# (argv[2] "sleep") or exits.
WITH_GRANDCHILD = """
import os, sys, time
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    if sys.argv[2] == "escape":
        os.setsid()
    os.write(w, b"x")
    time.sleep(600)
    os._exit(0)
os.read(r, 1)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
if sys.argv[2] == "sleep":
    time.sleep(600)
"""


def env() -> dict[str, str]:
    return dict(os.environ)


def pids_from(path: Path) -> tuple[int, int]:
    main, grandchild = path.read_text().split()
    return int(main), int(grandchild)


async def written(path: Path) -> None:
    """Until the helper has written `path` (no event announces a file: polled)."""
    while not path.exists():  # noqa: ASYNC110, ASYNC240
        await asyncio.sleep(0.01)


def assert_all_gone(main: int, grandchild: int) -> None:
    wait_until(lambda: not alive(grandchild), 10, "the grandchild to die")
    assert not group_members(main)
    assert main not in reaper.helper_pids()
    with pytest.raises(ChildProcessError):
        os.waitpid(main, os.WNOHANG)  # reaped: no zombie of ours is left


@contextlib.contextmanager
def killed_afterwards(path: Path) -> Iterator[None]:
    """Whatever the test's outcome, nothing it started runs on."""
    try:
        yield
    finally:
        if path.exists():
            for pid in pids_from(path):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


async def test_output_and_exit_codes_are_returned() -> None:
    code = "import sys; print('to out'); sys.stderr.write('to err'); sys.exit(3)"
    result = await helpers.run_helper([PY, "-c", code], env=env(), timeout_s=60)
    assert result == helpers.HelperResult(3, "to out\n", "to err", timed_out=False)
    result = await helpers.run_helper(
        [PY, "-c", "import os; os.kill(os.getpid(), 9)"], env=env(), timeout_s=60
    )
    assert (result.returncode, result.timed_out) == (-signal.SIGKILL, False)


async def test_output_past_the_limit_is_dropped_and_the_helper_runs_to_its_end() -> None:
    code = "import sys; sys.stdout.write('x' * 300_000); sys.stdout.flush(); print('done')"
    result = await helpers.run_helper([PY, "-c", code], env=env(), timeout_s=60, output_limit=1000)
    assert (result.returncode, result.stdout, result.timed_out) == (0, "x" * 1000, False)


async def test_both_streams_go_to_a_descriptor_in_the_working_directory_given(
    tmp_path: Path,
) -> None:
    code = "import os, sys; print(os.getcwd(), flush=True); sys.stderr.write('err\\n')"
    log = tmp_path / "helper.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        result = await helpers.run_helper(
            [PY, "-c", code], env=env(), timeout_s=60, cwd=tmp_path, output_fd=fd
        )
    finally:
        os.close(fd)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    assert log.read_text() == f"{tmp_path}\nerr\n"


async def test_a_command_that_cannot_start_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        await helpers.run_helper([str(tmp_path / "nothing-here")], env=env(), timeout_s=60)


async def test_a_timeout_kills_the_whole_group_a_grandchild_included(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    with killed_afterwards(pids):
        result = await helpers.run_helper(
            [PY, "-c", WITH_GRANDCHILD, str(pids), "sleep"], env=env(), timeout_s=5
        )
        assert result.timed_out
        assert result.returncode == -signal.SIGKILL
        assert_all_gone(*pids_from(pids))


async def test_a_cancellation_kills_the_whole_group_before_it_is_raised(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    with killed_afterwards(pids):
        run = asyncio.ensure_future(
            helpers.run_helper(
                [PY, "-c", WITH_GRANDCHILD, str(pids), "sleep"], env=env(), timeout_s=600
            )
        )
        await asyncio.wait_for(written(pids), 60)
        main, grandchild = pids_from(pids)
        assert main in reaper.helper_pids()  # the orphan reaper and the sweep leave it alone
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        assert_all_gone(main, grandchild)


async def test_a_grandchild_left_in_the_group_after_the_exit_is_killed(tmp_path: Path) -> None:
    # It also holds the pipes: the exit is not taken from their end.
    pids = tmp_path / "pids"
    with killed_afterwards(pids):
        result = await asyncio.wait_for(
            helpers.run_helper(
                [PY, "-c", WITH_GRANDCHILD, str(pids), "exit"], env=env(), timeout_s=600
            ),
            60,
        )
        assert (result.returncode, result.timed_out) == (0, False)
        assert_all_gone(*pids_from(pids))


async def test_a_grandchild_that_left_the_group_holding_the_pipes_delays_it_boundedly(
    tmp_path: Path,
) -> None:
    pids = tmp_path / "pids"
    with killed_afterwards(pids):
        result = await asyncio.wait_for(
            helpers.run_helper(
                [PY, "-c", WITH_GRANDCHILD, str(pids), "escape"], env=env(), timeout_s=600
            ),
            60,
        )
        assert (result.returncode, result.timed_out) == (0, False)
        main, escaped = pids_from(pids)
        assert alive(escaped)  # out of the group's reach: the sweep's to find
        assert main not in reaper.helper_pids()
