"""A scripted HTTP server for the proxy's tests: it answers each request it reads with the
next answer of its script (raw bytes, so it can answer wrongly on purpose), on threads."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

Answer = bytes | Callable[[socket.socket], None]

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"


def ok(body: bytes) -> bytes:
    return OK % (len(body), body)


class ScriptedUpstream:
    """Answers request n with `script[n]` (the last one again when the script runs out);
    `/health` always answers 200. `requests` holds what it read, `closed` counts
    connections that the other side closed."""

    def __init__(self, script: list[Answer]) -> None:
        self.script = script
        self.requests: list[bytes] = []
        self.closed = 0
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = int(self.sock.getsockname()[1])
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    try:
                        data = conn.recv(65536)
                    except OSError:
                        data = b""
                    if not data:
                        with self._lock:
                            self.closed += 1
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buf) < length:
                    buf += conn.recv(65536)
                buf = buf[length:]
                if head.startswith(b"GET /health "):
                    conn.sendall(ok(b"{}"))
                    continue
                with self._lock:
                    answer = self.script[min(len(self.requests), len(self.script) - 1)]
                    self.requests.append(head)
                try:
                    if callable(answer):
                        answer(conn)
                    else:
                        conn.sendall(answer)
                except OSError:
                    return

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def scripted(script: list[Answer]) -> Iterator[ScriptedUpstream]:
    upstream = ScriptedUpstream(script)
    try:
        yield upstream
    finally:
        upstream.close()


def raw(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send `data` to 127.0.0.1:`port` and read until the peer closes or goes quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            out += chunk
            if out.count(b"\r\n\r\n") and _whole(out):
                break
        return out


def _whole(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False
