"""The control plane from the outside, below httpx: raw sockets (a request head written by
hand, a response read by hand), a token file, a descriptor limit, a `/logs/stream` client that
never reads, and a webhook receiver."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import resource
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .daemon import Daemon

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def with_token(root: Path) -> str:
    (root / "token").write_text(TOKEN + "\n")
    return "./token"


def addr(d: Daemon) -> tuple[str, int]:
    parts = urlsplit(d.url)
    return "127.0.0.1", int(parts.port or 80)


def connect(d: Daemon, timeout: float = 10) -> socket.socket:
    sock = socket.create_connection(addr(d), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def request_head(method: str, path: str, d: Daemon, **headers: str) -> bytes:
    host, port = addr(d)
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response: status, headers (lower-case names), body (by content-length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"closed before a whole response head: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body[:length]


def send_chunks_until_answered(sock: socket.socket, limit: int) -> tuple[int, bytes]:
    """Stream 16 KiB chunks (up to 4x the limit) until the daemon answers; then its answer."""
    chunk = b"4000\r\n" + b"x" * 0x4000 + b"\r\n"
    sock.settimeout(0.05)
    for _ in range(4 * limit // 0x4000):
        try:
            sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            break
        try:
            if sock.recv(1, socket.MSG_PEEK):
                break
        except TimeoutError:
            continue
    sock.settimeout(10)
    status, _, body = read_response(sock)
    return status, body


@contextlib.contextmanager
def descriptors_short(d: Daemon, spare: int) -> Iterator[None]:
    """The daemon's descriptor limit set just above what it holds now."""
    pid = d.proc.pid
    before = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    held = len(os.listdir(f"/proc/{pid}/fd"))
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (held + spare, before[1]))
    try:
        yield
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, before)


def stalled_stream(url: str, query: str = "") -> socket.socket:
    """A raw client: asks for /logs/stream, reads the response head, then never reads again
    (a tiny receive buffer, so its socket fills at once)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect((host, int(port)))
    sock.sendall(f"GET /logs/stream{query} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        assert chunk, f"the daemon closed /logs/stream at once: {head!r}"
        head += chunk
    assert head.startswith(b"HTTP/1.1 200 "), head
    return sock


def streams(d: Daemon) -> int:
    n: int = d.status()["log_streams"]
    return n


class Receiver:
    """A webhook receiver on 127.0.0.1: records each post; can answer 500 or hang."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.posts: list[dict[str, Any]] = []
        self.release = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.posts.append(json.loads(body))
                if outer.mode == "hang":
                    outer.release.wait(30)
                self.send_response(500 if outer.mode == "500" else 200)
                self.end_headers()

            def log_message(self, *a: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
