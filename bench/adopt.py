"""Adoption, measured with real daemons (`live_restore: true`, the stand-in as the server): the
daemon SIGKILLed while ready, then started again; how long from the new daemon's exec to its
control plane listening, to `server.adopted`, and to `/status` saying ready with the same pid.
Beside it, the floor: the same daemon's start with nothing to adopt.

Usage: python bench/adopt.py [--rounds N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from restart import end_shims


class Daemon:
    """`gpuwarden serve`, its JSON records read as they come, each stamped on arrival."""

    def __init__(self, settings: Path) -> None:
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwarden.api.cli", "serve", "--settings", str(settings)],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.records: list[tuple[float, dict[str, Any]]] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            with contextlib.suppress(ValueError):
                record = json.loads(raw)
                with self.cond:
                    self.records.append((time.perf_counter(), record))
                    self.cond.notify_all()

    def wait(self, event: str, timeout: float = 60, **match: Any) -> tuple[float, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for at, rec in self.records:
                    if rec.get("event") == event and all(rec.get(k) == v for k, v in match.items()):
                        return at - self.t0, rec
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {event} {match}")
                self.cond.wait(left)

    def status(self, url: str) -> dict[str, Any]:
        with urllib.request.urlopen(url + "/status", timeout=10) as res:
            data: dict[str, Any] = json.load(res)
        return data


def settings_file(root: Path, live: bool) -> Path:
    port = 20000 + os.getpid() % 20000
    config = {
        "command": [sys.executable, "-m", "gpuwarden.standin"],
        "args": {"model-path": "fake-org/fake-model", "port": port, "standin-time-scale": 0.01},
        "health": {"startup_timeout_s": 60, "interval_s": 0.2, "timeout_s": 2, "failures": 3},
    }
    (root / "configs").mkdir(parents=True, exist_ok=True)
    (root / "configs" / "k.yaml").write_text(yaml.safe_dump(config))
    settings = {
        "listen": "127.0.0.1:0",
        "configs_dir": str(root / "configs"),
        "state_dir": str(root / "state"),
        "log_dir": str(root / "logs"),
        "default_config": "k",
        "gpu": {"backend": "none"},
        "live_restore": live,
    }
    path = root / "settings.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    listen, adopted, ready, floor = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp_name:
        root = Path(tmp_name)
        try:
            d = Daemon(settings_file(root, live=True))
            _, rec = d.wait("api.listening")
            d.wait("server.state", to="ready")
            pid = d.status(rec["url"])["pid"]
            for _ in range(args.rounds):
                time.sleep(0.5)  # the ready launch on record
                d.proc.send_signal(signal.SIGKILL)
                d.proc.wait()
                d = Daemon(root / "settings.yaml")
                t_listen, rec = d.wait("api.listening")
                t_adopt, adoption = d.wait("server.adopted")
                assert adoption["pid"] == pid, adoption
                while d.status(rec["url"])["state"] != "ready":
                    time.sleep(0.001)
                ready.append(time.perf_counter() - d.t0)
                listen.append(t_listen)
                adopted.append(t_adopt)
            d.proc.send_signal(signal.SIGTERM)
            d.proc.wait()
        finally:
            end_shims(root)
    with tempfile.TemporaryDirectory() as tmp_name:  # the floor: nothing to adopt
        root = Path(tmp_name)
        path = settings_file(root, live=False)
        text = path.read_text().replace("default_config: k", "default_config: null")
        path.write_text(text)
        for _ in range(args.rounds):
            d = Daemon(path)
            floor.append(d.wait("api.listening")[0])
            d.proc.send_signal(signal.SIGTERM)
            d.proc.wait()
    med = statistics.median
    print(
        f"adoption after a daemon SIGKILL, median of {args.rounds} (max), from the new daemon's "
        f"exec: control plane listening {med(listen):.3f} s ({max(listen):.3f}); server adopted "
        f"{med(adopted):.3f} s ({max(adopted):.3f}); /status ready, same pid {med(ready):.3f} s "
        f"({max(ready):.3f}). A daemon's start with nothing to adopt, to listening: "
        f"{med(floor):.3f} s"
    )


if __name__ == "__main__":
    main()
