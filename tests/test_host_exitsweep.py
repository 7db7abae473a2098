"""The host's sweep after an exit, with real processes: what a server left behind is killed
and reported, and so are GPU holders of ours (by the pid and create time the machine knows),
never a foreign one."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import psutil

from gpuwarden.daemon.exitsweep import ExitSweep
from gpuwarden.daemon.gpu import FakeGpuBackend
from gpuwarden.daemon.gpuwatch import GpuWatch, SampleTarget
from gpuwarden.daemon.messages import Message, OrphansKilled, ServerExited, SweepFinished
from gpuwarden.daemon.model import Launch
from gpuwarden.daemon.server import local
from gpuwarden.daemon.settings import GpuSettings
from gpuwarden.standin import fakegpu

from .support.host import launch_of, posted, tasks_posting
from .support.procs import ORPHAN, PY, Proc, alive, orphans

# Leaves a grandchild behind in its group (its output elsewhere), says its pid, and exits.
LEAVES_ONE = """
import os, sys, time
pid = os.fork()
if pid == 0:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    time.sleep(600)
    os._exit(0)
print(pid, flush=True)
"""


def start_detached(pids: list[int]) -> int:
    done = subprocess.run(
        [PY, "-c", ORPHAN, "setsid"], check=True, capture_output=True, text=True, timeout=60
    )
    pid = int(done.stdout)
    pids.append(pid)
    return pid


def sweeper(fake_gpu: Path, messages: list[Message]) -> ExitSweep:
    tasks = tasks_posting(messages)
    gpus = GpuWatch(
        settings=GpuSettings(backend="fake"),
        gpu=FakeGpuBackend(fake_gpu),
        tasks=tasks,
        post=messages.append,
        sample_target=lambda: SampleTarget(0, None, False, False, False),
        sweep_deadline_s=30,
    )
    return ExitSweep(gpus=gpus, tasks=tasks, post=messages.append, deadline_s=30)


async def exited(launch: Launch, messages: list[Message]) -> list[str]:
    """Run the launch's server to its end; what it printed, split into words."""
    lines: list[bytes] = []
    child = local.start(launch.config.argv, dict(os.environ), launch.launch_id, token=launch.token)
    launch.child = child
    child.on_exit(lambda returncode: messages.append(ServerExited(launch.gen, returncode)))
    await child.read_output(lambda data, fd: lines.append(data) if fd == 1 else None)
    await posted(messages, ServerExited, gen=launch.gen)
    launch.exited = True
    await child.wait_output_closed(5)  # the grandchild's output is not the server's pipe
    return b"".join(lines).decode().split()


async def test_the_sweep_kills_a_grandchild_left_behind_and_reports_it(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    messages: list[Message] = []
    launch = launch_of(tmp_path, [PY, "-c", LEAVES_ONE])
    [pid] = await exited(launch, messages)
    left = int(pid)
    assert alive(left)
    sweeper(fake_gpu, messages).sweep(launch, {}, False)
    swept = await posted(messages, SweepFinished, gen=launch.gen)
    assert [k["pid"] for k in swept.killed] == [left]
    assert swept.killed[0]["cmdline"].startswith(f"{PY} -c")
    assert not alive(left)
    assert launch.child is not None
    launch.child.close()


async def test_the_sweep_kills_gpu_holders_the_machine_knows_as_ours_and_no_other(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    messages: list[Message] = []
    with orphans() as pids:
        ours, foreign = start_detached(pids), start_detached(pids)
        fakegpu.write_holder(fake_gpu, 0, 30000, pid=ours)
        fakegpu.write_holder(fake_gpu, 1, 30000, pid=foreign)
        known = {(ours, psutil.Process(ours).create_time()): "an-earlier-launch"}
        launch = launch_of(tmp_path, [PY, "-c", "pass"])
        await exited(launch, messages)
        sweeper(fake_gpu, messages).sweep(launch, known, False)
        swept = await posted(messages, SweepFinished, gen=launch.gen)
        assert [(k["pid"], k["gpu"], k["launch_id"]) for k in swept.killed] == [
            (ours, 0, "an-earlier-launch")
        ]
        assert (await posted(messages, OrphansKilled)).killed == swept.killed
        assert not alive(ours)
        assert alive(foreign)  # never ours: never killed
        assert launch.child is not None
        launch.child.close()


async def test_holders_are_nobodys_where_the_gpus_pids_are_unresolved(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """NVML reporting another pid namespace: a pid there names no process of ours."""
    messages: list[Message] = []
    with orphans() as pids:
        holder = start_detached(pids)
        fakegpu.write_holder(fake_gpu, 0, 30000, pid=holder)
        known = {(holder, psutil.Process(holder).create_time()): "an-earlier-launch"}
        launch = launch_of(tmp_path, [PY, "-c", "pass"])
        await exited(launch, messages)
        sweeper(fake_gpu, messages).sweep(launch, known, True)
        swept = await posted(messages, SweepFinished, gen=launch.gen)
        assert swept.killed == []
        assert alive(holder)
        assert launch.child is not None
        launch.child.close()
