"""What the proxy answers itself (its 503s, 502s and 400s), and the wait for a server's
final answer with the client watched for leaving."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from .pool import Upstream
from .wire import MAX_HEAD, BadMessage, ClientGone, Closed, Head, Inbound, parse_head, status_of

WATCH_AFTER_S = 0.5  # an answer slower than this: the client is watched for leaving


def error_body(state: str, message: str, **extra: Any) -> bytes:
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": "server_unavailable",
                "code": 503,
                "state": state,
                **extra,
            }
        }
    ).encode()


def simple_response(status: int, reason: bytes, body: bytes, extra: list[bytes]) -> bytes:
    head = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
    head += extra
    head.append(b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
    return b"".join(head) + body


async def until_eof(inb: Inbound) -> None:
    """Ends when the client closes its connection; what it sends meanwhile (a next request)
    is kept in its buffer, up to a head's worth."""
    while len(inb.buf) < MAX_HEAD and await inb.fill():
        pass
    if len(inb.buf) >= MAX_HEAD:
        await asyncio.get_running_loop().create_future()  # (no more read: cancelled later)


async def final_answer(conn: Upstream, inb: Inbound) -> tuple[Head, int]:
    """The server's final answer head (1xx ones skipped). A client that leaves while the
    server computes (a long answer that is not a stream) ends the wait: its connection
    closes, and the server's request with it."""
    wait = asyncio.ensure_future(conn.inb.head())
    watching: list[asyncio.Future[None]] = []

    def watch() -> None:  # (only for a slow answer: a fast one costs no watcher)
        gone = asyncio.ensure_future(until_eof(inb))
        gone.add_done_callback(lambda _: wait.cancel())
        watching.append(gone)

    timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, watch)
    try:
        head_bytes = await wait
    except asyncio.CancelledError:
        if watching and watching[0].done() and not watching[0].cancelled():
            raise ClientGone() from None
        raise
    finally:
        timer.cancel()
        for gone in watching:
            if not gone.done():
                gone.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await gone
    while True:
        if head_bytes is None:
            raise Closed("the server closed the connection before answering")
        head = parse_head(head_bytes)
        status = status_of(head)
        if status >= 200:
            return head, status
        if status == 101:
            raise BadMessage("101 Switching Protocols: the proxy does not pass upgrades")
        head_bytes = await conn.inb.head()  # (100, 102, 103: the final one follows)
