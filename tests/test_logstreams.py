"""`/logs/stream` readers cost the capture path nothing: clients that stop reading, that
disconnect, or that fall behind the ring, against a real daemon and a server that floods."""

from __future__ import annotations

import http.client
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from .support.configs import standin_config
from .support.daemon import start_daemon
from .support.http import stalled_stream, streams
from .support.procs import PY, Proc, wait_until

# A server that floods numbered lines: it says it is ready, waits for GO, then writes until
# STOP exists (or LIMIT lines), about 200k lines/s, and ends with "flood done: N lines".
FLOOD = r"""
import os, sys, time
go, stop, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
print("[2026-01-01 00:00:00] The server is fired up and ready to roll!", flush=True)
while not os.path.exists(go):
    time.sleep(0.005)
out = open(1, "wb", buffering=1 << 16, closefd=False)
n, t0 = 0, time.monotonic()
while n < limit and not (stop and os.path.exists(stop)):
    out.write(b"".join(b"flood %09d\n" % i for i in range(n, n + 2000)))
    n += 2000
    ahead = n / 200_000 - (time.monotonic() - t0)
    if ahead > 0:
        time.sleep(ahead)
out.write(b"flood done: %d lines\n" % n)
out.flush()
time.sleep(3600)
"""
FLOOD_LINE = re.compile(rb"^flood (\d{9})$", re.M)


def flood_config(go: Path, stop: Path | None, limit: int = 20_000_000) -> dict[str, Any]:
    return {
        "command": [PY, "-c", FLOOD, str(go), str(stop or ""), str(limit)],
        "env": {"CUDA_VISIBLE_DEVICES": "0"},
        # Ready by its ready line; no liveness probe within the test.
        "health": {"url": "http://127.0.0.1:9/health", "startup_timeout_s": 60, "interval_s": 600},
    }


class SlowReader:
    """An SSE client over a socket with a tiny receive buffer: it reads only when told."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(30)
        sock.connect((host, int(port)))
        self.conn = http.client.HTTPConnection(host, int(port), timeout=30)
        self.conn.sock = sock
        self.conn.request("GET", "/logs/stream")
        self.res = self.conn.getresponse()
        assert self.res.status == 200

    def events(self) -> Iterator[tuple[str, str]]:
        event = "message"
        while raw := self.res.readline():
            line = raw.decode().rstrip("\r\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                yield event, line[6:]
            elif not line:
                event = "message"

    def close(self) -> None:
        self.conn.close()


def flood_lines(path: Path) -> list[int]:
    return [int(m.group(1)) for m in FLOOD_LINE.finditer(path.read_bytes())]


def grown(path: Path, lines: int) -> Any:
    """A predicate: the log has grown by about `lines` flood lines (16 bytes each) from now."""
    start = path.stat().st_size
    return lambda: path.stat().st_size - start >= lines * 16


def test_stalled_streams_that_disconnect_end_at_once_and_the_log_keeps_every_line(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    go, stop = tmp_path / "go", tmp_path / "stop"
    d = start_daemon(procs, tmp_path, fake_gpu, {"flood": flood_config(go, stop)}, default="flood")
    d.wait_state("ready")
    log_file = Path(d.status()["log_file"])
    clients = [stalled_stream(d.url) for _ in range(10)]
    wait_until(lambda: streams(d) == 10, 10, "ten open streams")
    go.touch()
    # Far more than ten sockets' buffers hold: every client has stopped taking lines.
    wait_until(grown(log_file, 400_000), 60, "the flood to outrun the clients")
    for sock in clients:
        sock.close()
    # The flood goes on (it stops only at STOP), and the streams end anyway.
    wait_until(lambda: streams(d) == 0, 10, "the streams of the closed clients to end")
    assert not stop.exists()
    wait_until(grown(log_file, 100_000), 60, "capture to go on after the clients left")
    stop.touch()
    wait_until(lambda: b"flood done" in log_file.read_bytes()[-100:], 60, "the end of the flood")
    total = int(re.search(rb"flood done: (\d+) lines", log_file.read_bytes()[-100:])[1])  # type: ignore[index]
    assert flood_lines(log_file) == list(range(total))  # every line, in order, once
    text = d.http.get("/metrics").text
    assert "gpuwarden_log_streams 0.0" in text


def test_a_slow_reader_is_told_how_many_lines_it_lost_then_gets_the_current_ones(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    go = tmp_path / "go"
    n = 500_000  # far more than the reader's socket buffers and the ring hold together
    cfg = flood_config(go, None, limit=n)
    d = start_daemon(procs, tmp_path, fake_gpu, {"flood": cfg}, default="flood")
    d.wait_state("ready")
    log_file = Path(d.status()["log_file"])
    reader = SlowReader(d.url)
    try:
        wait_until(lambda: streams(d) == 1, 10, "the stream to open")
        go.touch()
        wait_until(
            lambda: f"flood done: {n} lines".encode() in log_file.read_bytes()[-100:],
            60,
            "the flood to end before the reader reads",
        )
        got: list[str] = []
        drops: list[tuple[int, int]] = []  # (lines received before the notice, lines dropped)
        for event, data in reader.events():
            if event == "dropped":
                m = re.fullmatch(r"(\d+) lines dropped \(slow reader\)", data)
                assert m, data
                drops.append((len(got), int(m[1])))
            else:
                assert event == "line", (event, data)
                got.append(data)
                if data.startswith("flood done"):
                    break
    finally:
        reader.close()
    assert drops, "no dropped-lines notice"
    assert got[-1] == f"flood done: {n} lines"
    numbers = [int(x.split()[1]) for x in got[:-1]]
    assert numbers == sorted(set(numbers))  # in order, none twice
    first = drops[0][0]
    assert numbers[:first] == list(range(first))  # what its socket took before it stalled
    # After the last notice the reader has the current lines, to the end of the flood.
    last = drops[-1][0]
    assert numbers[last:] == list(range(numbers[last], n))
    # Every line is either received or counted as dropped.
    assert len(got) + sum(k for _, k in drops) == n + 1
    assert flood_lines(log_file) == list(range(n))  # the log file has them all
    wait_until(lambda: streams(d) == 0, 10, "the stream to end with its client")


def test_a_client_that_stops_reading_is_dropped_after_send_timeout(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    go, stop = tmp_path / "go", tmp_path / "stop"
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"flood": flood_config(go, stop)},
        default="flood",
        log_stream={"send_timeout_s": 1},
    )
    d.wait_state("ready")
    log_file = Path(d.status()["log_file"])
    sock = stalled_stream(d.url)
    try:
        wait_until(lambda: streams(d) == 1, 10, "the stream to open")
        go.touch()
        wait_until(grown(log_file, 400_000), 60, "the flood to outrun the client")
        # The client is still connected; the daemon gives up on it.
        wait_until(lambda: streams(d) == 0, 30, "the stalled stream to be dropped")
        dropped = d.wait_event("api.log_stream_dropped")
        assert "read nothing for 1 s" in dropped["detail"]
        # What the socket holds is all there is: reading it to the end reaches the close.
        total = 0
        while chunk := sock.recv(1 << 20):
            total += len(chunk)
        assert 0 < total < 32 * 2**20
    finally:
        sock.close()
        stop.touch()
    assert d.status()["state"] == "ready"


def test_a_stream_follows_the_next_launch(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, {"s": standin_config()}, default="s")
    d.wait_state("ready")
    first = d.status()["launch_id"]
    with httpx.stream("GET", f"{d.url}/logs/stream", timeout=30) as res:
        lines = res.iter_lines()
        assert (
            d.http.post("/restart", params={"wait": "true", "probation": "false"}).json()["outcome"]
            == "ready"
        )
        assert d.status()["launch_id"] != first
        for raw in lines:  # the restarted server's start, on the same stream
            if raw.startswith("data: ") and "fired up and ready" in raw:
                break
