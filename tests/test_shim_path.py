"""The shim runs every launch; `live_restore: false` (the default) decides only what the
daemon's exit does: its SIGTERM stops the server and ends the shim, and its next life stops a
server the previous one left running instead of adopting it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest

from .support.configs import standin_config
from .support.daemon import start_daemon
from .support.procs import Proc, alive, wait_until

pytestmark = pytest.mark.timeout(90)


def test_without_live_restore_the_server_runs_under_the_shim_and_a_sigterm_ends_both(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, {"k": standin_config()}, default="k")
    shim = d.wait_event("server.shim_connected")["pid"]
    d.wait_state("ready", timeout=60)
    pid = d.status()["pid"]
    assert psutil.Process(pid).ppid() == shim  # the shim's child, not the daemon's
    log = Path(d.status()["log_file"])
    assert log.read_text().startswith("# gpuwarden launch ")  # the shim wrote it
    d.proc.signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0
    assert log.read_text().rstrip().splitlines()[-1].startswith("# exit")  # released
    assert not alive(pid)  # stopped before the daemon ended, as by `gpuwarden stop`
    wait_until(lambda: not alive(shim), 10, "the shim to end with the daemon")


def test_without_live_restore_a_killed_daemons_server_is_stopped_by_the_next_not_adopted(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    cfg = standin_config()
    first = start_daemon(procs, tmp_path, fake_gpu, {"k": cfg}, default="k")
    shim = first.wait_event("server.shim_connected")["pid"]
    first.wait_state("ready", timeout=60)
    old = first.status()["pid"]
    first.proc.signal(signal.SIGKILL)
    first.proc.wait(10)
    assert alive(old) and alive(shim)  # both run on while no daemon is there
    second = start_daemon(procs, tmp_path, fake_gpu, {"k": cfg}, default="k")
    stopped = second.wait_event("server.previous_server_stopped", timeout=30)
    assert stopped["pid"] == old and not alive(old)
    again = second.wait_event("server.shim_connected")
    assert (again["pid"], again.get("started")) == (shim, False)  # the same shim, found
    second.wait_state("ready", timeout=60)
    new = second.status()["pid"]
    assert new != old and psutil.Process(new).ppid() == shim
    assert not second.status()["restarts"]  # a new life's start, not a restart


def test_without_live_restore_a_server_that_ended_while_no_daemon_ran_has_the_shims_record(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    cfg = standin_config()
    first = start_daemon(procs, tmp_path, fake_gpu, {"k": cfg}, default="k")
    first.wait_state("ready", timeout=60)
    old, launch = first.status()["pid"], first.status()["launch_id"]
    first.proc.signal(signal.SIGKILL)
    first.proc.wait(10)
    os.killpg(old, signal.SIGKILL)  # while no daemon runs: the shim sees it
    wait_until(lambda: not alive(old), 10, "the server to end")
    second = start_daemon(procs, tmp_path, fake_gpu, {"k": cfg}, default="k")
    ex = second.wait_event("server.exit", launch_id=launch, timeout=30)
    assert (ex["reason"], ex["signal"]) == ("signal", signal.SIGKILL), ex  # not ended_unobserved
    second.wait_state("ready", timeout=60)  # then started again, as after any crash
