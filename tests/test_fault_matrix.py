"""The fault matrix: each row a fault with real processes; supervision goes on and nothing is
lost (the log keeps the evidence, the events and state.json record the exit).

Rows: every stand-in fault; an exit-2 config error; the port in use; a foreign GPU holder; the
log dir not writable; a full disk (a file-size limit); a corrupt state file at start; the daemon
SIGKILLed, then started again; concurrent swaps and a stop; a webhook that hangs or fails; a
sweep through a crashing and a refused config; a flood and a crash with /logs/stream clients
that read nothing; a sweep's server that crashes during its load, that streams malformed chunks,
or a 400 MiB line with no newline; the daemon SIGKILLed mid-sweep; a token file replaced by a
FIFO or a huge file; a secret-salt file that is a FIFO; twelve preflights at once (one parser
build, two introspections at a time); 300 idle sockets at the connection cap (probes and a stop
still answered); a FIFO and a 512 MiB file as a saved dump and as a sweep's record; a broken
config asked for again and again; twenty /logs?lines=100000 at once; 'server crashed' with a
dumps folder that cannot be written; a flood past the running log's cap; retention after the
wall clock went back; events.jsonl moved or deleted, while running and while away; a config file
garbled or removed while its server crash-loops."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from .support.configs import BOMB, standin_config, two_configs, write_setup
from .support.daemon import Daemon, serve, start_daemon
from .support.gpu import start_holder
from .support.http import (
    TOKEN,
    Receiver,
    connect,
    descriptors_short,
    read_response,
    request_head,
    send_chunks_until_answered,
    stalled_stream,
    streams,
    with_token,
)
from .support.procs import PY, Proc, alive, free_port, wait_until

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
    # The control plane abused from the daemon's start to the row's end (ABUSE, below).
    ("crash_under_slowloris", ["--standin-crash-after=0.3"], {}, "crash", "illegal memory access"),
    (
        "crash_under_huge_bodies",
        ["--standin-crash-after=0.3"],
        {},
        "crash",
        "illegal memory access",
    ),
    (
        "crash_with_few_descriptors",
        ["--standin-crash-after=0.3"],
        {},
        "crash",
        "illegal memory access",
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


class Clients(threading.Thread):
    """A misbehaving client, round after round until stopped; counts what it got back."""

    def __init__(self, round_: Callable[[Counter[str]], None]) -> None:
        super().__init__(daemon=True)
        self.round, self.seen, self.halt = round_, Counter[str](), threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                self.round(self.seen)
            except OSError as exc:  # the daemon cut us off: that is its right
                self.seen[type(exc).__name__] += 1

    @contextlib.contextmanager
    def running(self) -> Iterator[Counter[str]]:
        self.start()
        try:
            yield self.seen
        finally:
            self.halt.set()
            self.join(30)


def slowloris(d: Daemon) -> contextlib.AbstractContextManager[None]:
    """50 connections that never finish their headers, each replaced once the daemon cuts it."""
    held: list[socket.socket] = []

    def round_(seen: Counter[str]) -> None:
        while len(held) < 50:
            sock = connect(d)
            sock.sendall(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            held.append(sock)
        readable, _, _ = select.select(held, [], [], 0.1)
        for sock in readable:
            with contextlib.suppress(OSError):
                seen["408" if b" 408 " in sock.recv(4096) else "closed"] += 1
            sock.close()
            held.remove(sock)

    @contextlib.contextmanager
    def during() -> Iterator[None]:
        with Clients(round_).running() as seen:
            yield
            wait_until(lambda: seen["408"] >= 50, 20, "the daemon to cut off 50 slow clients")
        for sock in held:
            sock.close()

    return during()


def huge_bodies(d: Daemon) -> contextlib.AbstractContextManager[None]:
    """1 GiB bodies announced without the token, and chunked ones past the limit with it."""

    def round_(seen: Counter[str]) -> None:
        with connect(d) as sock:
            sock.sendall(request_head("POST", "/chat", d, Content_Length=str(2**30)))
            seen[str(read_response(sock)[0])] += 1
        with connect(d) as sock:
            head = request_head(
                "POST", "/sweeps", d, Transfer_Encoding="chunked", Authorization=f"Bearer {TOKEN}"
            )
            sock.sendall(head)
            seen[str(send_chunks_until_answered(sock, 256 * 1024)[0])] += 1

    @contextlib.contextmanager
    def during() -> Iterator[None]:
        rss0 = psutil.Process(d.proc.pid).memory_info().rss
        with Clients(round_).running() as seen:
            yield
            wait_until(lambda: seen["401"] and seen["413"], 20, "a 401 and a 413")
            rss1 = psutil.Process(d.proc.pid).memory_info().rss
        assert set(seen) <= {"401", "413", "ConnectionResetError", "BrokenPipeError"}, seen
        assert rss1 - rss0 < 64 * 2**20, (rss0, rss1)  # nothing of the bodies was kept

    return during()


def few_descriptors(d: Daemon) -> contextlib.AbstractContextManager[None]:
    """Room for 64 more descriptors, and clients opening and holding 300 connections: the cap
    refuses them, so the daemon keeps descriptors for its server, its logs and its state."""
    held: list[socket.socket] = []

    def round_(seen: Counter[str]) -> None:
        if len(held) < 300:
            held.append(connect(d))
        readable, _, _ = select.select(held, [], [], 0.01)
        for sock in readable:
            with contextlib.suppress(OSError):
                seen["busy" if b" 503 " in sock.recv(4096) else "closed"] += 1
            sock.close()
            held.remove(sock)

    @contextlib.contextmanager
    def during() -> Iterator[None]:
        with descriptors_short(d, spare=64), Clients(round_).running() as seen:
            yield
            wait_until(lambda: seen["busy"] > 0, 20, "a connection refused at the cap")
        for sock in held:
            sock.close()

    return during()


@dataclass(frozen=True)
class Abuse:
    during: Callable[[Daemon], contextlib.AbstractContextManager[None]]
    settings: Callable[[Path], dict[str, Any]] = field(default=lambda root: {})


def token_and_small_bodies(root: Path) -> dict[str, Any]:
    return {"token_file": with_token(root), "http": {"max_body_bytes": 256 * 1024}}


ABUSE: dict[str, Abuse] = {
    "crash_under_slowloris": Abuse(slowloris, lambda root: {"http": {"header_timeout_s": 0.5}}),
    "crash_under_huge_bodies": Abuse(huge_bodies, token_and_small_bodies),
    "crash_with_few_descriptors": Abuse(
        few_descriptors, lambda root: {"http": {"max_connections": 8, "header_timeout_s": 1}}
    ),
}


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
    procs: list[Proc],
    tmp_path: Path,
    fake_gpu: Path,
    row: str,
    flags: list[str],
    fields: dict[str, Any],
    reason: str,
    line: str,
) -> None:
    abuse = ABUSE.get(row)
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"f": standin_config(*flags, **fields)},
        default="f",
        restart={"initial_delay_s": 0.05, "max_failures": 3},
        **(abuse.settings(tmp_path) if abuse else {}),
    )

    clients = [stalled_stream(d.url) for _ in range(STALLED.get(row, 0))]
    with abuse.during(d) if abuse else contextlib.nullcontext():
        check_nothing_lost(d, tmp_path, reason, line)
        if reason != "config_error":  # not retried blindly
            ex = d.wait_event("server.exit", reason=reason, timeout=40)
            d.wait_event("server.launch", after=ex["_index"], timeout=40)
    for sock in clients:
        sock.close()
    if clients:
        wait_until(lambda: streams(d) == 0, 10, "the streams of the closed clients to end")


def test_port_in_use(procs: list[Proc], tmp_path: Path, fake_gpu: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cfg = standin_config(port=busy.getsockname()[1])
        d = start_daemon(procs, tmp_path, fake_gpu, {"f": cfg}, default="f")
        d.wait_state("failed", reason="preflight_refused")  # preflight saw the port
        assert "address already in use" in d.status()["last_exit"]["evidence"]


def test_disk_full_leaves_supervision_running(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    flood = standin_config("--standin-flood=200000", health={"interval_s": 600})
    path = write_setup(tmp_path, {"f": flood}, "f")
    limit = 4 * 1024 * 1024  # a file-size limit: writes past 4 MiB fail with EFBIG
    proc = serve(procs, path, fake_gpu)
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (limit, limit))  # the daemon's "disk"
    d = Daemon(proc, tmp_path)
    d.wait_state("ready")
    log_file = Path(d.status()["log_file"])

    wait_until(lambda: log_file.stat().st_size >= limit - 200, 30, "the log to reach the limit")
    st = d.status()  # the daemon is alive and answering
    assert st["state"] == "ready"
    proc.signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def test_a_sweep_survives_a_crashing_and_a_refused_config(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
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


def test_foreign_gpu_holder(procs: list[Proc], tmp_path: Path, fake_gpu: Path) -> None:
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


def test_log_dir_not_writable(procs: list[Proc], tmp_path: Path, fake_gpu: Path) -> None:
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
    # No log, no launch: the server is killed at its exec.
    assert not [r for r in d.records() if r.get("event") == "server.launch"]
    wait_recorded(tmp_path, "the log_unwritable exit", has_exit("log_unwritable"))
    state = tmp_path / "state" / "state.json"
    wait_until(  # written off the loop, after the message that changed it
        lambda: (
            state.exists()
            and json.loads(state.read_text())["intent"] == {"config": "f", "running": True}
        ),
        10,
        "the intent in state.json",
    )
    assert d.proc.popen.poll() is None


def test_corrupt_state_file_is_moved_aside(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.json").write_text("{not json")
    d = start_daemon(procs, tmp_path, fake_gpu, {"base": standin_config()}, default="base")
    note = d.wait_event("server.state_file_corrupt")
    assert "moved to state.json.corrupt-" in note["detail"]
    d.wait_state("ready")
    (aside,) = (tmp_path / "state").glob("state.json.corrupt-*")
    assert aside.read_text() == "{not json"  # kept as it was, for a person to read


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_state_file_that_is_not_a_file_is_moved_aside(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path, kind: str
) -> None:
    """A FIFO hung the boot (no writer ever comes); /dev/zero never ends: both are refused."""
    (tmp_path / "state").mkdir()
    state = tmp_path / "state" / "state.json"
    if kind == "fifo":
        os.mkfifo(state)
    else:
        state.symlink_to("/dev/zero")
    d = start_daemon(procs, tmp_path, fake_gpu, {"base": standin_config()}, default="base")
    note = d.wait_event("server.state_file_corrupt")
    assert "not a regular file" in note["detail"] and "moved to" in note["detail"]
    d.wait_state("ready")
    wait_until(  # the daemon writes a real file in its place
        lambda: state.is_file() and not state.is_symlink() and json.loads(state.read_text()),
        10,
        "a regular state.json",
    )


def test_daemon_sigkill_then_restart_stops_the_old_group_and_resumes(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
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


def test_concurrent_swaps_and_a_stop(procs: list[Proc], tmp_path: Path, fake_gpu: Path) -> None:
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
    procs: list[Proc], tmp_path: Path, fake_gpu: Path, mode: str
) -> None:
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


# -- the supervisor never wedges -------------------------------------------------------------------


def test_descriptors_exhausted_in_the_sweep_is_reported_and_supervision_goes_on(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """With not one descriptor left, a crash's sweep (and the GPU wait, the log, the exec after
    it) fail; each failure is an `internal_error` the machine handles, and once descriptors come
    back the server is ready again. Before, the sweep's task died unseen: `stopping` for ever."""
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"f": standin_config()},
        default="f",
        restart={"initial_delay_s": 0.2, "max_delay_s": 0.5, "jitter": 0},
    )
    d.wait_state("ready")
    server = d.status()["pid"]
    daemon = psutil.Process(d.proc.popen.pid)
    soft, hard = daemon.rlimit(psutil.RLIMIT_NOFILE)
    mark = d.mark()
    # Below every descriptor it holds: a freed one (the dead server's pipes) is no use either,
    # as a new descriptor must be numbered under the limit. Its log (stderr) still works.
    daemon.rlimit(psutil.RLIMIT_NOFILE, (3, hard))
    try:
        os.kill(server, signal.SIGKILL)
        failed = d.wait_event("server.internal_error", after=mark, timeout=30)
        assert "Errno 24" in failed["error"] or "Too many open files" in failed["error"]
    finally:
        daemon.rlimit(psutil.RLIMIT_NOFILE, (soft, hard))
    d.wait_state("ready", after=mark, timeout=60)
    assert d.status()["internal_errors"] >= 1


def test_a_config_that_stops_decoding_during_backoff_is_relaunched_as_it_ran(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """A file that stops decoding while its server is in backoff (a partial scp): the retry
    relaunches the resolution that was running and says why; the config itself is refused."""
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"f": standin_config("--standin-crash-after=0.2")},
        default="f",
        restart={"initial_delay_s": 1.0, "jitter": 0},
    )
    first = d.wait_event("server.launch", timeout=40)
    d.wait_state("backoff", timeout=40)
    mark = d.mark()
    (tmp_path / "configs" / "f.yaml").write_bytes(b"args: {x: \xff}\n")  # a partial scp
    said = d.wait_event("server.config_unreadable", after=mark, timeout=20)
    assert "f.yaml: not UTF-8 text" in said["error"]
    again = d.wait_event("server.launch", after=said["_index"], timeout=20)
    assert again["argv"] == first["argv"]
    assert d.status()["state"] != "failed"
    res = d.http.get("/configs/f")
    assert res.status_code == 422 and "not UTF-8 text" in res.json()["detail"]


def test_an_undecodable_config_at_boot_is_a_failed_start_with_an_event(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    write_setup(tmp_path, {"f": standin_config()}, "f")
    (tmp_path / "configs" / "f.yaml").write_bytes(b"args: " + b"[" * 20000 + b"]" * 20000 + b"\n")
    d = start_daemon(procs, tmp_path, fake_gpu, {}, default="f")
    refused = d.wait_event("server.preflight_refused")
    assert "nested deeper than 64 levels" in refused["detail"]
    d.wait_state("failed")


def test_an_alias_bomb_is_refused_while_the_daemon_stays_responsive(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, {"f": standin_config()}, default="f")
    d.wait_state("ready")
    (tmp_path / "configs" / "bomb.yaml").write_text(BOMB)
    quick = httpx.Client(base_url=d.url, timeout=10, trust_env=False)  # it took 48 s
    res = quick.post("/configs/bomb/check")
    assert res.status_code in (200, 422)
    assert "aliases are expanded" in json.dumps(res.json())
    res = quick.post("/restart", params={"config": "bomb"})
    assert res.status_code == 422 and "aliases are expanded" in res.json()["detail"]
    assert d.status()["state"] == "ready"


# -- writes that fail ------------------------------------------------------------------------------


def test_a_full_disk_is_reported_retried_and_the_gap_marked(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """A file-size limit of one byte on the daemon and the shim: no file they write can grow.
    The launch log (the shim's), events.jsonl and state.json each report the failure, keep
    trying and say what is missing once the limit is lifted."""
    d = start_daemon(procs, tmp_path, fake_gpu, {"f": standin_config()}, default="f")
    d.wait_state("ready")
    log_file = Path(d.status()["log_file"])
    daemon = psutil.Process(d.proc.popen.pid)
    shim = psutil.Process(d.wait_event("server.shim_connected")["pid"])
    limit = daemon.rlimit(psutil.RLIMIT_FSIZE)
    mark = d.mark()
    daemon.rlimit(psutil.RLIMIT_FSIZE, (1, limit[1]))
    shim.rlimit(psutil.RLIMIT_FSIZE, (1, limit[1]))
    try:
        # The probes' access lines fill the launch log; a restart writes events and state.
        d.wait_event("server.write_failed", after=mark, target="launch_log", timeout=20)
        assert d.http.post("/restart").status_code == 202
        d.wait_event("server.write_failed", after=mark, target="events", timeout=20)
        d.wait_event("server.write_failed", after=mark, target="state", timeout=20)
        st = d.status()
        assert {"events", "state"} <= set(st["write_errors"])
        assert "File too large" in st["write_errors"]["events"]
    finally:
        daemon.rlimit(psutil.RLIMIT_FSIZE, limit)
        shim.rlimit(psutil.RLIMIT_FSIZE, limit)
    d.wait_event("server.write_resumed", after=mark, target="events", timeout=20)
    d.wait_event("server.write_resumed", after=mark, target="state", timeout=20)
    d.wait_state("ready", after=mark)
    wait_until(lambda: not d.status()["write_errors"], 20, "no write errors")
    text = log_file.read_text(errors="replace")
    assert "of output not written here" in text and "File too large" in text
    assert "# exit:" in text  # written again after the gap
    gaps = [e for e in recorded(tmp_path) if e["event"] == "events_gap"]
    assert gaps and gaps[0]["lost"] >= 1
    assert any(e["event"] == "write_resumed" for e in recorded(tmp_path))
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert state["current_launch"]["pid"] == d.status()["pid"]  # current again


def test_metrics_count_write_failures_per_target(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, {"f": standin_config()}, default="f")
    d.wait_state("ready")
    text = d.http.get("/metrics").text
    assert 'gpuwarden_write_failures_total{target="state"} 0' in text


# -- what operators rely on is true ------------------------------------------------------------------


def restarts_taken(d: Daemon) -> int:
    """The restarts the daemon has taken (given their place among stops), by its log."""
    return sum(
        1
        for stream, line in list(d.proc.lines)
        if stream == "stderr" and '"event": "api.command"' in line and '"op": "restart"' in line
    )


def test_stop_wins_over_restarts_whose_preflight_finishes_after_it(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """20 concurrent swaps, then a stop while their preflights still run: none of them starts a
    server after the stop. A start sent after the stop works as usual."""

    d = start_daemon(procs, tmp_path, fake_gpu, two_configs(), default="good")
    d.wait_state("ready")
    daemon = psutil.Process(d.proc.popen.pid)

    def preflighting() -> bool:  # the version probe each swap's preflight runs
        with_c = []
        for child in daemon.children():
            with contextlib.suppress(psutil.Error):
                if "-c" in child.cmdline():
                    with_c.append(child)
        return bool(with_c)

    sent: list[httpx.Request] = []  # each swap's request, as it goes out to the daemon
    swapper = httpx.Client(
        base_url=d.url, timeout=30, trust_env=False, event_hooks={"request": [sent.append]}
    )
    with swapper, ThreadPoolExecutor(21) as pool:
        swaps = [
            pool.submit(swapper.post, "/restart", params={"config": "other"}) for _ in range(20)
        ]
        # All 20 asked before the stop: each taken by the daemon (its `api.command` line; one
        # still on its way when the stop is taken is asked after it, and rightly carried out),
        # and their preflights under way.
        wait_until(lambda: len(sent) == 20, 20, "the 20 swaps sent")
        wait_until(lambda: restarts_taken(d) == 20, 20, "the 20 swaps taken by the daemon")
        wait_until(preflighting, 20, "a swap's preflight under way")
        assert d.http.post("/stop").status_code == 202
        stop_index = d.wait_state("stopped")["_index"]
        codes = [f.result().status_code for f in swaps]
    assert set(codes) <= {202, 409}
    assert all(
        r["_index"] < stop_index
        for r in [
            {**json.loads(line), "_index": i}
            for i, (stream, line) in enumerate(d.proc.lines)
            if stream == "stderr" and '"event": "server.launch"' in line
        ]
    ), "a server launched after the stop"
    st = d.status()
    assert st["state"] == "stopped" and st["pid"] is None and st["intent"]["running"] is False
    assert d.http.post("/start").status_code == 202
    d.wait_state("ready", after=stop_index)


def test_a_daemon_killed_mid_swap_resumes_it_as_a_swap(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    configs = two_configs(slow=standin_config(scale=0.3))
    d = start_daemon(
        procs, tmp_path, fake_gpu, configs, default="good", restart={"probation_s": 600}
    )
    d.wait_state("ready")
    first = d.status()["launch_id"]
    assert d.http.post("/restart", params={"config": "slow"}).status_code == 202
    d.wait_state("starting", config="slow")
    swap_id = d.status()["swap"]["id"]
    slow_launch = d.status()["launch_id"]
    wait_until(
        lambda: (
            (
                json.loads((tmp_path / "state" / "state.json").read_text())["current_launch"] or {}
            ).get("launch_id")
            == slow_launch
        ),
        10,
        "the new launch in state.json",
    )
    d.proc.signal(signal.SIGKILL)
    d.proc.wait(10)
    d2 = start_daemon(procs, tmp_path, fake_gpu, configs, default="good")
    resumed = d2.wait_event("server.swap_resumed")
    assert resumed["swap_id"] == swap_id and resumed["to_config"] == "slow"
    settled = d2.wait_event("server.swap_settled", swap_id=swap_id, timeout=60)
    assert settled["outcome"] == "ready"
    st = d2.status()
    assert st["config"] == "slow" and st["last_good_config"] == "good"  # probation runs again
    wait_recorded(  # every launch of both lives has an exit record
        tmp_path,
        "an exit for the first two launches",
        lambda ev: {first, slow_launch} <= {e.get("launch_id") for e in ev if e["event"] == "exit"},
    )
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    by_id = {h["launch_id"]: h for h in state["launches"]}
    # Stopped by this boot, or dead already (a loading server writing to the dead daemon's pipe
    # gets EPIPE): either way, on record.
    assert by_id[slow_launch]["exit"]["reason"] in ("requested_stop", "ended_unobserved")
    assert by_id[first]["exit"] is not None


def test_a_server_that_ended_while_the_daemon_was_away_gets_its_exit_record(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """The daemon and its shim are SIGKILLed, then the server: nothing recorded its exit (with
    the shim alive, its record gives the exact one: `test_shim_path.py`)."""
    d = start_daemon(procs, tmp_path, fake_gpu, {"base": standin_config()}, default="base")
    shim = d.wait_event("server.shim_connected")["pid"]
    d.wait_state("ready")
    old_pid, old_launch = d.status()["pid"], d.status()["launch_id"]
    wait_until(
        lambda: (
            (
                json.loads((tmp_path / "state" / "state.json").read_text())["current_launch"] or {}
            ).get("pid")
            == old_pid
        ),
        10,
        "the launch in state.json",
    )
    d.proc.signal(signal.SIGKILL)
    d.proc.wait(10)
    os.kill(shim, signal.SIGKILL)
    wait_until(lambda: not alive(shim), 10, "the shim gone")
    os.killpg(old_pid, signal.SIGKILL)
    wait_until(lambda: not alive(old_pid), 10, "the old server gone")
    d2 = start_daemon(procs, tmp_path, fake_gpu, {"base": standin_config()}, default="base")
    ex = d2.wait_event("server.exit", reason="ended_unobserved")
    assert ex["launch_id"] == old_launch and "while the daemon was away" in ex["evidence"]
    d2.wait_state("ready")
    wait_recorded(tmp_path, "the ended_unobserved exit", has_exit("ended_unobserved"))


def test_every_launch_whose_log_exists_is_found_by_its_id(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """A launch older than the history state.json keeps (or from a state file since lost) is
    still served by id; an id that is not one is 404, never a path."""
    d = start_daemon(procs, tmp_path, fake_gpu, {"base": standin_config()}, default="base")
    d.wait_state("ready")
    old = tmp_path / "logs" / "base" / "20250101T000000-000001.log"
    old.write_text("# gpuwarden launch 20250101T000000-000001\nold line api_key=sk-hidden\n")
    body = d.http.get("/logs", params={"launch": "20250101T000000-000001"}).json()
    assert body["config"] == "base" and body["log_file"] == str(old)
    assert any("old line" in line for line in body["lines"])
    assert "sk-hidden" not in json.dumps(body)
    for bad in ("20250101T000000-000002", "../base/20250101T000000-000001", "*"):
        assert d.http.get("/logs", params={"launch": bad}).status_code == 404
    current = d.status()["launch_id"]
    assert d.http.get("/logs", params={"launch": current}).json()["launch_id"] == current


def test_a_dead_detokenizer_ends_the_launch_on_sglangs_line(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """The stand-in, as SGLang 0.5.23 with its defaults, lingers for 60 s after a child died,
    its port open and requests hanging. The launch ends on SGLang's own line, its group
    SIGKILLed at once; the exit's evidence is that line; the restart policy follows."""
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"f": standin_config()},
        default="f",
        restart={"initial_delay_s": 0, "jitter": 0},
    )
    d.wait_state("ready")
    first = d.status()
    mark = d.mark()
    detokenizer = next(
        c for c in psutil.Process(first["pid"]).children() if c.name().startswith("sglang::detok")
    )
    detokenizer.kill()
    said = d.wait_event("server.death_announced", after=mark, timeout=20)
    assert re.fullmatch(
        r"Subprocess detokenizer \(pid=\d+\) crashed with exit code -9\. "
        r"Triggering SIGQUIT for cleanup\.\.\.",
        said["line"],
    )
    ex = d.wait_event("server.exit", after=mark, timeout=20)  # not after SGLang's 60 s
    assert (ex["reason"], ex["evidence"]) == ("crash", said["line"])
    assert not alive(first["pid"])
    d.wait_state("ready", after=ex["_index"], timeout=40)
    assert d.status()["launch_id"] != first["launch_id"]


def test_a_port_taken_while_the_server_loads_is_port_in_use_and_never_ready(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path, foreign_http: Callable[[int], Proc]
) -> None:
    """Another server takes the port after preflight, while the stand-in loads: its 200s (and
    the stand-in's ready line, printed off the other server's answers) are not this launch's."""
    port = free_port()
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"f": standin_config(port=port, scale=0.5)},
        default="f",
        restart={"initial_delay_s": 60},
    )
    d.wait_event("server.launch")
    foreign = foreign_http(port)
    ex = d.wait_event("server.exit", reason="port_in_use", timeout=40)
    assert f"127.0.0.1:{port} is held by pid {foreign.pid} (" in ex["evidence"]
    assert "not by this launch" in ex["evidence"]
    assert not [r for r in d.records() if r.get("event") == "server.state" and r["to"] == "ready"]
    assert d.status()["state"] == "backoff"


def counted_python(folder: Path) -> tuple[Path, Path]:
    """A Python interpreter that notes each run's start and end in a log ('start build PID',
    'end probe PID'); a parser build takes half a second more, as SGLang's imports do."""
    log = folder / "runs.log"
    wrapper = folder / "python3-counted"
    wrapper.write_text(
        "#!/bin/sh\n"
        'case "$2" in *_dump*) kind=build; sleep 0.5;; *) kind=probe;; esac\n'
        f'echo "start $kind $$" >> {log}\n'
        f'{PY} "$@"\n'
        "rc=$?\n"
        f'echo "end $kind $$" >> {log}\n'
        "exit $rc\n"
    )
    wrapper.chmod(0o755)
    return wrapper, log


def test_concurrent_preflights_share_one_parser_build(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """Twelve preflights at once each built the server's parser (5.8 GiB for SGLang's): now
    they share one build, and introspections run at most two at a time."""
    wrapper, runs = counted_python(tmp_path)
    cfg = standin_config(command=[str(wrapper), "-m", "gpuwarden.standin"])
    d = start_daemon(procs, tmp_path, fake_gpu, {"counted": cfg})
    with ThreadPoolExecutor(12) as pool:
        answers = list(
            pool.map(lambda _: d.http.post("/configs/counted/check", timeout=120), range(12))
        )
    assert [a.status_code for a in answers] == [200] * 12, [a.text for a in answers]
    assert all(a.json()["method"] == "parser" for a in answers)
    running, most, builds = 0, 0, 0
    for line in runs.read_text().splitlines():
        what, kind, _ = line.split()
        running += 1 if what == "start" else -1
        most = max(most, running)
        builds += what == "start" and kind == "build"
    assert builds == 1, runs.read_text()
    assert most <= 2, runs  # serverparser.MAX_INTROSPECTIONS.read_text()
    assert d.http.get("/healthz").status_code == 200


def test_idle_sockets_at_the_cap_lock_out_neither_probes_nor_a_stop(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """About 300 idle sockets from any local process held every connection slot: /healthz and
    /readyz answered 503 and `gpuwarden stop` failed. Waiting connections now make room."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1024:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    token_file = with_token(tmp_path)
    d = start_daemon(
        procs, tmp_path, fake_gpu, {"s": standin_config()}, default="s", token_file=token_file
    )
    d.http.headers["Authorization"] = f"Bearer {TOKEN}"
    d.wait_state("ready")
    with contextlib.ExitStack() as held:
        idle = [held.enter_context(connect(d)) for _ in range(300)]  # the cap is 256
        health = httpx.get(f"{d.url}/healthz", timeout=30)
        assert health.status_code == 200, health.text
        ready = httpx.get(f"{d.url}/readyz", timeout=30)
        assert ready.status_code == 200, ready.text
        stop = subprocess.run(
            [
                PY,
                "-m",
                "gpuwarden.api.cli",
                "--url",
                d.url,
                "--token-file",
                str(tmp_path / "token"),
                "stop",
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert stop.returncode == 0, stop.stderr
        d.wait_state("stopped")
        ready = httpx.get(f"{d.url}/readyz", timeout=30)
        assert ready.status_code == 503 and ready.json()["error"] == "not_ready", ready.text
        # Bounded still: the oldest idle sockets were closed to make room.
        readable = select.select(idle, [], [], 5)[0]
        assert len(readable) >= 300 - 256, len(readable)
        assert idle[0] in readable


def test_hostile_files_in_the_state_dir_are_refused_off_the_loop(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """A FIFO where a saved dump or a sweep's record should be froze the daemon (an open that
    waits for a writer, on the event loop); a 512 MiB file took it to 1.6 GB. Both are refused
    with an error that names the file and why, the memory stays put, and the probes answer."""
    dumps, sweeps = tmp_path / "state" / "dumps", tmp_path / "state" / "sweeps"
    dumps.mkdir(parents=True)
    os.mkfifo(dumps / "20260101T000000-crash.txt")
    with (dumps / "20260101T000001-crash.txt").open("wb") as f:
        f.truncate(512 * 1024 * 1024)  # sparse: no disk used
    for name in ("sweep-20260101T000000", "sweep-20260101T000001"):
        (sweeps / name).mkdir(parents=True)
    os.mkfifo(sweeps / "sweep-20260101T000000" / "result.json")
    with (sweeps / "sweep-20260101T000001" / "result.json").open("wb") as f:
        f.truncate(512 * 1024 * 1024)
    d = start_daemon(procs, tmp_path, fake_gpu, {})
    daemon = psutil.Process(d.proc.pid)
    rss_before = daemon.memory_info().rss

    def get(path: str) -> httpx.Response:
        res = d.http.get(path, timeout=20)  # the old daemon never answered: a timeout here
        assert d.http.get("/healthz", timeout=20).status_code == 200
        return res

    fifo = get("/dumps/20260101T000000-crash")
    assert fifo.status_code == 500 and fifo.json()["error"] == "unreadable", fifo.text
    assert "20260101T000000-crash.txt: not a regular file (a FIFO)" in fifo.json()["detail"]
    huge = get("/dumps/20260101T000001-crash")
    assert huge.status_code == 500 and "too large" in huge.json()["detail"], huge.text
    listing = get("/sweeps")
    assert listing.status_code == 200 and listing.json() == {"sweeps": []}, listing.text
    skipped = {
        r["folder"]: r["error"] for r in d.records() if r.get("event") == "sweep.record_unreadable"
    }
    assert "a FIFO" in skipped[str(sweeps / "sweep-20260101T000000")], skipped
    assert "too large" in skipped[str(sweeps / "sweep-20260101T000001")], skipped
    one = get("/sweeps/sweep-20260101T000000")
    assert one.status_code == 500 and "not a regular file (a FIFO)" in one.json()["detail"]
    assert get("/dumps").json()["dumps"] == ["20260101T000000-crash", "20260101T000001-crash"]
    # Nothing of the big files was read: far below the 512 MiB they would take.
    assert daemon.memory_info().rss < rss_before + 128 * 1024 * 1024


class OpenCounter:
    """Counts the opens of one file by any process (inotify), read after each action so that
    the kernel never merges two of them into one event."""

    IN_OPEN = 0x20

    def __init__(self, path: Path) -> None:
        import ctypes  # noqa: PLC0415

        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0, ctypes.get_errno()
        assert self.libc.inotify_add_watch(self.fd, os.fsencode(path), self.IN_OPEN) >= 0
        self.opens = 0

    def drain(self) -> int:
        with contextlib.suppress(BlockingIOError):
            while data := os.read(self.fd, 65536):
                at = 0
                while at < len(data):
                    _, mask, _, size = struct.unpack_from("iIII", data, at)
                    self.opens += bool(mask & self.IN_OPEN)
                    at += 16 + size
        return self.opens

    def close(self) -> None:
        os.close(self.fd)


def test_a_broken_config_is_read_once_until_it_changes(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """A config that fails was read again by every request that named it (~4 s each for a
    0.9 MB one); its failure is now kept until one of its files changes."""
    d = start_daemon(procs, tmp_path, fake_gpu, {})
    path = tmp_path / "configs" / "broken.yaml"
    args = "".join(f"  k{i}: {'v' * 36}\n" for i in range(20_000))  # about 0.9 MB
    path.write_text(f"args:\n{args}health: {{interval_s: soon}}\n")
    opens = OpenCounter(path)
    try:
        for _ in range(5):
            res = d.http.get("/configs/broken")
            assert res.status_code == 422 and "health.interval_s" in res.json()["detail"]
            opens.drain()
        assert opens.opens == 1
        path.write_text("args: {port: 1}\n")  # fixed: read again
        assert d.http.get("/configs/broken").status_code == 200
        assert opens.drain() == 2
    finally:
        opens.close()


def test_big_log_answers_are_built_off_the_loop(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """Twenty `/logs?lines=100000` at once masked and encoded their lines on the event loop
    (/healthz waited 6.9 s). The work is on threads now: the loop's thread does a small part of
    it, and /healthz answers while those requests are in flight."""
    d = start_daemon(procs, tmp_path, fake_gpu, {})
    launch = "20260101T000000-000001"
    (tmp_path / "logs" / "old").mkdir(parents=True)
    line = "[2026-01-01 00:00:00] Decode batch, api_key=sk-0123456789 #token: 86, gen 90\n"
    (tmp_path / "logs" / "old" / f"{launch}.log").write_text(line * 50_000)
    daemon = psutil.Process(d.proc.pid)

    def cpu() -> tuple[float, float]:
        threads = daemon.threads()
        loop = sum(t.user_time + t.system_time for t in threads if t.id == daemon.pid)
        return loop, sum(t.user_time + t.system_time for t in threads)

    def big(_: int) -> int:
        res = d.http.get("/logs", params={"launch": launch, "lines": 100_000}, timeout=120)
        assert res.status_code == 200 and len(res.json()["lines"]) == 50_000
        assert "sk-0123456789" not in res.text
        return res.status_code

    loop_before, all_before = cpu()
    with ThreadPoolExecutor(20) as pool:
        answers = [pool.submit(big, i) for i in range(20)]
        health = d.http.get("/healthz", timeout=60)
        assert health.status_code == 200
        assert [a.result() for a in answers] == [200] * 20
    loop_after, all_after = cpu()
    assert loop_after - loop_before < 0.5 * (all_after - all_before), (
        loop_after - loop_before,
        all_after - all_before,
    )


def sweep_ended(d: Daemon, sid: str, timeout: float = 90) -> dict[str, Any]:
    """The sweep's view once its whole answer is in (the restore included)."""
    wait_until(
        lambda: d.http.get(f"/sweeps/{sid}").json().get("ended_at") is not None,
        timeout,
        f"sweep {sid} to end",
        step=0.1,
    )
    view: dict[str, Any] = d.http.get(f"/sweeps/{sid}").json()
    return view


def test_a_server_that_crashes_during_its_sweep_load_is_failed_and_cannot_win(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """The config's scheduler dies 2 s into its 4 s load (its first requests were answered):
    the row is failed with the reason, the config cannot win, and its rollback is waited for
    before the restore. Before, a row was ok when any request was answered."""
    port = free_port()
    cfgs = {
        "base": standin_config(port=port),
        "crashy": standin_config("--standin-crash-after=2", port=port),
    }
    d = start_daemon(procs, tmp_path, fake_gpu, cfgs, default="base")
    d.wait_state("ready")
    body = {"configs": ["crashy", "base"], "requests": 12, "warmup": 0, "max_tokens": 30}
    sid = d.http.post("/sweeps", json=body).json()["id"]
    view = sweep_ended(d, sid)
    rows = {r["config"]: r for r in view["rows"]}
    crashy = rows["crashy"]
    assert crashy["requests_ok"] >= 1, crashy  # answered before the crash: ok, before
    assert crashy["status"] == "failed" and crashy["reason"] == "server_crashed", crashy
    assert f"launch {crashy['launch_id']} did not serve the whole load" in crashy["evidence"]
    assert rows["base"]["status"] == "ok", rows["base"]
    assert view["winner"] == "base" and view["restored"] == "base", view
    assert d.status()["config"] == "base" and d.status()["state"] == "ready"
    assert d.status()["last_good_config"] == "base"


def test_a_malformed_stream_chunk_fails_its_row_and_the_sweep_goes_on_and_restores(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """Servers whose streams begin with `data: 1` (a JSON non-object) or `data: not-json`:
    each request fails with the reason, the sweep goes on and the previous config serves
    again. Before, `data: 1` raised out of the load: the sweep failed and nothing restored."""
    port = free_port()
    cfgs = {
        "base": standin_config(port=port),
        "one": standin_config("--standin-malformed-chunk=1", port=port),
        "text": standin_config("--standin-malformed-chunk=not-json", port=port),
    }
    d = start_daemon(procs, tmp_path, fake_gpu, cfgs, default="base")
    d.wait_state("ready")
    body = {"configs": ["one", "text"], "requests": 2, "warmup": 0, "max_tokens": 10}
    sid = d.http.post("/sweeps", json=body).json()["id"]
    view = sweep_ended(d, sid)
    assert view["state"] == "done", view
    rows = {r["config"]: r for r in view["rows"]}
    assert [r["status"] for r in view["rows"]] == ["failed", "failed"], view["rows"]
    assert rows["one"]["reason"] == "load_failed"
    assert "a stream chunk is not a JSON object: '1'" in rows["one"]["evidence"], rows["one"]
    assert "a stream chunk is not JSON: 'not-json'" in rows["text"]["evidence"], rows["text"]
    assert rows["one"]["requests_failed"] == 2 and view["winner"] is None
    assert view["restored"] == "base"
    assert d.status()["config"] == "base" and d.status()["state"] == "ready"


def test_a_daemon_killed_mid_sweep_serves_the_original_again_and_keeps_its_last_good(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """SIGKILL while the sweep measures `b` (probation 0: a swap is last-good once ready):
    `b` never becomes last-good, and the next life lists the sweep as interrupted and starts
    `base` again. Before, `b` was last-good and served on."""
    port = free_port()
    cfgs = {"base": standin_config(port=port), "b": standin_config(port=port)}
    setup = {"default": "base", "restart": {"probation_s": 0}}
    d = start_daemon(procs, tmp_path, fake_gpu, cfgs, **setup)
    d.wait_state("ready")
    body = {"configs": ["b"], "requests": 100, "warmup": 0, "max_tokens": 200}
    sid = d.http.post("/sweeps", json=body).json()["id"]
    d.wait_event("server.sweep_progress", sweep_id=sid, config="b")
    wait_until(
        lambda: (st := d.status())["config"] == "b" and st["state"] == "ready",
        30,
        "b to serve",
        step=0.05,
    )
    assert d.status()["last_good_config"] == "base"
    old_pid = d.status()["pid"]
    d.proc.signal(signal.SIGKILL)
    d.proc.wait(10)
    again = start_daemon(procs, tmp_path, fake_gpu, cfgs, **setup)
    said = again.wait_event("server.sweep_interrupted", sweep_id=sid)
    assert said["restore_to"] == "base"
    again.wait_state("ready", timeout=60)
    st = again.status()
    assert (st["config"], st["last_good_config"]) == ("base", "base"), st
    assert not alive(old_pid)
    listed = {s["id"]: s for s in again.http.get("/sweeps").json()["sweeps"]}
    assert listed[sid]["state"] == "interrupted"
    assert again.http.post("/restart", params={"config": "base"}).status_code == 202


def vm_hwm_bytes(pid: int) -> int:
    """The peak resident set of a process (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_sweep_reads_a_400_mib_line_with_no_newline_within_a_bound(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """A measured server streams `data: ` and 400 MiB with no newline: the request fails on
    the line's cap, and the daemon's peak memory stays far below the line. Before, the line was
    read whole (124 MB -> 1.28 GB)."""
    port = free_port()
    hostile = {
        "command": [PY, str(Path(__file__).with_name("hostile_http.py"))],
        "args": {"port": port, "line-mib": 400},
        "health": {"startup_timeout_s": 30, "interval_s": 0.2, "timeout_s": 2, "failures": 3},
    }
    cfgs = {"base": standin_config(), "hostile": hostile}
    d = start_daemon(procs, tmp_path, fake_gpu, cfgs, default="base")
    d.wait_state("ready")
    body = {"configs": ["hostile"], "requests": 1, "warmup": 0, "max_tokens": 10}
    sid = d.http.post("/sweeps", json=body).json()["id"]
    view = sweep_ended(d, sid)
    row = view["rows"][0]
    assert row["status"] == "failed" and row["reason"] == "load_failed", row
    assert "a line of the stream is longer than 1048576 bytes" in row["evidence"], row
    peak = vm_hwm_bytes(d.proc.pid)
    assert peak < 350 * (1 << 20), f"the daemon's peak RSS was {peak >> 20} MiB"
    assert view["restored"] == "base" and d.status()["config"] == "base"


def test_token_file_replaced_by_a_fifo_or_a_huge_file_keeps_the_token(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, {}, token_file=with_token(tmp_path))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    token = tmp_path / "token"
    mark = d.mark()
    token.unlink()
    os.mkfifo(token)  # no writer: a plain read would block the control plane for good
    assert d.http.get("/status", headers=auth, timeout=10).status_code == 200
    d.wait_event("api.token_unreadable", after=mark)
    token.unlink()
    token.write_bytes(b"x" * (1024 * 1024))
    assert d.http.get("/status", headers=auth, timeout=10).status_code == 200
    token.write_text("next-token\n")
    assert d.http.get("/status", headers={"Authorization": "Bearer next-token"}).status_code == 200


def test_secret_salt_that_is_a_fifo_blocks_nothing(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    (tmp_path / "state").mkdir(parents=True, exist_ok=True)
    os.mkfifo(tmp_path / "state" / "secret-salt")  # no writer: a plain read blocks for good
    d = start_daemon(procs, tmp_path, fake_gpu, {"svc": standin_config()}, default="svc")
    d.wait_state("ready")
    assert d.http.get("/logs").status_code == 200
    assert (tmp_path / "state" / "secret-salt").is_fifo()  # left alone


def test_server_crashed_with_an_unwritable_dumps_folder_answers_the_dump_unsaved(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """The dumps folder is a regular file (root ignores permissions; a file in its place stops
    anyone): 'server crashed' still answers 200 with the whole dump, says it was not saved and
    why, and the daemon goes on."""
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"oom": standin_config("--standin-crash-on-load=cuda_oom")},
        default="oom",
        restart={"initial_delay_s": 60},
    )
    d.wait_state("backoff", reason="cuda_oom")
    (tmp_path / "state" / "dumps").write_text("not a folder\n")
    res = d.http.post("/chat", json={"text": "server crashed"})
    assert res.status_code == 200, res.text
    body = res.json()
    assert body["saved"] is None
    assert "File exists" in body["not_saved"] and "dumps" in body["not_saved"]
    assert body["dump"]["last_exit"]["reason"] == "cuda_oom"
    assert "last exit: cuda_oom" in body["text"]
    assert f"(this dump was not saved: {body['not_saved']})" in body["text"]
    assert "GET /dumps/" not in body["text"]
    assert (tmp_path / "state" / "dumps").read_text() == "not a folder\n"
    mark = d.mark()
    assert d.http.post("/restart").status_code == 202
    d.wait_event("server.exit", after=mark, reason="cuda_oom", timeout=30)
    assert d.status()["state"] == "backoff"


def test_a_flood_keeps_the_running_log_within_its_cap_with_head_tail_and_gap(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """A server that writes 1.4 MB of lines under a 256 KiB `log_retention.max_bytes`: the
    running launch's file stays within the cap (and one read chunk), keeps its header and
    startup, the latest lines, and one line saying how much of the middle was dropped."""
    cap = 256 * 1024
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"f": standin_config("--standin-flood=20000", health={"interval_s": 600})},
        default="f",
        log_retention={"max_bytes": cap},
    )
    d.wait_state("ready")
    log_file = Path(d.status()["log_file"])
    wait_until(lambda: b"flood done: 20000 lines" in log_file.read_bytes()[-200:], 60, "the flood")
    data = log_file.read_bytes()
    assert len(data) <= cap + 64 * 1024, len(data)
    text = data.decode()
    assert text.startswith("# ")  # gpuwarden's header
    assert "The server is fired up and ready to roll!" in text  # the startup stays
    assert "flood line 00019999 " in text  # the latest lines stay
    gaps = re.findall(r"# gpuwarden: (\d+) bytes of output dropped here: ", text)
    assert len(gaps) == 1, gaps
    kept = len(re.findall(r"flood line \d{8} ", text))
    assert 0 < kept < 20000
    assert int(gaps[0]) >= (20000 - kept) * 60  # about what went (each line is ~70 bytes)
    assert "flood line 00000000 " not in text.split("bytes of output dropped here")[1]
    assert d.status()["state"] == "ready"


def test_retention_after_the_clock_went_back_removes_the_oldest_launches_first(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """Four launches on record whose ids carry a time in 2099 (made before the wall clock went
    back): the launches made now carry earlier times, yet they are the newest. Retention
    (3 launches) removes the 2099 ones, never the newest."""
    old = [f"20990101T00000{i}-00000{i}" for i in range(1, 5)]
    logs = tmp_path / "logs" / "f"
    logs.mkdir(parents=True)
    for launch_id in old:
        (logs / f"{launch_id}.log").write_text(f"# gpuwarden launch {launch_id}\n")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.json").write_text(
        json.dumps(
            {
                "intent": {"config": "f", "running": True},
                "last_good_config": "f",
                "last_good_launch": old[-1],
                "launch_seq": 4,
                "launches": [
                    {
                        "launch_id": launch_id,
                        "config": "f",
                        "pid": 1,
                        "started_at": "2099-01-01T00:00:00.000Z",
                        "ready_at": None,
                        "log_file": str(logs / f"{launch_id}.log"),
                        "exit": {"reason": "stopped", "code": 0},
                    }
                    for launch_id in old
                ],
            }
        )
    )
    d = start_daemon(
        procs, tmp_path, fake_gpu, {"f": standin_config()}, log_retention={"launches": 3}
    )
    d.wait_state("ready")
    new = [d.status()["launch_id"]]
    for _ in range(2):
        mark = d.mark()
        assert d.http.post("/restart").status_code == 202
        d.wait_state("ready", after=mark)
        new.append(d.status()["launch_id"])
    assert [n[-6:] for n in new] == ["000005", "000006", "000007"]
    assert all(n < old[0] for n in new)  # their ids' times are earlier than the old ones'
    wait_until(
        lambda: sorted(p.stem for p in logs.glob("*.log")) == sorted(new),
        20,
        f"only the newest launches kept: {sorted(p.stem for p in logs.glob('*.log'))}",
    )


def _seqs(path: Path) -> list[int]:
    return [int(json.loads(x).get("seq") or 0) for x in path.read_text().splitlines() if x]


def test_events_jsonl_moved_or_deleted_while_running_goes_on_in_a_new_file(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """events.jsonl moved away (logrotate without copytruncate), then deleted: each time the
    next event goes to a new events.jsonl, its seq following on, and nothing more is written
    to the old file."""
    d = start_daemon(procs, tmp_path, fake_gpu, {"f": standin_config()}, default="f")
    d.wait_state("ready")
    path = tmp_path / "state" / "events.jsonl"
    wait_recorded(tmp_path, "ready", lambda ev: any(e.get("to") == "ready" for e in ev))
    moved = path.with_name("events.jsonl.1")
    path.rename(moved)
    before = moved.read_bytes()
    last = max(_seqs(moved))
    mark = d.mark()
    assert d.http.post("/restart").status_code == 202
    d.wait_state("ready", after=mark)
    wait_recorded(tmp_path, "the restart", lambda ev: any(e.get("to") == "ready" for e in ev))
    assert moved.read_bytes() == before  # the old file got nothing more
    seqs = _seqs(path)
    assert min(seqs) == last + 1 and seqs == sorted(seqs)
    last = max(seqs)
    path.unlink()
    mark = d.mark()
    assert d.http.post("/stop").status_code == 202
    d.wait_state("stopped", after=mark)
    wait_recorded(tmp_path, "the stop", lambda ev: any(e.get("to") == "stopped" for e in ev))
    assert min(_seqs(path)) == last + 1
    assert [e["seq"] for e in d.http.get("/events").json()["events"]][-1] == max(_seqs(path))


def test_seq_goes_on_after_a_restart_without_events_jsonl(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """events.jsonl deleted while the daemon is away: the next life's events go on from the
    last seq (state.json records it), never from 1 again."""
    d = start_daemon(procs, tmp_path, fake_gpu, {"f": standin_config()}, default="f")
    d.wait_state("ready")
    last = d.http.get("/events").json()["events"][-1]["seq"]
    assert last > 1
    d.proc.signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0
    path = tmp_path / "state" / "events.jsonl"
    last = max([last, *_seqs(path)])
    path.unlink()
    d2 = start_daemon(procs, tmp_path, fake_gpu, {"f": standin_config()}, default="f")
    d2.wait_state("ready")
    wait_recorded(tmp_path, "ready", lambda ev: any(e.get("to") == "ready" for e in ev))
    assert min(_seqs(path)) == last + 1
    assert d2.http.get("/events").json()["events"][0]["seq"] == last + 1


def test_a_config_file_garbled_or_removed_while_its_server_crash_loops_keeps_it_relaunched(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """Before: the retry after a crash read the file again, and a file half-written or missing
    just then sent the daemon to `failed` for good (`preflight_refused`); fixing the file
    brought nothing back. Now the relaunch of the config that was running uses that launch's
    resolution (a `config_unreadable` event says so), and the next retry reads the file
    again."""
    cfg = standin_config("--standin-crash-on-load=cuda_oom")
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"loop": cfg},
        default="loop",
        restart={"initial_delay_s": 1.0, "max_delay_s": 1.0},
    )
    first = d.wait_event("server.launch")
    path = tmp_path / "configs" / "loop.yaml"
    for fault in ("garbage", "removed"):
        mark = d.mark()
        if fault == "garbage":
            path.write_text("args: [model-path: {unclosed\n")  # as a crash mid-write leaves it
        else:
            path.unlink()
        said = d.wait_event("server.config_unreadable", after=mark, timeout=30)
        assert said["config"] == "loop" and said["level"] == "warning"
        assert ("invalid YAML" if fault == "garbage" else "unknown config") in said["error"]
        again = d.wait_event("server.launch", after=said["_index"], timeout=30)
        assert again["argv"] == first["argv"]  # the resolution that was running
        st = d.status()
        assert st["state"] != "failed" and st["intent"] == {"config": "loop", "running": True}
    assert not [line for _, line in d.proc.lines if '"server.preflight_refused"' in line]

    # The file fixed: the next retry reads it, and its server comes up.
    mark = d.mark()
    path.write_text(yaml.safe_dump(standin_config(port=cfg["args"]["port"])))
    fixed = d.wait_event("server.launch", after=mark, timeout=30)
    assert "--standin-crash-on-load" not in fixed["argv"]
    d.wait_state("ready", after=fixed["_index"], timeout=30)
    events = d.http.get("/events", params={"limit": 500}).json()["events"]
    assert [e["event"] for e in events].count("config_unreadable") >= 2  # recorded for good
