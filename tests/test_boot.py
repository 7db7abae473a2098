"""The daemon's boot as the machine sees it: the previous life's record restored at once, its
server stopped, then the saved intent started; commands asked meanwhile handled in order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil

from .support.configs import standin_config
from .support.daemon import Daemon, start_daemon
from .support.procs import PY, Proc, alive, wait_until

# A server of the previous life that holds on through SIGTERM: stopping it takes all of the
# stop's grace (SIGKILL after it), so the boot is slow for as long as that.
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('up', flush=True); time.sleep(600)"
)
GRACE_S = 5


def previous_life(procs: list[Proc], root: Path) -> Proc:
    """A state.json as a daemon killed mid-serve leaves it: config `base` running (2 failures
    on record, base last good) with its server, still alive and in its own group, on record."""
    server = Proc([PY, "-c", STUBBORN])
    procs.append(server)
    server.wait_for("up", timeout=10)
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    state = {
        "intent": {"config": "base", "running": True},
        "last_good_config": "base",
        "last_good_launch": "20261206T000000-000001",
        "failures": 2,
        "launch_seq": 1,
        "current_launch": {
            "launch_id": "20261206T000000-000001",
            "token": "previous-life-token",
            "config": "base",
            "pid": server.pid,
            "pgid": server.pid,
            "create_time": psutil.Process(server.pid).create_time(),
            "boot_id": boot_id,
            "started_at": 1.0,
        },
        "launches": [
            {
                "launch_id": "20261206T000000-000001",
                "config": "base",
                "pid": server.pid,
                "started_at": "2026-12-06T00:00:00Z",
                "ready_at": None,
                "log_file": None,
                "exit": None,
            }
        ],
    }
    (root / "state").mkdir(parents=True)
    (root / "state" / "state.json").write_text(json.dumps(state))
    return server


def booting_daemon(procs: list[Proc], root: Path, fake_gpu: Path) -> tuple[Daemon, Proc]:
    server = previous_life(procs, root)
    d = start_daemon(procs, root, fake_gpu, {"base": standin_config()}, stop={"grace_s": GRACE_S})
    found = d.wait_event("server.previous_server_found")
    assert found["pid"] == server.pid
    return d, server


def launches(d: Daemon) -> list[dict[str, Any]]:
    return [r for r in d.records() if r.get("event") == "server.launch"]


def test_status_during_boot_shows_the_saved_record_and_booting(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """Before: for the whole stop of the previous server `/status` served an empty machine
    (intent null, counters 0) that said nothing of a boot."""
    d, server = booting_daemon(procs, tmp_path, fake_gpu)
    st = d.status()
    assert st["booting"] is True and st["supervising"] is True
    assert st["intent"] == {"config": "base", "running": True}
    assert st["failures"] == 2 and st["last_good_config"] == "base"
    assert st["state"] == "stopped" and st["pid"] is None
    assert d.http.get("/healthz").json() == {"ok": True, "booting": True}
    d.wait_event("server.previous_server_stopped", timeout=GRACE_S + 20)
    assert not alive(server.pid)
    d.wait_state("ready")  # then the saved intent starts
    st = d.status()
    assert st["booting"] is False and st["config"] == "base"
    assert d.http.get("/healthz").json() == {"ok": True, "booting": False}

    def current() -> dict[str, Any]:
        data = json.loads((tmp_path / "state" / "state.json").read_text())
        return data.get("current_launch") or {}

    # state.json keeps what a later life needs to take this server over as it runs.
    wait_until(lambda: current().get("ready_at") is not None, 10, "the ready launch saved")
    record = current()
    assert record["pid"] == st["pid"] and record["log_file"] == st["log_file"]
    assert record["launch_id"] == st["launch_id"] and record["config"] == "base"
    assert record["port"] and record["health_url"].startswith("http://127.0.0.1:")
    assert record["config_hash"] and record["argv"][0] == PY


def test_a_stop_during_a_slow_boot_wins(procs: list[Proc], tmp_path: Path, fake_gpu: Path) -> None:
    """Before: the stop was answered `stopped`, then the saved config started anyway."""
    d, server = booting_daemon(procs, tmp_path, fake_gpu)
    res = d.http.post("/stop")
    assert res.status_code == 202 and res.json()["state"] == "stopped"
    d.wait_event("server.previous_server_stopped", timeout=GRACE_S + 20)
    assert not alive(server.pid)
    wait_until(lambda: d.status()["booting"] is False, 10, "the boot to end")
    st = d.status()
    assert st["state"] == "stopped" and st["intent"] == {"config": "base", "running": False}
    assert not launches(d)  # nothing started: the boot was over when it said so

    def saved() -> dict[str, Any]:
        data: dict[str, Any] = json.loads((tmp_path / "state" / "state.json").read_text())
        return data

    # The previous life's launch has its exit on record (stopped at this boot), and the
    # intent is saved as stopped: a later life starts nothing either.
    wait_until(lambda: saved()["launches"][0]["exit"] is not None, 10, "the exit saved")
    (entry,) = saved()["launches"]
    assert entry["exit"]["reason"] == "requested_stop"
    assert saved()["intent"] == {"config": "base", "running": False}


def test_a_start_during_the_previous_servers_stop_is_refused_until_it_is_gone(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d, _ = booting_daemon(procs, tmp_path, fake_gpu)
    res = d.http.post("/start", params={"config": "base"})
    assert res.status_code == 409
    assert "stopping the server its previous life left running" in res.json()["detail"]
    d.wait_state("ready", timeout=GRACE_S + 30)  # the boot's own start goes on
    assert len(launches(d)) == 1


def test_a_state_file_of_another_shape_boots_as_a_first_start(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """A JSON object whose fields have other types (hand-edited, another program's) is said
    and set aside; the daemon boots as on a first start instead of failing its boot."""
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.json").write_text(
        json.dumps({"intent": "base", "failures": "many", "known_processes": 5})
    )
    d = start_daemon(procs, tmp_path, fake_gpu, {"base": standin_config()}, default="base")
    note = d.wait_event("server.state_file_corrupt")
    assert "does not read as a record" in note["detail"]
    d.wait_state("ready")
    assert d.status()["booting"] is False


def test_a_state_file_of_the_previous_schema_is_read(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """`tests/fixtures/state-v1.json` was written by the daemon before state.json had a schema
    (config `k` serving, on another boot): it is read as it is, and saved at the new schema."""
    fixture = Path(__file__).with_name("fixtures") / "state-v1.json"
    old = json.loads(fixture.read_text())
    assert "schema" not in old and old["current_launch"]["launch_id"]
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.json").write_text(fixture.read_text())
    d = start_daemon(procs, tmp_path, fake_gpu, {"k": standin_config()})
    d.wait_state("ready")  # its intent: k running
    st = d.status()
    assert st["config"] == "k" and st["launch_id"].endswith("-000002")  # its launch_seq
    # Its launch, on another boot, ended while the daemon was away.
    d.wait_event("server.exit", reason="ended_unobserved", launch_id=old["last_good_launch"])

    def saved() -> dict[str, Any]:
        data: dict[str, Any] = json.loads((tmp_path / "state" / "state.json").read_text())
        return data

    wait_until(lambda: saved().get("schema") == 2, 10, "state.json saved at schema 2")
    assert saved()["current_launch"]["argv_digest"]
