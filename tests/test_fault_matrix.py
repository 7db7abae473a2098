"""The fault matrix: each row a fault with real processes; supervision goes on and nothing is
lost (the log keeps the evidence, the events and state.json record the exit)."""

from __future__ import annotations

import json
import resource
import signal
import socket
from pathlib import Path
from typing import Any

import pytest

from .conftest import PY, Proc
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
]


def check_nothing_lost(d: Daemon, root: Path, reason: str, line: str) -> None:
    ex = d.wait_event("server.exit", reason=reason, timeout=40)
    log = next(
        r
        for r in d.records()
        if r.get("event") == "server.launch" and r.get("launch_id") == ex["launch_id"]
    )
    assert line.lower() in Path(log["log_file"]).read_text(errors="replace").lower()
    events = [json.loads(x) for x in (root / "state" / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "exit" and e.get("launch_id") == ex["launch_id"] for e in events)
    state = json.loads((root / "state" / "state.json").read_text())
    assert state["intent"]["config"] == "f"
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
    check_nothing_lost(d, tmp_path, reason, line)
    if reason != "config_error":  # not retried blindly
        ex = d.wait_event("server.exit", reason=reason, timeout=40)
        d.wait_event("server.launch", after=ex["_index"], timeout=40)


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
