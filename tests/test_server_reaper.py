"""`reaper` with real processes: which are alive, what a launch left behind (by its group, its
token, as our descendants), their killing, and a previous life's server stopped."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import psutil

from gpuwarden.daemon.server import reaper

from .support.procs import ORPHAN, PY, Proc, alive, orphans, wait_until

SLEEP = [PY, "-c", "import time; time.sleep(600)"]


def orphan(how: str, env: dict[str, str]) -> tuple[int, int]:
    """(the orphan's pid, its process group's id)."""
    done = subprocess.run(
        [PY, "-c", ORPHAN, how],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        start_new_session=True,
    )
    pid = int(done.stdout)
    return pid, os.getpgid(pid)


def test_alive_means_running_not_a_zombie_and_the_same_process(procs: list[Proc]) -> None:
    proc = Proc(SLEEP)
    procs.append(proc)
    created = reaper.create_time_of(proc.pid)
    assert created is not None
    assert reaper.is_alive(proc.pid)
    assert reaper.is_alive(proc.pid, created)
    assert not reaper.is_alive(proc.pid, created - 10)  # another process, same pid
    os.kill(proc.pid, signal.SIGKILL)
    wait_until(lambda: not reaper.is_alive(proc.pid), 10, "the zombie to count as dead")
    assert reaper.create_time_of(proc.pid) is not None  # a zombie, not yet reaped
    proc.wait()
    assert reaper.create_time_of(proc.pid) is None
    assert not reaper.is_alive(proc.pid, created)


async def test_leftovers_are_found_by_group_token_and_descent_then_killed(
    procs: list[Proc],
) -> None:
    with orphans() as started:
        token_env = {**os.environ, reaper.TOKEN_ENV: "tok-1"}
        by_token, _ = orphan("setsid", token_env)
        started.append(by_token)
        in_group, group = orphan("stay", dict(os.environ))
        started.append(in_group)
        ours = Proc(SLEEP)  # our own child: a descendant no helper accounts for
        procs.append(ours)
        helper = Proc(SLEEP)
        procs.append(helper)
        # Orphans reparent to PID 1 (the test is no subreaper): only their marks find them.
        assert all(psutil.Process(pid).ppid() != os.getpid() for pid in (by_token, in_group))
        with reaper.owned(helper.pid):
            found = {x.pid for x in reaper.find_leftovers("tok-1")}
            assert {by_token, ours.pid} <= found
            assert in_group not in found and helper.pid not in found
            found = {x.pid for x in reaper.find_leftovers("tok-2", group)}
            assert {in_group, ours.pid} <= found
            assert by_token not in found and helper.pid not in found
            leftovers = reaper.find_leftovers("tok-1", group)
        mine = [x for x in leftovers if x.pid in (by_token, in_group, ours.pid)]
        assert {x.pid for x in mine} == {by_token, in_group, ours.pid}
        killed = await reaper.kill_leftovers(mine)
        assert {x.pid for x in killed} == {by_token, in_group, ours.pid}
        for pid in (by_token, in_group, ours.pid):
            assert not alive(pid)
        assert alive(helper.pid)
        # Gone: nothing left to kill.
        assert await reaper.kill_leftovers(mine) == []


async def test_a_leftover_whose_pid_was_reused_is_not_killed(procs: list[Proc]) -> None:
    proc = Proc(SLEEP)
    procs.append(proc)
    created = reaper.create_time_of(proc.pid)
    assert created is not None
    other = reaper.Leftover(proc.pid, created - 10, "python", "")
    assert await reaper.kill_leftovers([other]) == []
    assert alive(proc.pid)


async def test_stop_foreign_ends_at_the_servers_exit_within_the_grace() -> None:
    with orphans() as started:
        main, group = orphan("stay", dict(os.environ))  # no handler: SIGTERM ends it
        started.append(main)
        # Bounded well below the grace: it returns at the exit, not at the grace's end.
        await asyncio.wait_for(
            reaper.stop_foreign(main, reaper.create_time_of(main), group, grace_s=600), 60
        )
        wait_until(lambda: not alive(main), 10, "the server to go")


async def test_stop_foreign_kills_a_server_that_ignores_sigterm_and_its_group(
    procs: list[Proc],
) -> None:
    stubborn = (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    server = Proc([PY, "-c", stubborn])
    procs.append(server)
    scheduler = int(server.wait_for(r"^\d+$", 60).group(0))
    await reaper.stop_foreign(server.pid, reaper.create_time_of(server.pid), server.pid, 0.2)
    assert server.wait(30) == -signal.SIGKILL
    wait_until(lambda: not alive(scheduler), 10, "the rest of its group to go")


async def test_stop_foreign_of_a_server_already_gone_does_nothing(procs: list[Proc]) -> None:
    proc = Proc([PY, "-c", "pass"])
    procs.append(proc)
    created = reaper.create_time_of(proc.pid)
    assert proc.wait(30) == 0
    await reaper.stop_foreign(proc.pid, created, proc.pid, grace_s=60)


def test_nothing_left_is_false_while_the_group_or_a_child_not_a_helper_lives(
    procs: list[Proc],
) -> None:
    child = Proc(SLEEP)
    procs.append(child)
    assert not reaper.nothing_left(child.pid)  # its group is alive
    ended = Proc([PY, "-c", "pass"])
    procs.append(ended)
    assert ended.wait(30) == 0
    assert not reaper.nothing_left(ended.pid)  # its group is gone, `child` is not a helper
