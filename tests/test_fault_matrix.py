"""The fault matrix: each row a fault with real processes; supervision goes on and nothing is
lost (the log keeps the evidence, the events and state.json record the exit).

Rows: every stand-in fault; an exit-2 config error; the port in use; a foreign GPU holder; the
log dir not writable; a full disk (a file-size limit); a corrupt state file at start; the daemon
SIGKILLed, then started again; concurrent swaps and a stop; a webhook that hangs or fails; a
sweep through a crashing and a refused config; a flood and a crash with /logs/stream clients
that read nothing."""

from __future__ import annotations

import json
import resource
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from .conftest import PY, Proc, alive, wait_until
from .daemon_harness import Daemon, standin_config, start_daemon

ROWS: list[tuple[str, list[str], dict[str, Any], str, str]] = [
    # id, flags, config fields, reason, a line the log file must keep
    ("cuda_oom", ["--standin-crash-on-load=cuda_oom"], {}, "cuda_oom", "CUDA out of memory"),
    ("nccl", ["--standin-crash-on-load=nccl_init"], {}, "nccl_error", "NCCL error in:"),
    ("kv_pool", ["--standin-crash-on-load=not_enough_memory"], {}, "cuda_oom", "Not enough memory"),
    ("capture", ["--standin-crash-on-load=capture"], {}, "cuda_oom", "Capture cuda graph failed"),
    ("crash_after_ready", ["--standin-crash-after=0.1"], {}, "crash", "illegal memory access"),
    (
        "silent_death",
        ["--standin-silent-death-after=0.1"],
        {},
        "crash",
        "crashed with exit code -6",
    ),
    ("watchdog", ["--standin-watchdog-after=0.1"], {}, "watchdog_timeout", "watchdog timeout"),
    (
        "hang",
        ["--standin-hang-after=0"],
        {"health": {"interval_s": 0.1, "timeout_s": 0.3, "failures": 2}},
        "liveness_failed",
        "fired up and ready",
    ),
    (
        "config_error",
        ["--cuda-graph-max-bs=8"],
        {"preflight": {"argv": False}},
        "config_error",
        "ambiguous option: --cuda-graph-max-bs",
    ),
    (
        "flood_utf8_long",
        [
            "--standin-flood=50000",
            "--standin-invalid-utf8",
            "--standin-long-line=1048576",
            "--standin-crash-after=0.5",
        ],
        {},
        "crash",
        "flood done: 50000 lines",
    ),
    (
        # With ten /logs/stream clients that read nothing (STALLED): a server blocked on its
        # pipe by them would crash with its flood unwritten.
        "log_streams_stalled",
        ["--standin-flood=100000", "--standin-crash-after=3"],
        {},
        "crash",
        "flood done: 100000 lines",
    ),
]
# Rows run with this many /logs/stream clients that never read: their streams must cost the
# capture path nothing and end when they disconnect.
STALLED = {"log_streams_stalled": 10}


def check_nothing_lost(d: Daemon, root: Path, reason: str, line: str) -> None:
    ex = d.wait_event("server.exit", reason=reason, timeout=40)
    log = next(
        r
        for r in d.records()
        if r.get("event") == "server.launch" and r.get("launch_id") == ex["launch_id"]
    )
    assert line.lower() in Path(log["log_file"]).read_text(errors="replace").lower()
    wait_recorded(
        root,
        f"the exit of {ex['launch_id']}",
        lambda ev: any(e["event"] == "exit" and e.get("launch_id") == ex["launch_id"] for e in ev),
    )
    state = root / "state" / "state.json"
    wait_until(  # written off the loop, after the message that changed it
        lambda: json.loads(state.read_text())["intent"]["config"] == "f", 10, "the intent"
    )
    assert d.proc.popen.poll() is None  # supervision goes on


@pytest.mark.parametrize(
    ("row", "flags", "fields", "reason", "line"), ROWS, ids=[r[0] for r in ROWS]
)
def test_stand_in_fault(
    procs,
    tmp_path: Path,
    fake_gpu: Path,
    row: str,
    flags: list[str],  # type: ignore[no-untyped-def]
    fields: dict[str, Any],
    reason: str,
    line: str,
) -> None:
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"f": standin_config(*flags, **fields)},
        default="f",
        restart={"initial_delay_s": 0.05, "max_failures": 3},
    )
    from .test_logstreams import stalled_stream, streams  # noqa: PLC0415

    clients = [stalled_stream(d.url) for _ in range(STALLED.get(row, 0))]
    check_nothing_lost(d, tmp_path, reason, line)
    if reason != "config_error":  # not retried blindly
        ex = d.wait_event("server.exit", reason=reason, timeout=40)
        d.wait_event("server.launch", after=ex["_index"], timeout=40)
    for sock in clients:
        sock.close()
    if clients:
        wait_until(lambda: streams(d) == 0, 10, "the streams of the closed clients to end")


def test_port_in_use(procs, tmp_path: Path, fake_gpu: Path) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cfg = standin_config(port=busy.getsockname()[1])
        d = start_daemon(procs, tmp_path, fake_gpu, {"f": cfg}, default="f")
        d.wait_state("failed", reason="preflight_refused")  # preflight saw the port
        assert "address already in use" in d.status()["last_exit"]["evidence"]


def test_disk_full_leaves_supervision_running(procs, tmp_path: Path, fake_gpu: Path) -> None:  # type: ignore[no-untyped-def]
    from .daemon_harness import write_setup  # noqa: PLC0415

    flood = standin_config("--standin-flood=200000", health={"interval_s": 600})
    path = write_setup(tmp_path, {"f": flood}, "f")
    limit = 4 * 1024 * 1024  # a file-size limit: writes past 4 MiB fail with EFBIG
    import os  # noqa: PLC0415

    env = {**os.environ, "GPUWARDEN_FAKE_GPU_DIR": str(fake_gpu), "PYTHONUNBUFFERED": "1"}
    proc = Proc([PY, "-m", "gpuwarden.daemon.cli", "serve", "--settings", str(path)], env=env)
    procs.append(proc)
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (limit, limit))  # the daemon's "disk"
    d = Daemon(proc, tmp_path)
    d.wait_state("ready")
    log_file = Path(d.status()["log_file"])
    from .conftest import wait_until  # noqa: PLC0415

    wait_until(lambda: log_file.stat().st_size >= limit - 200, 30, "the log to reach the limit")
    st = d.status()  # the daemon is alive and answering
    assert st["state"] == "ready"
    proc.signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def test_a_sweep_survives_a_crashing_and_a_refused_config(
    procs, tmp_path: Path, fake_gpu: Path
) -> None:  # type: ignore[no-untyped-def]
    from .conftest import free_port  # noqa: PLC0415

    port = free_port()
    cfgs = {
        "f": standin_config(port=port),
        "oom": standin_config("--standin-crash-on-load=cuda_oom", port=port),
        "typo": standin_config("--tp-szie=2", port=port),
    }
    d = start_daemon(procs, tmp_path, fake_gpu, cfgs, default="f", restart={"initial_delay_s": 30})
    d.wait_state("ready")
    body = {"configs": ["oom", "typo", "f"], "requests": 1, "warmup": 0, "max_tokens": 20}
    sid = d.http.post("/sweeps", json=body).json()["id"]
    d.wait_event("server.sweep_finished", sweep_id=sid, timeout=120)
    rows = {r["config"]: r for r in d.http.get(f"/sweeps/{sid}").json()["rows"]}
    assert rows["oom"]["status"] == "rolled_back" and rows["typo"]["status"] == "refused"
    assert rows["f"]["status"] == "ok"
    assert "CUDA out of memory" in Path(rows["oom"]["log"]).read_text()
    assert d.status()["config"] == "f" and d.status()["state"] == "ready"
    result = json.loads((tmp_path / "state" / "sweeps" / sid / "result.json").read_text())
    assert [r["config"] for r in result["rows"]] == ["oom", "typo", "f"]
    assert d.proc.popen.poll() is None


def recorded(root: Path) -> list[dict[str, Any]]:
    """events.jsonl as written so far (a background writer keeps it)."""
    path = root / "state" / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def wait_recorded(
    root: Path, what: str, pred: Callable[[list[dict[str, Any]]], bool], timeout: float = 10
) -> None:
    """Wait for events.jsonl to satisfy `pred` (the writer runs off the daemon's loop)."""
    wait_until(lambda: pred(recorded(root)), timeout, f"{what} in events.jsonl")


def has_exit(reason: str) -> Callable[[list[dict[str, Any]]], bool]:
    return lambda events: any(e["event"] == "exit" and e.get("reason") == reason for e in events)


def test_foreign_gpu_holder(procs, tmp_path: Path, fake_gpu: Path) -> None:  # type: ignore[no-untyped-def]
    from .test_fakegpu import start_holder  # noqa: PLC0415

    holder = start_holder(procs, fake_gpu, 0, 50000)
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"f": standin_config()},
        default="f",
        gpu={"release_timeout_s": 0.3},
        restart={"initial_delay_s": 0.2, "jitter": 0},
    )
    ex = d.wait_event("server.exit", reason="gpu_busy")
    assert f"pid {holder.pid}" in ex["evidence"]
    assert alive(holder.pid)  # a foreign holder is never killed
    wait_recorded(tmp_path, "the gpu_busy exit", has_exit("gpu_busy"))
    holder.signal(signal.SIGTERM)
    holder.wait(10)
    d.wait_state("ready", after=ex["_index"], timeout=30)  # supervision went on


def test_log_dir_not_writable(procs, tmp_path: Path, fake_gpu: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "afile").write_text("")  # root ignores permissions: a path through a file
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"f": standin_config()},
        default="f",
        log_dir="./afile/logs",
        restart={"initial_delay_s": 0.05, "jitter": 0},
    )
    first = d.wait_event("server.exit", reason="log_unwritable")
    assert "afile/logs" in first["evidence"]
    d.wait_event("server.exit", reason="log_unwritable", after=first["_index"])  # retried
    assert not [r for r in d.records() if r.get("event") == "server.launch"]  # no log, no run
    wait_recorded(tmp_path, "the log_unwritable exit", has_exit("log_unwritable"))
    state = tmp_path / "state" / "state.json"
    wait_until(  # written off the loop, after the message that changed it
        lambda: json.loads(state.read_text())["intent"] == {"config": "f", "running": True},
        10,
        "the intent in state.json",
    )
    assert d.proc.popen.poll() is None


def test_corrupt_state_file_is_moved_aside(procs, tmp_path: Path, fake_gpu: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.json").write_text("{not json")
    d = start_daemon(procs, tmp_path, fake_gpu, {"base": standin_config()}, default="base")
    note = d.wait_event("server.state_file_corrupt")
    assert "moved to state.json.corrupt-" in note["detail"]
    d.wait_state("ready")
    (aside,) = (tmp_path / "state").glob("state.json.corrupt-*")
    assert aside.read_text() == "{not json"  # kept as it was, for a person to read


def test_daemon_sigkill_then_restart_stops_the_old_group_and_resumes(  # type: ignore[no-untyped-def]
    procs, tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, {"base": standin_config()}, default="base")
    d.wait_state("ready")
    old = d.status()["pid"]
    first_log = Path(d.status()["log_file"])
    d.proc.signal(signal.SIGKILL)
    d.proc.wait(10)
    assert alive(old)  # the server outlives a killed daemon ...
    # ... and the next daemon stops it before launching anything.
    d2 = start_daemon(procs, tmp_path, fake_gpu, {"base": standin_config()}, default=None)
    found = d2.wait_event("server.previous_server_found")
    assert found["pid"] == old
    stopped = d2.wait_event("server.previous_server_stopped")
    launch = d2.wait_event("server.launch")
    assert launch["_index"] > stopped["_index"]
    assert not alive(old)
    d2.wait_state("ready")
    assert d2.status()["config"] == "base"  # the saved intent won (default_config is unset)
    assert "fired up and ready" in first_log.read_text()  # the first life's log is kept
    wait_recorded(  # both lives' launches
        tmp_path, "two launches", lambda ev: sum(e["event"] == "launch" for e in ev) == 2
    )


def test_concurrent_swaps_and_a_stop(procs, tmp_path: Path, fake_gpu: Path) -> None:  # type: ignore[no-untyped-def]
    from .test_api import two_configs  # noqa: PLC0415

    configs = two_configs(slow=standin_config(scale=0.5))
    d = start_daemon(procs, tmp_path, fake_gpu, configs, default="good")
    d.wait_state("ready")
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(d.http.post, "/restart", params={"config": "slow"})
        b = pool.submit(d.http.post, "/restart", params={"config": "other"})
        codes = sorted([a.result().status_code, b.result().status_code])
    assert codes == [202, 409]
    conflict = (a.result() if a.result().status_code == 409 else b.result()).json()
    assert conflict["error"] == "conflict" and "is under way" in conflict["detail"]
    assert d.http.post("/start").status_code == 409
    assert d.http.post("/stop").status_code == 202  # stop wins over the swap under way
    d.wait_state("stopped")
    st = d.status()
    assert st["intent"]["running"] is False and st["pid"] is None
    pids = {r["pid"] for r in d.records() if r.get("event") == "server.launch"}
    assert not [pid for pid in pids if alive(pid)]
    launched = {r["launch_id"] for r in d.records() if r.get("event") == "server.launch"}
    wait_recorded(
        tmp_path,
        "an exit for every launch",
        lambda ev: {e.get("launch_id") for e in ev if e["event"] == "exit"} >= launched,
    )


@pytest.mark.parametrize("mode", ["hang", "500"])
def test_a_bad_webhook_never_delays_the_relaunch(
    procs, tmp_path: Path, fake_gpu: Path, mode: str
) -> None:  # type: ignore[no-untyped-def]
    from .test_chat import Receiver  # noqa: PLC0415

    receiver = Receiver(mode)
    try:
        cfg = standin_config("--standin-crash-after=0.1")
        d = start_daemon(
            procs,
            tmp_path,
            fake_gpu,
            {"c": cfg},
            default="c",
            restart={"initial_delay_s": 0, "crash_loop_after": 100},
            chat={"webhooks": [receiver.url]},
        )
        ex = d.wait_event("server.exit", reason="crash")
        t0 = time.monotonic()
        d.wait_event("server.launch", after=ex["_index"], timeout=10)
        assert time.monotonic() - t0 < 3  # the webhook hangs 30 s or fails: supervision goes on
        if mode == "500":
            failed = d.wait_event("server.notify_failed", timeout=30)
            assert failed["webhook"] == "#1" and "after 3 attempts" in failed["error"]
            assert len(receiver.posts) >= 3
        wait_recorded(tmp_path, "the crash", has_exit("crash"))
    finally:
        receiver.close()
