"""Supervisor-core figures: gpuwarden (a real `gpuwarden serve`) against a bare Popen/wait floor.

    python bench/core.py [--rounds N] [--json OUT]

Prints medians and p95 of:
  * crash -> next start: the gap between one child's last instruction and the next child's
    first, with zero backoff (floor: a Popen/wait loop restarting the same child);
  * exit -> state change: the child's last instruction to the daemon's `server.state` record
    (floor: Popen.wait() returning);
  * ready line -> ready: the child printing SGLang's ready line to the daemon's `ready` record;
  * log capture: the child's wall time writing 500,000 80-byte lines to its stdout under the
    daemon vs straight to a file (one write per line, and buffered);
  * the idle daemon's RSS and CPU over 10 s with one sleeping child.
Timestamps come from the same host clock (CLOCK_REALTIME) in every process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

PY = sys.executable

CRASHER = """
import sys, time
t = time.time()
with open(sys.argv[1], "a") as f:
    f.write(f"{t} {time.time()}\\n")
sys.exit(1)
"""

READY = """
import sys, time
t = time.time()
print(f"[2026-01-01 00:00:00] The server is fired up and ready to roll! t={t}",
      file=sys.stderr, flush=True)
time.sleep(3600)
"""

WRITER = """
import sys, time
n, mode = int(sys.argv[1]), sys.argv[2]
line = b"x" * 79 + b"\\n"
t0 = time.perf_counter()
if mode == "line":
    out = open(sys.stdout.fileno(), "wb", buffering=0, closefd=False)
    for _ in range(n):
        out.write(line)
else:
    out = open(sys.stdout.fileno(), "wb", buffering=1 << 16, closefd=False)
    for _ in range(n):
        out.write(line)
    out.flush()
print(f"WALL {time.perf_counter() - t0:.6f}", file=sys.stderr, flush=True)
time.sleep(3600)
"""

SLEEPER = "import time; time.sleep(3600)"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def ms(x: float) -> str:
    return f"{x * 1000:.2f} ms"


class Daemon:
    def __init__(self, root: Path, configs: dict[str, dict[str, Any]], default: str) -> None:
        (root / "configs").mkdir(parents=True, exist_ok=True)
        for name, cfg in configs.items():
            (root / "configs" / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        settings = {
            "listen": "127.0.0.1:0",
            "default_config": default,
            "restart": {"initial_delay_s": 0, "jitter": 0, "crash_loop_after": 1000000},
            "stop": {"grace_s": 2},
            "gpu": {"backend": "none"},
            "log_retention": {"launches": 100000},
        }
        (root / "settings.yaml").write_text(yaml.safe_dump(settings))
        self.log_path = root / "daemon.log"
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [PY, "-m", "gpuwarden.daemon.cli", "serve", "--settings", str(root / "settings.yaml")],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self.url = self._wait_url()
        self.http = httpx.Client(base_url=self.url, timeout=30, trust_env=False)

    def records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_bytes().splitlines():
            if line.startswith(b"{"):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out

    def _wait_url(self) -> str:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for r in self.records():
                if r.get("event") == "api.listening":
                    return str(r["url"])
            time.sleep(0.02)
        raise RuntimeError("daemon did not start")

    def wait_for(self, pred: Any, timeout: float = 60) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            recs = self.records()
            if pred(recs):
                return recs
            time.sleep(0.05)
        raise RuntimeError("timed out")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def ts(record: dict[str, Any]) -> float:
    return datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()


def config(code: str, *args: str) -> dict[str, Any]:
    return {
        "command": [PY, "-c", code, *args],
        "health": {
            "url": "http://127.0.0.1:9/health",
            "startup_timeout_s": 3600,
            "interval_s": 3600,
        },
    }


def bench_restart(rounds: int, tmp: Path) -> dict[str, Any]:
    # Floor: a bare Popen/wait loop.
    stamps = tmp / "floor.txt"
    exits_floor = []
    for _ in range(rounds):
        p = subprocess.Popen([PY, "-c", CRASHER, str(stamps)])
        p.wait()
        exits_floor.append(time.time())
    floor = [line.split() for line in stamps.read_text().splitlines()]
    floor_gaps = [float(floor[i + 1][0]) - float(floor[i][1]) for i in range(len(floor) - 1)]
    floor_exit = [exits_floor[i] - float(floor[i][1]) for i in range(len(floor))]

    root = tmp / "gw-restart"
    stamps2 = tmp / "gw.txt"
    d = Daemon(root, {"crash": config(CRASHER, str(stamps2))}, "crash")
    try:
        d.wait_for(lambda r: sum(1 for x in r if x.get("event") == "server.launch") > rounds)
        d.http.post("/stop")
        recs = d.wait_for(lambda r: any(x.get("to") == "stopped" for x in r))
    finally:
        d.close()
    runs = [line.split() for line in stamps2.read_text().splitlines()][:rounds]
    gaps = [float(runs[i + 1][0]) - float(runs[i][1]) for i in range(len(runs) - 1)]
    stopping = [
        ts(r) for r in recs if r.get("event") == "server.state" and r.get("to") == "stopping"
    ]
    exit_lat = [stopping[i] - float(runs[i][1]) for i in range(min(len(runs), len(stopping)))]
    return {
        "crash_to_next_start_floor_s": floor_gaps,
        "crash_to_next_start_s": gaps,
        "exit_to_state_floor_s": floor_exit,
        "exit_to_state_s": exit_lat,
    }


def bench_ready(rounds: int, tmp: Path) -> list[float]:
    root = tmp / "gw-ready"
    d = Daemon(root, {"ready": config(READY)}, "ready")
    lat = []
    try:
        for i in range(rounds):
            recs = d.wait_for(lambda r, n=i + 1: sum(1 for x in r if x.get("to") == "ready") >= n)
            ready = [r for r in recs if r.get("to") == "ready"][i]
            log_file = Path(ready["log_file"]) if "log_file" in ready else None
            launch = [r for r in recs if r.get("event") == "server.launch"][i]
            text = Path(launch["log_file"]).read_text()
            while text.count("ready to roll! t=") < 2:  # the log file is flushed every 0.2 s
                time.sleep(0.05)
                text = Path(launch["log_file"]).read_text()
            t_child = float(text.rsplit("ready to roll! t=", 1)[1].split()[0])
            lat.append(ts(ready) - t_child)
            del log_file
            if i + 1 < rounds:
                d.http.post("/restart")
    finally:
        d.close()
    return lat


def bench_capture(lines: int, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("line", "buffered"):
        walls = []
        for _ in range(3):
            with (tmp / "direct.log").open("wb") as f:
                p = subprocess.Popen(
                    [PY, "-c", WRITER, str(lines), mode], stdout=f, stderr=subprocess.PIPE
                )
                assert p.stderr is not None
                wall = float(p.stderr.readline().split()[1])
                p.kill()
                p.wait()
            walls.append(wall)
        root = tmp / f"gw-capture-{mode}"
        d = Daemon(root, {"w": config(WRITER, str(lines), mode)}, "w")
        try:
            recs = d.wait_for(lambda r: any(x.get("event") == "server.launch" for x in r))
            log_file = Path(next(x for x in recs if x.get("event") == "server.launch")["log_file"])
            deadline = time.monotonic() + 120
            while b"\nWALL " not in log_file.read_bytes()[-200:] and time.monotonic() < deadline:
                time.sleep(0.1)
            data = log_file.read_bytes()
            wall_gw = float(data.rsplit(b"\nWALL ", 1)[1].split()[0])
            found = data.count(b"x" * 79 + b"\n")
            rss = psutil.Process(d.proc.pid).memory_info().rss
        finally:
            d.close()
        out[mode] = {
            "direct_wall_s": statistics.median(walls),
            "gpuwarden_wall_s": wall_gw,
            "ratio": statistics.median(walls) / wall_gw,
            "lines_found": found,
            "daemon_rss_mib": rss / 2**20,
        }
    return out


def bench_idle(tmp: Path, seconds: float) -> dict[str, float]:
    root = tmp / "gw-idle"
    d = Daemon(root, {"idle": config(SLEEPER)}, "idle")
    try:
        d.wait_for(lambda r: any(x.get("event") == "server.launch" for x in r))
        time.sleep(1.0)
        proc = psutil.Process(d.proc.pid)
        t0 = proc.cpu_times()
        time.sleep(seconds)
        t1 = proc.cpu_times()
        cpu = (t1.user + t1.system - t0.user - t0.system) / seconds * 100
        rss = proc.memory_info().rss / 2**20
    finally:
        d.close()
    return {"idle_cpu_pct": cpu, "idle_rss_mib": rss}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--lines", type=int, default=500_000)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        restart = bench_restart(args.rounds, tmp)
        ready = bench_ready(max(5, args.rounds // 4), tmp)
        capture = bench_capture(args.lines, tmp)
        idle = bench_idle(tmp, args.idle_s)
    gap_f, gap = (
        statistics.median(restart["crash_to_next_start_floor_s"]),
        statistics.median(restart["crash_to_next_start_s"]),
    )
    ex_f, ex = (
        statistics.median(restart["exit_to_state_floor_s"]),
        statistics.median(restart["exit_to_state_s"]),
    )
    rows = [
        (
            "crash -> next start (zero backoff)",
            ms(gap_f),
            ms(gap),
            ms(gap - gap_f) + " over floor",
            "<= 5 ms over floor",
        ),
        (
            "  p95",
            ms(pct(restart["crash_to_next_start_floor_s"], 0.95)),
            ms(pct(restart["crash_to_next_start_s"], 0.95)),
            "",
            "",
        ),
        ("exit -> state change", ms(ex_f), ms(ex), ms(ex - ex_f) + " over floor", "<= 5 ms"),
        (
            "ready line -> ready",
            "",
            ms(statistics.median(ready)),
            f"p95 {ms(pct(ready, 0.95))}",
            "<= 50 ms",
        ),
    ]
    for mode, c in capture.items():
        rows.append(
            (
                f"log capture, {mode} writes ({args.lines} lines)",
                f"{c['direct_wall_s']:.3f} s",
                f"{c['gpuwarden_wall_s']:.3f} s",
                f"{c['ratio']:.2f}x of direct; {c['lines_found']} lines in the log; "
                f"RSS {c['daemon_rss_mib']:.0f} MiB",
                ">= 0.8x",
            )
        )
    rows.append(("idle daemon RSS", "", f"{idle['idle_rss_mib']:.1f} MiB", "", "<= 80 MB"))
    rows.append(
        (
            "idle daemon CPU",
            "",
            f"{idle['idle_cpu_pct']:.2f} %",
            f"over {args.idle_s:g} s",
            "<= 0.5 %",
        )
    )
    print(
        f"gpuwarden core bench, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, "
        f"Python {sys.version.split()[0]}, {args.rounds} rounds\n"
    )
    print("| measure | floor (Popen/wait or direct) | gpuwarden | note | goal |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"restart": restart, "ready_s": ready, "capture": capture, "idle": idle}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
