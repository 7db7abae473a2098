"""`live_restore: true`: the servers run under the shim (`daemon/server/shim.py`), which writes
their logs and outlives the daemon; the supervisor watches them through `ShimServer`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from gpuwarden.daemon.states import ServerState
from gpuwarden.daemon.supervisor import Supervisor

from .support.configs import standin_config
from .support.daemon import Daemon, start_daemon
from .support.procs import PY, Proc, alive, free_port, wait_until
from .support.shim import shims_ended
from .support.supervisor import running

pytestmark = pytest.mark.timeout(90)


def events(sup: Supervisor, kind: str) -> list[dict[str, Any]]:
    return sup.events.recent(1000, kind)


@contextlib.asynccontextmanager
async def live(
    tmp_path: Path, fake_gpu: Path, configs: dict[str, Any]
) -> AsyncIterator[Supervisor]:
    """A supervisor with `live_restore`; the shim it starts is ended after it."""
    shim_pid = 0
    try:
        async with running(tmp_path, fake_gpu, configs, settings={"live_restore": True}) as sup:
            await sup.wait_for(lambda s: bool(events(s, "shim_connected")), 20)
            shim_pid = events(sup, "shim_connected")[0]["pid"]
            yield sup
    finally:
        if shim_pid:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(shim_pid).children():
                    os.killpg(child.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(shim_pid, signal.SIGKILL)


async def test_the_server_runs_under_the_shim_and_is_supervised_as_ever(
    tmp_path: Path, fake_gpu: Path
) -> None:
    async with live(tmp_path, fake_gpu, {"k": standin_config()}) as sup:
        shim_pid = events(sup, "shim_connected")[0]["pid"]
        await sup.start("k")
        await sup.wait_for_state(ServerState.READY, timeout=30)
        launch = sup.machine.launch
        assert launch is not None and launch.child is not None
        first = launch.child.pid
        assert psutil.Process(first).ppid() == shim_pid  # the shim's child, not the daemon's
        log = Path(events(sup, "launch")[0]["log_file"])
        text = await asyncio.to_thread(log.read_text)
        assert text.startswith("# gpuwarden launch ") and "fired up and ready" in text
        os.kill(first, signal.SIGKILL)  # a crash: classified, swept, relaunched under the shim
        await sup.wait_for(lambda s: len(events(s, "exit")) >= 1, 30)
        exit_ = events(sup, "exit")[0]
        assert (exit_["reason"], exit_["signal"]) == ("signal", signal.SIGKILL)
        await sup.wait_for(lambda s: len(events(s, "launch")) >= 2, 30)
        await sup.wait_for_state(ServerState.READY, timeout=30)
        assert sup.machine.launch is not None and sup.machine.launch.child is not None
        second = sup.machine.launch.child.pid
        assert second != first and psutil.Process(second).ppid() == shim_pid
        closed = await asyncio.to_thread(log.read_text)
        assert closed.rstrip().splitlines()[-1].startswith("# exit: ")  # released, its trailer
        await sup.stop()
        await sup.wait_for_state(ServerState.STOPPED, timeout=30)
        assert not psutil.pid_exists(second) or psutil.Process(second).status() == "zombie"


# -- adoption: a later life of the daemon takes the server over --------------------------------


class Client(threading.Thread):
    """Requests to the server's own port, one after another, until stopped: what a user of the
    server sees through the daemon's outage."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/v1/models"
        self.ok = 0
        self.failed: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=10, trust_env=False) as http:
            while not self.halt.is_set():
                try:
                    http.get(self.url).raise_for_status()
                    self.ok += 1
                except httpx.HTTPError as exc:
                    self.failed.append(repr(exc))

    def end(self) -> tuple[int, list[str]]:
        self.halt.set()
        self.join(20)
        return self.ok, self.failed


def live_daemon(procs: list[Proc], root: Path, fake_gpu: Path, cfg: dict[str, Any]) -> Daemon:
    return start_daemon(procs, root, fake_gpu, {"k": cfg}, default="k", live_restore=True)


def test_a_daemon_killed_while_ready_is_adopted_same_pid_and_no_request_fails(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    port = free_port()
    cfg = standin_config(port=port)
    with shims_ended(tmp_path / "state"):
        first = live_daemon(procs, tmp_path, fake_gpu, cfg)
        first.wait_state("ready", timeout=60)
        pid = first.status()["pid"]
        client = Client(port)
        client.start()
        wait_until(lambda: client.ok >= 20, 20, "requests answered")
        first.proc.signal(signal.SIGKILL)
        first.proc.popen.wait(10)
        second = live_daemon(procs, tmp_path, fake_gpu, cfg)
        adopted = second.wait_event("server.adopted", timeout=20)
        assert adopted["pid"] == pid and adopted["launch_id"]
        status = second.status()
        assert (status["state"], status["pid"]) == ("ready", pid)
        assert second.wait_event("server.state", to="ready", reason="adopted")["from"] == "stopped"
        before = client.ok
        wait_until(lambda: client.ok >= before + 20, 20, "requests answered after")
        ok, failed = client.end()
        assert failed == [] and ok > 40
        # No signal reached it: the same process, serving, never restarted.
        assert psutil.Process(pid).is_running() and not second.status()["restarts"]
        second.http.post("/stop").raise_for_status()
        second.wait_state("stopped", timeout=30)
        assert not alive(pid)


def test_a_server_that_exits_while_the_daemon_is_down_has_its_code_on_record(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """The daemon is killed; the server then prints a last line and exits 3; the next life
    records code 3 and the time the shim saw it (not `ended_unobserved`), and the log holds
    every line."""
    script = str(Path(__file__).with_name("foreign_http.py"))
    cfg = {
        "command": [PY, script],
        "args": {"port": free_port(), "exit-on-usr1": 3},
        "health": {"startup_timeout_s": 30, "interval_s": 0.2, "timeout_s": 2, "failures": 3},
    }
    with shims_ended(tmp_path / "state"):
        first = live_daemon(procs, tmp_path, fake_gpu, cfg)
        first.wait_state("ready", timeout=60)
        status = first.status()
        pid, log = status["pid"], Path(status["log_file"])
        first.proc.signal(signal.SIGKILL)
        first.proc.popen.wait(10)
        os.kill(pid, signal.SIGUSR1)  # its last line, then exit 3, while nobody watches
        wait_until(lambda: not alive(pid), 10, "the server to end")
        ended = time.time()
        second = live_daemon(procs, tmp_path, fake_gpu, cfg)
        exit_ = second.wait_event("server.exit", timeout=20)
        assert (exit_["code"], exit_["reason"]) == (3, "crash"), exit_
        assert exit_["launch_id"] == status["launch_id"]
        record = second.status()["last_exit"]
        at = datetime.fromisoformat(record["at"].replace("Z", "+00:00")).timestamp()
        assert at <= ended + 0.01  # when it ended, not when this life saw it
        text = log.read_text()
        assert "last words, then exit 3" in text
        assert text.rstrip().splitlines()[-1].startswith("# exit")
        second.wait_state("ready", timeout=60)  # then relaunched, as after any crash
        second.http.post("/stop").raise_for_status()
        second.wait_state("stopped", timeout=30)


def test_a_pid_reused_by_another_process_is_unmanaged_and_never_killed(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """state.json names a server of this boot whose pid now belongs to another process (its
    create time and token are not the record's): listed as unmanaged, left running."""
    other = Proc([PY, "-c", "import time; print('up', flush=True); time.sleep(600)"])
    procs.append(other)
    other.wait_for("up", timeout=10)
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    record = {
        "schema": 2,
        "intent": {"config": "k", "running": False},
        "current_launch": {
            "launch_id": "20261206T000000-000001",
            "token": "a-token-it-does-not-carry",
            "config": "k",
            "pid": other.pid,
            "pgid": other.pid,
            "create_time": psutil.Process(other.pid).create_time() - 1000,
            "boot_id": boot_id,
        },
    }
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.json").write_text(json.dumps(record))
    with shims_ended(tmp_path / "state"):
        d = live_daemon(procs, tmp_path, fake_gpu, standin_config())
        found = d.wait_event("server.unmanaged_process", timeout=20)
        assert found["pid"] == other.pid and "pid reused" in found["why"]
        status = d.status()
        assert [u["pid"] for u in status["unmanaged"]] == [other.pid]
        assert status["unmanaged"][0]["name"]
        assert not [r for r in d.records() if r.get("event") == "server.previous_server_found"]
        assert f"unmanaged: pid {other.pid}" in d.http.get("/dump").text
        assert alive(other.pid)


def test_a_server_the_shim_runs_that_state_json_does_not_name_is_unmanaged(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """The daemon is killed and its state.json lost: the next life finds the shim running a
    server it cannot verify as its own, lists it and leaves it running."""
    cfg = standin_config()
    with shims_ended(tmp_path / "state"):
        first = live_daemon(procs, tmp_path, fake_gpu, cfg)
        first.wait_state("ready", timeout=60)
        pid = first.status()["pid"]
        first.proc.signal(signal.SIGKILL)
        first.proc.popen.wait(10)
        (tmp_path / "state" / "state.json").unlink()
        cfg["health"]["startup_timeout_s"] = 5  # (its own start finds the port taken)
        second = start_daemon(procs, tmp_path, fake_gpu, {"k": cfg}, live_restore=True)
        found = second.wait_event("server.unmanaged_process", timeout=20)
        assert found["pid"] == pid and "does not name" in found["why"]
        assert [u["pid"] for u in second.status()["unmanaged"]] == [pid]
        assert psutil.Process(pid).is_running()
