"""Run `gpuwarden serve` (or another gpuwarden command) as a real process and follow it through
its own JSON log lines and its HTTP API: `start_daemon` is the one way tests start a daemon."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from gpuwarden.standin import fakegpu

from .configs import write_setup
from .procs import PY, Proc, wait_until


class Daemon:
    """A `gpuwarden serve` process: its URL, its events, its HTTP API. Made, it has listened:
    it waits for the daemon's api.listening record."""

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


def gpuwarden(
    procs: list[Proc], *args: str, fake_gpu: Path | None, env: dict[str, str] | None = None
) -> Proc:
    """`gpuwarden ARGS` as a child of the test (in `procs`, so it cannot outlive it), unbuffered,
    on the fake GPUs in `fake_gpu` (None: the variable is unset); `env` is added last."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    full_env.pop(fakegpu.ENV_DIR, None)
    if fake_gpu is not None:
        full_env[fakegpu.ENV_DIR] = str(fake_gpu)
    full_env.update(env or {})
    proc = Proc([PY, "-m", "gpuwarden.api.cli", *args], env=full_env)
    procs.append(proc)
    return proc


def serve(
    procs: list[Proc],
    settings: Path,
    fake_gpu: Path | None,
    *args: str,
    env: dict[str, str] | None = None,
) -> Proc:
    """`gpuwarden serve --settings SETTINGS ARGS`, not yet waited for: for a test that acts on
    the process before it listens (a resource limit) or expects it never to."""
    return gpuwarden(procs, "serve", "--settings", str(settings), *args, fake_gpu=fake_gpu, env=env)


def start_daemon(
    procs: list[Proc],
    root: Path,
    fake_gpu: Path,
    configs: dict[str, dict[str, Any]],
    default: str | None = None,
    env: dict[str, str] | None = None,
    **settings: Any,
) -> Daemon:
    """A daemon serving `configs` from `root` (see `write_setup` for `settings`), listening.
    It is stopped after the test with the rest of `procs`."""
    path = write_setup(root, configs, default, **settings)
    return Daemon(serve(procs, path, fake_gpu, env=env), root)


def until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    wait_until(predicate, timeout, what)
