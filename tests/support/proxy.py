"""The front proxy (`daemon/proxy/`) as a real process, driven through its control socket as
the daemon drives it, and the clean-up of proxies a test's daemons left running."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from .procs import PY, Proc, free_port


class Control:
    """The daemon's side of a proxy's control socket, in a test."""

    def __init__(self, path: Path, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX)
                self.sock.connect(str(path))
                break
            except OSError:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.file = self.sock.makefile("rb")
        self.hello = json.loads(self.file.readline())["hello"]

    def send(self, **message: Any) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def gate(self, mode: str, upstream: int | None = None, **word: Any) -> None:
        if upstream is not None:
            word["upstream"] = ["127.0.0.1", upstream]
        self.send(gate={"mode": mode, "state": word.pop("state", mode), **word})

    def stats(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10
    ) -> dict[str, Any]:
        """The proxy's figures once `predicate` accepts them (asked for every 20 ms)."""
        self.sock.settimeout(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.send(ask="stats")
            while True:
                line = self.file.readline()
                if not line:
                    raise AssertionError("the proxy closed its control socket")
                message = json.loads(line)
                if "stats" in message:
                    break
            if predicate(message["stats"]):
                return dict(message["stats"])
            time.sleep(0.02)
        raise AssertionError(f"no such figures from the proxy; the last: {message['stats']}")

    def close(self) -> None:
        self.file.close()
        self.sock.close()


@contextlib.contextmanager
def running_proxy(
    procs: list[Proc], folder: Path, *flags: str
) -> Iterator[tuple[str, Control, Proc]]:
    """A proxy on a free port (its URL), its control connection and its process."""
    port = free_port()
    sock = folder / "proxy.sock"
    proc = Proc(
        [
            PY,
            "-m",
            "gpuwarden.daemon.proxy",
            "--listen",
            f"127.0.0.1:{port}",
            "--control",
            str(sock),
            *flags,
        ],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    procs.append(proc)
    proc.wait_for(r"listening on")
    control = Control(sock)
    try:
        yield f"http://127.0.0.1:{port}", control, proc
    finally:
        control.close()


def end_proxies(mine: Callable[[str], bool]) -> int:
    """Kill every proxy whose control socket `mine` accepts (a daemon SIGKILLed with
    live_restore leaves its proxy running); return how many there were."""
    ended = 0
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "gpuwarden.daemon.proxy" not in cmd or "--control" not in cmd[:-1]:
            continue
        if mine(cmd[cmd.index("--control") + 1]):
            ended += 1
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)
    return ended
