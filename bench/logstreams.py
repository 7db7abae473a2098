"""Log capture while `/logs/stream` clients have stopped reading, and after they have gone.

    python bench/logstreams.py [--seconds S] [--clients 0,10,50]    (Linux: reads `ss`)

For each client count K a real `gpuwarden serve` runs a writer that floods 80-byte lines as
fast as its pipe takes them for S seconds, twice: first while K clients hold `/logs/stream`
open and read nothing, then while those clients close their sockets a moment into the flood
(they leave while the server is logging, as they do in life). Before the first flood the
writer floods, unmeasured, until the daemon's send queues to the clients (`ss`) have stopped
growing: the kernel takes a few MB per connection before a send blocks, and only then is a
client truly stalled.

Printed per K and phase: the writer's lines/s (and its ratio to the same writer straight to a
file, measured in this run: the floor), the daemon's CPU seconds per 100k lines, `/status`
latency p50/p99 sampled during the phase, the lines the launch log holds against the lines
written, and the streams the daemon counts (`gpuwarden_log_streams`, where the daemon has that
gauge) right after the clients closed and at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from core import PY, Daemon, config, pct

# Phase 0 writes until STOP.0 exists, phases 1 and 2 for S seconds each; phase i starts when
# GO.i exists and ends by writing COUNT.i (the lines it wrote) and then WALL.i.
WRITER = """
import os, sys, time
seconds, folder = float(sys.argv[1]), sys.argv[2]
line = b"x" * 79 + b"\\n"
out = open(1, "wb", buffering=1 << 16, closefd=False)
for phase in (0, 1, 2):
    while not os.path.exists(os.path.join(folder, f"go.{phase}")):
        time.sleep(0.005)
    t0 = time.perf_counter()
    count = 0
    end = t0 + seconds
    while (time.perf_counter() < end) if phase else not os.path.exists(
        os.path.join(folder, "stop.0")
    ):
        for _ in range(1000):
            out.write(line)
        count += 1000
    out.flush()
    with open(os.path.join(folder, f"count.{phase}"), "w") as f:
        f.write(str(count))
    wall = time.perf_counter() - t0
    with open(os.path.join(folder, f"wall.{phase}.tmp"), "w") as f:
        f.write(f"{wall:.6f}")
    os.replace(os.path.join(folder, f"wall.{phase}.tmp"), os.path.join(folder, f"wall.{phase}"))
time.sleep(3600)
"""

LINE = b"x" * 79 + b"\n"


def wait_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.02)


def stalled_client(url: str) -> socket.socket:
    """Opens /logs/stream, reads the response head, then never reads again."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(f"GET /logs/stream HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    head = b""
    sock.settimeout(10)
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        if not chunk:
            raise RuntimeError("the daemon closed /logs/stream at once")
        head += chunk
    if b" 200 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"/logs/stream answered {head[:80]!r}")
    return sock


def settle(log_file: Path, lines: int, timeout: float) -> int:
    """The lines in the log once it holds `lines` (or at the timeout): the daemon may still
    be draining the pipe when the writer is done."""
    deadline = time.monotonic() + timeout
    while True:
        captured = log_file.read_bytes().count(LINE)
        if captured >= lines or time.monotonic() > deadline:
            return captured
        time.sleep(0.1)


def send_queues_full(port: int, clients: int, timeout: float) -> None:
    """Wait until the daemon's send queues to its stream clients stop growing."""
    deadline = time.monotonic() + timeout
    last = -1
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["ss", "-tnH", "state", "established", f"sport = :{port}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        # The largest queues are the stalled clients' (the /status sampler's stays near 0).
        queues = sorted((int(row.split()[1]) for row in out), reverse=True)[:clients]
        total = sum(queues)
        if len(queues) == clients and all(queues) and total == last:
            return
        last = total
        time.sleep(1.0)
    raise TimeoutError("the send queues to the stalled clients never settled")


def streams_gauge(http: httpx.Client) -> float | None:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("gpuwarden_log_streams "):
            return float(line.split()[1])
    return None


class StatusSampler:
    """GET /status every 20 ms from a thread; latencies kept per phase."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.phase: str | None = None
        self.samples: dict[str, list[float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60, trust_env=False) as c:
            while not self._stop.is_set():
                phase = self.phase
                t0 = time.perf_counter()
                with contextlib.suppress(httpx.HTTPError):
                    c.get("/status").raise_for_status()
                    if phase is not None and phase == self.phase:
                        self.samples.setdefault(phase, []).append(time.perf_counter() - t0)
                self._stop.wait(0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(60)


def phase_result(folder: Path, phase: int) -> tuple[int, float]:
    """(lines written, wall seconds) of a writer's phase."""
    wait_file(folder / f"wall.{phase}", 900)
    return int((folder / f"count.{phase}").read_text()), float(
        (folder / f"wall.{phase}").read_text()
    )


def floor(seconds: float, tmp: Path) -> float:
    """The writer straight to a file: lines/s of phase 1."""
    folder = tmp / "floor"
    folder.mkdir()
    for name in ("go.0", "stop.0", "go.1", "go.2"):
        (folder / name).touch()
    script = tmp / "writer.py"
    script.write_text(WRITER)
    with (folder / "out").open("wb") as out:
        proc = subprocess.Popen([PY, str(script), str(seconds), str(folder)], stdout=out)
        try:
            count, wall = phase_result(folder, 1)
        finally:
            proc.kill()
            proc.wait()
    return count / wall


def run(clients: int, seconds: float, tmp: Path) -> dict[str, Any]:
    root = tmp / f"k{clients}"
    folder = root / "writer"
    folder.mkdir(parents=True)
    d = Daemon(root, {"flood": config(WRITER, str(seconds), str(folder))}, "flood")
    out: dict[str, Any] = {"clients": clients}
    socks: list[socket.socket] = []
    sampler = StatusSampler(d.url)
    try:
        recs = d.wait_for(lambda r: any(x.get("event") == "server.launch" for x in r))
        log_file = Path(next(x for x in recs if x.get("event") == "server.launch")["log_file"])
        proc = psutil.Process(d.proc.pid)
        socks = [stalled_client(d.url) for _ in range(clients)]
        (folder / "go.0").touch()
        if clients:
            send_queues_full(int(d.url.rsplit(":", 1)[1]), clients, 600)
        (folder / "stop.0").touch()
        written, _ = phase_result(folder, 0)
        settle(log_file, written, 600)
        for phase in (1, 2):
            name = "stalled" if phase == 1 else "after_close"
            cpu0 = sum(proc.cpu_times()[:2])
            sampler.phase = name
            (folder / f"go.{phase}").touch()
            if phase == 2:
                # The clients go while the server is logging, as they do in life.
                settle(log_file, written + 1000, 60)
                for s in socks:
                    s.close()
                socks = []
                out["streams_after_close"] = streams_gauge(d.http)
            count, wall = phase_result(folder, phase)
            sampler.phase = None
            written += count
            # The daemon is done with the phase once the log holds it (the pipe may hold more).
            settle(log_file, written, 900)
            cpu = sum(proc.cpu_times()[:2]) - cpu0
            lat = sampler.samples.get(name, [])
            out[name] = {
                "lines_s": count / wall,
                "cpu_s_per_100k": cpu / count * 100_000,
                "status_p50_s": statistics.median(lat) if lat else float("nan"),
                "status_p99_s": pct(lat, 0.99),
                "status_n": len(lat),
            }
        out["captured"] = settle(log_file, written, 60)
        out["written"] = written
        out["streams_at_end"] = streams_gauge(d.http)
    finally:
        sampler.close()
        for s in socks:
            s.close()
        d.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0, help="each measured flood")
    ap.add_argument("--clients", default="0,10,50")
    args = ap.parse_args()
    counts = [int(k) for k in args.clients.split(",")]
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        base = floor(args.seconds, tmp)
        rows = []
        for k in counts:
            print(f"... {k} stalled clients", file=sys.stderr, flush=True)
            rows.append(run(k, args.seconds, tmp))
    print(f"floor: the writer straight to a file, {base:,.0f} lines/s")
    print()
    print(
        "| clients | phase | lines/s | vs floor | daemon CPU s/100k lines "
        "| /status p50 | /status p99 | samples |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for name in ("stalled", "after_close"):
            p = r[name]
            print(
                f"| {r['clients']} | {name} | {p['lines_s']:,.0f} | {p['lines_s'] / base:.2f} "
                f"| {p['cpu_s_per_100k']:.3f} | {p['status_p50_s'] * 1000:.1f} ms "
                f"| {p['status_p99_s'] * 1000:.1f} ms | {p['status_n']} |"
            )
    print()
    print("| clients | lines in the log / written | streams counted after close | at the end |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['clients']} | {r['captured']:,} / {r['written']:,} "
            f"| {r['streams_after_close']} | {r['streams_at_end']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
