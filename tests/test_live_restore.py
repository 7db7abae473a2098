"""`live_restore: true`: the servers run under the shim (`daemon/server/shim.py`), which writes
their logs and outlives the daemon; the supervisor watches them through `ShimServer`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from gpuwarden.daemon.server import shim as shim_module
from gpuwarden.daemon.server import shimwire
from gpuwarden.daemon.states import ServerState
from gpuwarden.daemon.supervisor import Supervisor

from .support.configs import standin_config, write_setup
from .support.daemon import Daemon, gpuwarden, serve, start_daemon
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
    """A supervisor with `live_restore`; the shims it starts are ended after it."""
    with shims_ended(tmp_path / "state"):
        async with running(tmp_path, fake_gpu, configs, settings={"live_restore": True}) as sup:
            await sup.wait_for(lambda s: bool(events(s, "shim_connected")), 20)
            yield sup


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


async def test_a_lost_shim_is_said_its_server_ended_and_relaunched_under_a_new_one(
    tmp_path: Path, fake_gpu: Path
) -> None:
    """The shim SIGKILLed: its server's output and exit had no other way to the daemon, so the
    server is ended (its group killed by the exit sweep, never left running unseen), the
    exit says why, and the next launch runs under a shim started again at once."""
    async with live(tmp_path, fake_gpu, {"k": standin_config()}) as sup:
        shim_pid = events(sup, "shim_connected")[0]["pid"]
        await sup.start("k")
        await sup.wait_for_state(ServerState.READY, timeout=30)
        assert sup.machine.launch is not None and sup.machine.launch.child is not None
        first = sup.machine.launch.child.pid
        os.kill(shim_pid, signal.SIGKILL)
        await sup.wait_for(lambda s: bool(events(s, "exit")), 30)
        lost, exit_ = events(sup, "shim_lost")[0], events(sup, "exit")[0]
        assert "connection ended" in lost["error"]
        assert exit_["reason"] == "internal_error" and "shim" in exit_["evidence"]
        assert not alive(first)  # swept: nothing of it runs on unsupervised
        await sup.wait_for(lambda s: len(events(s, "shim_connected")) == 2, 30)
        again = events(sup, "shim_connected")[1]
        assert again["again"] is True and again["pid"] != shim_pid
        await sup.wait_for(lambda s: len(events(s, "launch")) >= 2, 30)
        await sup.wait_for_state(ServerState.READY, timeout=30)
        assert sup.machine.launch is not None and sup.machine.launch.child is not None
        second = sup.machine.launch.child.pid
        assert psutil.Process(second).ppid() == again["pid"]


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


def saved_ready(root: Path) -> bool:
    """state.json has the running launch as ready (written a moment after it became ready)."""
    data = json.loads((root / "state" / "state.json").read_text())
    return bool((data.get("current_launch") or {}).get("ready_at"))


def killed_when_ready(
    procs: list[Proc], root: Path, fake_gpu: Path, cfg: dict[str, Any]
) -> tuple[int, Path]:
    """A live_restore daemon brought to ready, then SIGKILLed: its server's pid and log."""
    first = live_daemon(procs, root, fake_gpu, cfg)
    first.wait_state("ready", timeout=60)
    status = first.status()
    first.proc.signal(signal.SIGKILL)
    first.proc.popen.wait(10)
    return status["pid"], Path(status["log_file"])


def live_daemon(procs: list[Proc], root: Path, fake_gpu: Path, cfg: dict[str, Any]) -> Daemon:
    return start_daemon(procs, root, fake_gpu, {"k": cfg}, default="k", live_restore=True)


def test_a_daemon_killed_while_ready_is_adopted_same_pid_and_no_request_fails(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    port = free_port()
    cfg = standin_config(port=port)
    with shims_ended(tmp_path / "state", procs):
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
    with shims_ended(tmp_path / "state", procs):
        pid, log = killed_when_ready(procs, tmp_path, fake_gpu, cfg)
        os.kill(pid, signal.SIGUSR1)  # its last line, then exit 3, while nobody watches
        wait_until(lambda: not alive(pid), 10, "the server to end")
        ended = time.time()
        second = live_daemon(procs, tmp_path, fake_gpu, cfg)
        exit_ = second.wait_event("server.exit", timeout=20)
        assert (exit_["code"], exit_["reason"]) == (3, "crash"), exit_
        assert exit_["launch_id"] == log.stem  # (logs/<config>/<launch id>.log)
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
    with shims_ended(tmp_path / "state", procs):
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
    with shims_ended(tmp_path / "state", procs):
        pid, _ = killed_when_ready(procs, tmp_path, fake_gpu, cfg)
        (tmp_path / "state" / "state.json").unlink()
        cfg["health"]["startup_timeout_s"] = 5  # (its own start finds the port taken)
        second = start_daemon(procs, tmp_path, fake_gpu, {"k": cfg}, live_restore=True)
        found = second.wait_event("server.unmanaged_process", timeout=20)
        assert found["pid"] == pid and "does not name" in found["why"]
        assert [u["pid"] for u in second.status()["unmanaged"]] == [pid]
        assert psutil.Process(pid).is_running()


@pytest.mark.timeout(240)
def test_twenty_daemon_restarts_in_a_row_under_load_restart_the_server_zero_times(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """Ten SIGKILLs and ten SIGTERMs (as `systemctl restart` sends) of the daemon while a
    client keeps asking the server: every life adopts the same process, none launches one,
    and no request fails."""
    port = free_port()
    cfg = standin_config(port=port)
    with shims_ended(tmp_path / "state", procs):
        d = live_daemon(procs, tmp_path, fake_gpu, cfg)
        d.wait_state("ready", timeout=60)
        pid = d.status()["pid"]
        wait_until(lambda: saved_ready(tmp_path), 10, "the ready launch on record")
        client = Client(port)
        client.start()
        for i in range(20):
            d.proc.signal(signal.SIGKILL if i % 2 == 0 else signal.SIGTERM)
            d.proc.popen.wait(30)
            d = live_daemon(procs, tmp_path, fake_gpu, cfg)
            assert d.wait_event("server.adopted", timeout=20)["pid"] == pid
            assert d.wait_event("server.state", reason="adopted")["to"] == "ready"
            launched = [r for r in d.records() if r.get("event") == "server.launch"]
            assert launched == [], f"life {i + 2} launched a server"
        ok, failed = client.end()
        assert failed == [] and ok > 0
        status = d.status()
        assert (status["state"], status["pid"], status["restarts"]) == ("ready", pid, 0)


def flood_config(lines: int) -> dict[str, Any]:
    script = str(Path(__file__).with_name("foreign_http.py"))
    return {
        "command": [PY, script],
        "args": {"port": free_port(), "flood-on-usr2": lines},
        "health": {"startup_timeout_s": 30, "interval_s": 0.2, "timeout_s": 2, "failures": 3},
    }


def flooded(log: Path, lines: int) -> None:
    """Every line of the flood is in `log`, whole and in order."""
    text = log.read_text()
    got = [line for line in text.splitlines() if line.startswith("flood line ")]
    assert got == [f"flood line {i:08d}" for i in range(lines)]


def test_a_server_flooding_while_the_daemon_is_down_loses_no_line(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    lines = 300_000  # 6 MB
    cfg = flood_config(lines)
    with shims_ended(tmp_path / "state", procs):
        pid, log = killed_when_ready(procs, tmp_path, fake_gpu, cfg)
        os.kill(pid, signal.SIGUSR2)
        wait_until(lambda: "flood done" in log.read_text(), 60, "the flood to be written")
        second = live_daemon(procs, tmp_path, fake_gpu, cfg)
        assert second.wait_event("server.adopted", timeout=20)["pid"] == pid
        flooded(log, lines)


def test_a_stopped_daemon_never_stalls_the_server_nor_loses_its_lines(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """The daemon SIGSTOPped while the server floods past what the shim keeps for a client that
    does not read: the file has every line, the server ends its flood, and the daemon, woken,
    goes on supervising it (ready, the same process)."""
    lines = 600_000  # 12 MB: more than the shim holds for the daemon
    cfg = flood_config(lines)
    with shims_ended(tmp_path / "state", procs):
        d = live_daemon(procs, tmp_path, fake_gpu, cfg)
        d.wait_state("ready", timeout=60)
        status = d.status()
        pid, log = status["pid"], Path(status["log_file"])
        d.proc.signal(signal.SIGSTOP)
        try:
            os.kill(pid, signal.SIGUSR2)
            wait_until(lambda: "flood done" in log.read_text(), 60, "the flood while stopped")
        finally:
            d.proc.signal(signal.SIGCONT)
        flooded(log, lines)
        wait_until(lambda: d.status()["state"] == "ready", 20, "the daemon back")
        assert d.status()["pid"] == pid


# -- upgrades: the next version adopts what this one launched ----------------------------------


def install_shim(root: Path, version: tuple[int, int]) -> Path:
    """Another install's shim: its four files and the log writer they load, copied under
    `root`, speaking protocol `version`. Returns its shim.py."""
    here = Path(shim_module.__file__).parent
    (root / "server").mkdir(parents=True)
    for name in ("shim.py", "shimproc.py", "shimwire.py", "shimout.py"):
        text = (here / name).read_text()
        if name == "shimwire.py":
            assert f"VERSION = {shimwire.VERSION}" in text
            text = text.replace(f"VERSION = {shimwire.VERSION}", f"VERSION = {version}")
        (root / "server" / name).write_text(text)
    (root / "logfile.py").write_text((here.parent / "logfile.py").read_text())
    return root / "server" / "shim.py"


async def test_a_server_under_another_versions_shim_is_adopted_across_daemon_lives(
    tmp_path: Path, fake_gpu: Path
) -> None:
    """A shim of another install, a later minor version of the protocol, runs the server; one
    life of the daemon launches under it, the next adopts from it: the same process, with no
    relaunch."""
    later = (shimwire.VERSION[0], shimwire.VERSION[1] + 7)
    script = install_shim(tmp_path / "other-install", later)
    folder = tmp_path / "state" / "shim"
    folder.mkdir(parents=True)
    shim = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-S",
        str(script),
        "--dir",
        str(folder),
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert shim.stdout is not None and (await shim.stdout.readline()).startswith(b"listening ")
        configs = {"k": standin_config()}
        settings = {"live_restore": True}
        async with running(tmp_path, fake_gpu, configs, settings=settings) as sup:
            await sup.wait_for(lambda s: bool(events(s, "shim_connected")), 20)
            assert events(sup, "shim_connected")[0]["pid"] == shim.pid  # found, not started
            await sup.start("k")
            await sup.wait_for_state(ServerState.READY, timeout=30)
            assert sup.machine.launch is not None and sup.machine.launch.child is not None
            pid = sup.machine.launch.child.pid
            assert psutil.Process(pid).ppid() == shim.pid
        async with live(tmp_path, fake_gpu, configs) as sup:  # (then the shim and its server end)
            await sup.wait_for(lambda s: bool(events(s, "adopted")), 20)
            assert events(sup, "adopted")[0]["pid"] == pid
            assert len(events(sup, "launch")) == 1  # (events.jsonl keeps the first life's)
            assert sup.machine.state == ServerState.READY
    finally:
        with contextlib.suppress(ProcessLookupError):
            shim.kill()
        await shim.wait()


def test_a_shim_in_a_unit_of_its_own_keeps_the_server_through_a_daemon_restart(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """The systemd mechanism without systemd. `gpuwarden shim` runs as gpuwarden-shim.service
    would (its own process, its own session); the daemon, told so (GPUWARDEN_SHIM_UNIT),
    connects to it and starts none. `systemctl restart gpuwarden` is SIGTERM to the daemon,
    then (KillMode=mixed) SIGKILL to what is left of the daemon's own: the server is not
    there, runs on, and the next daemon adopts it."""
    settings = write_setup(tmp_path, {"k": standin_config()}, "k", live_restore=True)
    env = {"GPUWARDEN_SHIM_UNIT": "gpuwarden-shim.service"}
    with shims_ended(tmp_path / "state", procs):
        unit = gpuwarden(procs, "shim", "--settings", str(settings), fake_gpu=fake_gpu)
        unit.wait_for("^listening ", timeout=20)
        d = Daemon(serve(procs, settings, fake_gpu, env=env), tmp_path)
        connected = d.wait_event("server.shim_connected")
        assert (connected["pid"], connected["started"]) == (unit.pid, False)  # the unit's
        d.wait_state("ready", timeout=60)
        pid = d.status()["pid"]
        assert psutil.Process(pid).ppid() == unit.pid
        d.proc.signal(signal.SIGTERM)
        assert d.proc.popen.wait(30) == 0
        d.proc.kill_group()  # what KillMode=mixed kills of the daemon's unit after its exit
        assert alive(pid)
        d = Daemon(serve(procs, settings, fake_gpu, env=env), tmp_path)
        assert d.wait_event("server.adopted", timeout=20)["pid"] == pid
        d.http.post("/stop").raise_for_status()  # `gpuwarden stop`: the server goes
        d.wait_state("stopped", timeout=30)
        assert not alive(pid) and unit.popen.poll() is None  # the shim's unit runs on


def test_sighup_executes_the_daemon_again_in_place_and_it_adopts_its_server(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """`systemctl reload gpuwarden` (ExecReload: SIGHUP): the daemon stops as for SIGTERM,
    leaving the server to the shim, and executes itself again (the same pid, the program as
    installed now), which adopts the server."""
    with shims_ended(tmp_path / "state", procs):
        d = live_daemon(procs, tmp_path, fake_gpu, standin_config())
        d.wait_state("ready", timeout=60)
        pid, mark = d.status()["pid"], d.mark()
        d.proc.signal(signal.SIGHUP)
        d.wait_event("daemon.reloading", after=mark)
        listening = d.wait_event("api.listening", after=mark, timeout=30)  # the same process
        assert d.wait_event("server.adopted", after=mark, timeout=20)["pid"] == pid
        assert d.proc.popen.poll() is None
        d.http = httpx.Client(base_url=listening["url"], timeout=30, trust_env=False)  # port 0
        assert d.status()["pid"] == pid and d.status()["state"] == "ready"
        # The shim it started before is its child still, and owned again: a crash's sweep
        # takes the server's leftovers, never the shim.
        shim = psutil.Process(pid).ppid()
        os.kill(pid, signal.SIGKILL)
        d.wait_event("server.exit", after=mark, timeout=20)
        wait_until(lambda: d.status()["state"] == "ready" and d.status()["pid"] != pid, 30, "up")
        assert psutil.Process(d.status()["pid"]).ppid() == shim
        assert not [r for r in d.records()[mark:] if r.get("event") == "server.shim_lost"]
        d.http.post("/stop").raise_for_status()
        wait_until(lambda: d.status()["state"] == "stopped", 30, "the stop")


async def test_a_shim_that_cannot_be_started_again_is_sought_again_meanwhile_the_daemon_runs(
    tmp_path: Path, fake_gpu: Path
) -> None:
    """The shim is lost and its successor cannot start (its log path is taken by a folder):
    said; the server's next launch waits for it once, then runs under the daemon; the shim is
    sought again, backing off, and found once it can start."""
    async with live(tmp_path, fake_gpu, {"k": standin_config()}) as sup:
        shim_pid = events(sup, "shim_connected")[0]["pid"]
        await sup.start("k")
        await sup.wait_for_state(ServerState.READY, timeout=30)
        shim_log = tmp_path / "state" / "shim" / "shim.log"
        shim_log.unlink()
        shim_log.mkdir()  # the next shim cannot open its own log: it ends before it listens
        os.kill(shim_pid, signal.SIGKILL)
        await sup.wait_for(lambda s: bool(events(s, "shim_unavailable")), 30)
        await sup.wait_for(lambda s: len(events(s, "launch")) >= 2, 40)
        await sup.wait_for_state(ServerState.READY, timeout=30)
        assert sup.machine.launch is not None and sup.machine.launch.child is not None
        assert sup.machine.launch.child.survives_daemon is False  # the daemon's own child
        await sup.wait_for(lambda s: len(events(s, "shim_unavailable")) >= 2, 30)  # again
        shim_log.rmdir()
        await sup.wait_for(lambda s: len(events(s, "shim_connected")) >= 2, 60)
        assert events(sup, "shim_connected")[-1]["again"] is True
