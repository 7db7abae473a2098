"""The proxy process: its listener, its control socket and its end.

The daemon connects to the control socket (`<state_dir>/proxy/proxy.sock`) and sends one JSON
object per line: `{"gate": {...}}` (`gate.py`), `{"settings": {...}}` (the bounds, on an
adoption), `{"exit": true}`. The proxy answers with a `hello` line and then its figures
(`{"stats": {...}}`) twice a second while they change. One daemon at a time: a new connection
replaces the one before. While no daemon is connected the gate keeps its last word.

The socket is made only once the listener is bound, so a daemon that connects knows the proxy
serves. SIGTERM (or `exit`) ends it: held requests get 503, requests under way have
`DRAIN_S` to finish.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import resource
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from .front import Front
from .gate import Gate, Limits, reported
from .resume import Resumer

STATS_S = 0.5
BACKLOG = 512  # (asyncio logs each failed accept of a wake-up: out of descriptors, up to this)
MAX_UNREAD = 1 << 20  # bytes of figures a daemon has not read, at most
DRAIN_S = 10.0
MAX_LINE = 1 << 20


class Proxy:
    def __init__(self, args: argparse.Namespace) -> None:
        self.limits = Limits(args.hold_timeout_s, args.max_held, args.max_held_bytes)
        self.gate = Gate(self.limits, None)
        self.resumer = Resumer(self.gate)
        self.front = Front(self.gate, self.resumer if args.continue_streams else None)
        self.listen, self.control_path = args.listen, Path(args.control)
        self.daemon: asyncio.StreamWriter | None = None
        self.ending = asyncio.Event()
        self.started = time.time()

    def figures(self) -> dict[str, Any]:
        return {
            **self.gate.view(),
            "active": self.front.active,
            "in_flight": self.front.active - len(self.gate.waiters),  # sent on, not answered
            "connections": len(self.front.clients),
            "pid": os.getpid(),
            "listen": self.listen,
            "started_at": self.started,
            "continue_streams": self.front.resume is not None,
            "limits": vars(self.limits),
        }

    async def control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.daemon is not None:
            self.daemon.close()
        self.daemon = writer
        try:
            writer.write(_line({"hello": self.figures()}))
            while True:
                line = await reader.readline()
                if not line:
                    return
                try:
                    if self.said(json.loads(line)):
                        writer.write(_line({"stats": self.figures()}))
                except (
                    ValueError,
                    TypeError,
                    KeyError,
                    IndexError,
                    AttributeError,
                    OverflowError,
                ) as exc:
                    writer.write(_line({"error": f"{type(exc).__name__}: {exc}"}))
        except (OSError, ValueError):  # (ValueError: a line over the limit)
            return
        finally:
            if self.daemon is writer:
                self.daemon = None
            writer.close()

    def failed(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """Whatever fails on its loop (a task, a client's handler): in its log, and said to
        the daemon (a `proxy_error` event)."""
        loop.default_exception_handler(context)  # (its log: stderr)
        exc = context.get("exception")
        what = str(context.get("message") or "")
        if exc is not None:
            what += f": {type(exc).__name__}: {exc}"
        if self.daemon is not None:
            with contextlib.suppress(OSError):
                self.daemon.write(_line({"error": what[:500]}))

    def said(self, message: dict[str, Any]) -> bool:
        """Act on a daemon's line; True: it asked for the figures now."""
        if "gate" in message:
            self.gate.set(dict(message["gate"]))
        if "settings" in message:
            settings = dict(message["settings"])
            checked = {}
            for key in ("hold_timeout_s", "max_held", "max_held_bytes"):
                if key in settings:
                    value = type(getattr(self.limits, key))(settings[key])
                    if not math.isfinite(value) or value < 0:
                        raise ValueError(f"{key} must be a finite number >= 0, got {value!r}")
                    checked[key] = value
            for key, value in checked.items():  # (all checked, then applied)
                setattr(self.limits, key, value)
            if "continue_streams" in settings:
                self.front.resume = self.resumer if settings["continue_streams"] else None
        if message.get("exit"):
            self.ending.set()
        return message.get("ask") == "stats"

    async def stats(self) -> None:
        last: dict[str, Any] | None = None
        while True:
            await asyncio.sleep(STATS_S)
            now = self.figures()
            daemon = self.daemon
            if daemon is not None and daemon.transport.get_write_buffer_size() > MAX_UNREAD:
                continue  # (a daemon that does not read gets no more until it does)
            if now != last and daemon is not None:
                with contextlib.suppress(OSError):
                    daemon.write(_line({"stats": now}))
                last = now

    async def run(self) -> int:
        host, _, port = self.listen.rpartition(":")
        server = await asyncio.start_server(
            self.front.client, host.strip("[]"), int(port), backlog=BACKLOG, reuse_address=True
        )
        with contextlib.suppress(FileNotFoundError):
            self.control_path.unlink()
        self.control_path.parent.mkdir(parents=True, exist_ok=True)
        old = os.umask(0o077)
        try:
            ctl = await asyncio.start_unix_server(self.control, self.control_path, limit=MAX_LINE)
        finally:
            os.umask(old)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.ending.set)
        loop.set_exception_handler(self.failed)
        self.front.max_clients = _max_clients()  # (its descriptors raised to the hard limit)
        print(f"gpuwarden proxy {os.getpid()} listening on {self.listen}", flush=True)
        stats = reported(loop.create_task(self.stats(), name="stats"))
        await self.ending.wait()
        server.close()
        self.gate.set({"mode": "reject", "state": "stopped", "reason": "the proxy is stopping"})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.front.drained.wait(), DRAIN_S)
        stats.cancel()
        ctl.close()
        with contextlib.suppress(FileNotFoundError):
            self.control_path.unlink()
        return 0


def _max_clients() -> int:
    """Client connections at most: half the descriptors (each may need one to the server),
    the soft limit raised to the hard one first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, 1 << 20), hard))
        soft = min(want, 1 << 20)
    return max(16, (soft - 64) // 2)


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gpuwarden.daemon.proxy")
    parser.add_argument("--listen", required=True, help="HOST:PORT clients use")
    parser.add_argument("--control", required=True, help="the control socket's path")
    parser.add_argument("--hold-timeout-s", type=float, default=600.0)
    parser.add_argument("--max-held", type=int, default=1000)
    parser.add_argument("--max-held-bytes", type=int, default=268435456)
    parser.add_argument("--continue-streams", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # it outlives the daemon's session
    try:
        return asyncio.run(Proxy(args).run())
    except OSError as exc:  # the listen address is taken, or not this host's
        print(f"gpuwarden proxy: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 2


def can_listen(listen: str) -> str | None:
    """Why `listen` cannot be bound here, or None."""
    host, _, port = listen.rpartition(":")
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), int(port)))
        except OSError as exc:
            return str(exc)
    return None
