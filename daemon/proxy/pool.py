"""The proxy's connections to the server: kept open between requests (keep-alive), at most
`POOL_MAX`, dropped when the server changes (a new epoch of the gate), when idle past
uvicorn's own keep-alive, or when they spoke while idle (not in step with their requests)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from .gate import Gate
from .wire import Inbound

POOL_IDLE_S = 4.0  # uvicorn closes an idle keep-alive after 5 s: a pooled one older is dropped
POOL_MAX = 64  # idle connections kept per server


def _spoke(conn: Upstream) -> bool:
    """Bytes (or its end) came on a connection while it sat idle in the pool: it is not in
    step with its requests any more (an answer longer than it said, a stray one)."""
    reader = conn.inb.reader
    return reader.at_eof() or bool(getattr(reader, "_buffer", b""))  # (asyncio's own buffer)


class Upstream:
    """One connection to the server."""

    __slots__ = ("epoch", "idle_since", "inb", "writer")

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, epoch: int
    ) -> None:
        self.inb, self.writer, self.epoch = Inbound(reader), writer, epoch
        self.idle_since = 0.0

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class Pool:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.idle: list[Upstream] = []

    async def get(self, address: tuple[str, int]) -> tuple[Upstream, bool]:
        """A connection to `address` (and whether it was pooled, so may be stale)."""
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            fresh = conn.epoch == self.gate.epoch and now - conn.idle_since < POOL_IDLE_S
            if fresh and not conn.writer.transport.is_closing() and not _spoke(conn):
                return conn, True
            conn.close()
        reader, writer = await asyncio.open_connection(*address)
        return Upstream(reader, writer, self.gate.epoch), False

    def put(self, conn: Upstream) -> None:
        if conn.epoch != self.gate.epoch or len(self.idle) >= POOL_MAX or conn.inb.buf:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self.idle.append(conn)
