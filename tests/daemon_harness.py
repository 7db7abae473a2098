"""Run `gpuwarden serve` as a real process and follow it through its own JSON log lines."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from gpuwarden.standin import fakegpu

from .conftest import PY, Proc

FAST_RESTART = {
    "initial_delay_s": 0.05,
    "max_delay_s": 0.2,
    "multiplier": 2,
    "jitter": 0.0,
    "reset_after_s": 600,
    "crash_loop_after": 3,
}


def standin_config(
    *extra: str, scale: float = 0.01, port: int | None = None, **fields: Any
) -> dict[str, Any]:
    """A server config for the stand-in; `extra` flags like '--standin-crash-after=0.1'."""
    from .conftest import free_port  # noqa: PLC0415

    args: dict[str, Any] = {
        "model-path": "fake-org/fake-model",
        "port": port or free_port(),
        "standin-time-scale": scale,
    }
    for flag in extra:
        key, _, value = flag.lstrip("-").partition("=")
        args[key] = value if value else True
    cfg: dict[str, Any] = {
        "command": [PY, "-m", "gpuwarden.standin"],
        "args": args,
        "env": {"CUDA_VISIBLE_DEVICES": "0"},
        "health": {"startup_timeout_s": 30, "interval_s": 0.2, "timeout_s": 2, "failures": 3},
    }
    for key, value in fields.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def write_setup(
    root: Path,
    configs: dict[str, dict[str, Any]],
    default: str | None = None,
    **settings: Any,
) -> Path:
    (root / "configs").mkdir(parents=True, exist_ok=True)
    for name, cfg in configs.items():
        (root / "configs" / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    base: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "configs_dir": "./configs",
        "state_dir": "./state",
        "log_dir": "./logs",
        "default_config": default,
        "restart": dict(FAST_RESTART),
        "stop": {"grace_s": 5},
        "gpu": {"backend": "fake", "poll_interval_s": 0.02, "release_timeout_s": 5},
    }
    for key, value in settings.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    # A test that asks for a long first delay means it: the fast schedule's cap would cut it.
    base["restart"]["max_delay_s"] = max(
        base["restart"]["max_delay_s"], base["restart"]["initial_delay_s"]
    )
    path = root / "settings.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


class Daemon:
    """A `gpuwarden serve` process: its URL, its events, its HTTP API."""

    def __init__(self, proc: Proc, root: Path) -> None:
        self.proc = proc
        self.root = root
        m = proc.wait_for(r'"event": "api\.listening"', timeout=30)
        info = json.loads(proc.lines[proc.matched_at][1])
        self.url = info["url"]
        self.http = httpx.Client(base_url=self.url, timeout=30, trust_env=False)
        self._lock = threading.Lock()
        assert m

    def records(self) -> list[dict[str, Any]]:
        out = []
        for stream, line in list(self.proc.lines):
            if stream == "stderr" and line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    def wait_event(
        self,
        event: str,
        timeout: float = 30.0,
        after: int = 0,
        **match: Any,
    ) -> dict[str, Any]:
        """Wait for a daemon log record `event` (e.g. 'server.state') whose fields match.

        Returns it; `after` skips records before that index (see `mark`)."""
        deadline = time.monotonic() + timeout
        start = 0
        while True:
            left = deadline - time.monotonic()
            pattern = f'"event": "{event}"'
            try:
                self.proc.wait_for(pattern, timeout=max(0.01, left), start=start)
            except AssertionError as exc:
                raise AssertionError(
                    f"no {event} {match} within {timeout} s\n{self.tail()}"
                ) from exc
            idx = self.proc.matched_at
            start = idx + 1
            if idx < after:
                continue
            record = json.loads(self.proc.lines[idx][1])
            if all(record.get(k) == v for k, v in match.items()):
                record["_index"] = idx
                return record

    def wait_state(
        self, to: str, timeout: float = 30.0, after: int = 0, **match: Any
    ) -> dict[str, Any]:
        return self.wait_event("server.state", timeout=timeout, after=after, to=to, **match)

    def mark(self) -> int:
        return len(self.proc.lines)

    def tail(self, n: int = 30) -> str:
        return "\n".join(line[:300] for _, line in self.proc.lines[-n:])

    def status(self) -> dict[str, Any]:
        res = self.http.get("/status")
        res.raise_for_status()
        data: dict[str, Any] = res.json()
        return data


def start_daemon(
    procs: list[Proc],
    root: Path,
    fake_gpu: Path,
    configs: dict[str, dict[str, Any]],
    default: str | None = None,
    env: dict[str, str] | None = None,
    **settings: Any,
) -> Daemon:
    path = write_setup(root, configs, default, **settings)
    full_env = {
        **os.environ,
        fakegpu.ENV_DIR: str(fake_gpu),
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    proc = Proc([PY, "-m", "gpuwarden.api.cli", "serve", "--settings", str(path)], env=full_env)
    procs.append(proc)
    return Daemon(proc, root)


def until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    from .conftest import wait_until  # noqa: PLC0415

    wait_until(predicate, timeout, what)
