"""What the benchmarks share: a real `gpuwarden serve` under test (`Daemon`), its records'
timestamps, a config for a plain child, and the ready line -> `ready` measurement.

`bench/peers.py` (`make bench`) measures everything else, side by side with supervisord and PM2;
`bench/api.py` the control plane; `bench/soak.py` the long run. Timestamps come from the same
host clock (CLOCK_REALTIME) in every process.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

PY = sys.executable

READY = """
import sys, time
t = time.time()
print(f"[2026-01-01 00:00:00] The server is fired up and ready to roll! t={t}",
      file=sys.stderr, flush=True)
time.sleep(3600)
"""


def free_port() -> int:
    """A loopback port free now (the OS picks it), for a server the bench starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank); NaN for no values."""
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


class Daemon:
    def __init__(
        self, root: Path, configs: dict[str, dict[str, Any]], default: str, **extra: Any
    ) -> None:
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
            **extra,
        }
        (root / "settings.yaml").write_text(yaml.safe_dump(settings))
        self.log_path = root / "daemon.log"
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [PY, "-m", "gpuwarden.api.cli", "serve", "--settings", str(root / "settings.yaml")],
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


def write_results(out: Path, name: str, lines: list[str]) -> None:
    """A bench's results: printed, and written to `out/name` (`bench/results/` by default)."""
    text = "\n".join(lines) + "\n"
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(text)


def measured_on() -> str:
    """`Measured <time> on <cpu> (<n> cores), Python <v>`: how a results file begins."""
    cpu = platform.processor() or platform.machine()
    return (
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {cpu} "
        f"({os.cpu_count()} cores), Python {platform.python_version()}"
    )


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


def bench_ready(rounds: int, tmp: Path) -> list[float]:
    root = tmp / "gw-ready"
    d = Daemon(root, {"ready": config(READY)}, "ready")
    lat = []
    try:
        for i in range(rounds):
            recs = d.wait_for(lambda r, n=i + 1: sum(1 for x in r if x.get("to") == "ready") >= n)
            ready = [r for r in recs if r.get("to") == "ready"][i]
            launch = [r for r in recs if r.get("event") == "server.launch"][i]
            text = Path(launch["log_file"]).read_text()
            while text.count("ready to roll! t=") < 2:  # the header's argv holds the first
                time.sleep(0.05)
                text = Path(launch["log_file"]).read_text()
            t_child = float(text.rsplit("ready to roll! t=", 1)[1].split()[0])
            lat.append(ts(ready) - t_child)
            if i + 1 < rounds:
                d.http.post("/restart")
    finally:
        d.close()
    return lat
