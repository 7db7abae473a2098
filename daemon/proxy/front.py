"""The proxy's client side: each connection's requests, admitted by the gate, sent to the
server over a pooled connection, and its response passed back as it arrives.

A request is read whole first (a prompt; it is sent again if its server dies before a byte of
the answer). A response passes through unbuffered: a body framed by length is copied, a
chunked one is passed on chunk by chunk, and server-sent events are passed on at event
boundaries, so that a stream cut by a dead server can end with a well-formed error event (or,
with `continue_streams`, go on from the next server: `resume.py`). A slow client slows only
its own response (its writes wait; its server's socket fills); one that leaves ends its request
at the server (the connection closes).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import time
from typing import Any

from .answers import error_body, final_answer, simple_response, until_eof
from .followed import Followed
from .gate import Gate, Gone, Rejected
from .openai import FollowedOpenAI
from .pool import Pool, Upstream
from .resume import Resumer, follow
from .wire import (
    HOP,
    LAST_CHUNK,
    BadMessage,
    ClientGone,
    Closed,
    Events,
    Inbound,
    Request,
    TooLarge,
    chunk,
    content_length,
    parse_request,
    read_body,
    response_body,
    send,
)

IDLE_CLIENT_S = 120.0  # a client connection with no request (or no whole head) this long: closed
BODY_TIMEOUT_S = 60.0  # a request body not whole this long after its head: the connection closes
MAX_BODY = 64 << 20  # bytes of one request's body, at most (and max_held_bytes)
CLOSE = b"connection: close\r\n"
HELD_HEADER = b"x-gpuwarden-held-s"
MAX_SENDS = 3  # times one server may drop a request before answering; then 502
OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)
UPSTREAM_ERRORS = (OSError, Closed, asyncio.IncompleteReadError, BadMessage)


class Front:
    """The proxy's listener: every client connection, every request."""

    def __init__(self, gate: Gate, resume: Resumer | None = None, max_clients: int = 10000) -> None:
        self.gate = gate
        self.pool = Pool(gate)
        self.resume = resume  # continue_streams: resumes a cut stream (`resume.py`)
        self.max_clients = max_clients
        self.reading = 0  # bytes of request bodies declared and being read now
        self.active = 0  # requests under way (held, or sent on and not answered whole yet)
        self.drained = asyncio.Event()  # set: none is
        self.drained.set()
        self.clients: set[asyncio.StreamWriter] = set()

    async def client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self.clients) >= self.max_clients:  # (each may need a server connection too)
            body = error_body("busy", f"{len(self.clients)} client connections open already")
            writer.write(simple_response(503, b"Service Unavailable", body, [CLOSE]))
            writer.close()
            return
        self.clients.add(writer)
        inb = Inbound(reader)
        try:
            while True:
                try:
                    async with asyncio.timeout(IDLE_CLIENT_S):
                        head = await inb.head()
                except TimeoutError:
                    return
                if head is None:
                    return
                try:
                    request = parse_request(head)
                    request.body = await self._body(request, inb, writer)
                except BadMessage as exc:
                    status, reason = (
                        (413, b"Content Too Large")
                        if isinstance(exc, TooLarge)
                        else (400, b"Bad Request")
                    )
                    body = json.dumps({"error": {"message": str(exc), "code": status}}).encode()
                    writer.write(simple_response(status, reason, body, [CLOSE]))
                    return
                if not await self.exchange(request, inb, writer):
                    return
        except (OSError, Closed, asyncio.IncompleteReadError, TimeoutError):
            return
        finally:
            self.clients.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    async def _body(self, request: Request, inb: Inbound, writer: asyncio.StreamWriter) -> bytes:
        """A request's body, read within `BODY_TIMEOUT_S`, within `MAX_BODY` and within what
        all bodies being read may take together (`max_held_bytes`)."""
        limit = min(MAX_BODY, self.gate.limits.max_held_bytes)
        declared = content_length(request.head) or 0
        if declared > limit:
            raise TooLarge(f"a request body of {declared} bytes, over {limit}")
        budget = max(self.gate.limits.max_held_bytes, limit)
        if self.reading + declared > budget:
            raise TooLarge(f"{self.reading} bytes of request bodies are being read already")
        if b"100-continue" in request.head.tokens(b"expect") and request.version == b"HTTP/1.1":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.reading += declared
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                return await read_body(inb, request.head, limit)
        finally:
            self.reading -= declared

    async def exchange(self, request: Request, inb: Inbound, writer: asyncio.StreamWriter) -> bool:
        """One request through; whether the client connection stays open."""
        self.active += 1
        self.drained.clear()
        try:
            return await self._exchange(request, inb, writer)
        finally:
            self.active -= 1
            if not self.active:
                self.drained.set()

    async def _exchange(self, request: Request, inb: Inbound, writer: asyncio.StreamWriter) -> bool:
        gate, counters = self.gate, self.gate.counters
        counters.requests += 1
        arrived = time.monotonic()
        held = False
        sends = 0  # times the same server dropped it before answering
        last_epoch = -1
        while True:
            held = held or (not gate.usable and gate.mode != "reject")
            gone = None if gate.usable else asyncio.ensure_future(until_eof(inb))
            try:
                address = await gate.admit(arrived, len(request.body), gone, request.what)
            except Rejected as exc:
                return self._reject(writer, request, exc, arrived, held)
            except Gone:
                counters.client_gone += 1
                return False
            finally:
                if gone is not None and not gone.done():
                    gone.cancel()
                    with contextlib.suppress(asyncio.CancelledError, OSError):
                        await gone
            try:
                conn, pooled = await self.pool.get(address)
            except OSError as exc:
                if exc.errno in OUT_OF_FDS:  # the proxy's own limit, not a dead server
                    busy = Rejected("busy", f"the proxy is out of file descriptors ({exc})", 1)
                    return self._reject(writer, request, busy, arrived, held)
                gate.refused(address)
                continue
            try:
                conn.writer.write(request.upstream_bytes())
                answer = await final_answer(conn, inb)
            except ClientGone:
                conn.close()
                counters.client_gone += 1
                return False
            except BadMessage as exc:  # a server that answers garbage is not a dead one
                conn.close()
                return self._fail(writer, request, f"the server's answer: {exc}")
            except UPSTREAM_ERRORS as exc:
                conn.close()
                if pooled:  # (a pooled one may have been closed idle: a fresh one, at once)
                    continue
                gate.refused(address)
                if last_epoch < 0:
                    counters.retried += 1  # (once a request)
                # Dropped again by the same server (no new word from the daemon): the
                # request itself may be what ends it.
                sends = sends + 1 if conn.epoch == last_epoch else 1
                last_epoch = conn.epoch
                if sends >= MAX_SENDS:
                    why = f"the server dropped it {sends} times before answering ({exc})"
                    return self._fail(writer, request, why)
                continue
            head, status = answer
            if held:
                counters.released += 1
                counters.held_for(time.monotonic() - arrived)
            followed = follow(request, gate.model) if self.resume is not None else None
            return await self._relay(
                request,
                conn,
                followed=followed,
                head=head,
                status=status,
                writer=writer,
                arrived=arrived,
                held=held,
                address=address,
            )

    def _fail(self, writer: asyncio.StreamWriter, request: Request, why: str) -> bool:
        """502: the server's answer cannot be passed on."""
        self.gate.counters.failed += 1
        body = json.dumps({"error": {"message": why, "type": "bad_gateway", "code": 502}}).encode()
        extra = [b"connection: keep-alive\r\n" if request.keep_alive else b"connection: close\r\n"]
        writer.write(simple_response(502, b"Bad Gateway", body, extra))
        return request.keep_alive

    async def _relay(
        self,
        request: Request,
        conn: Upstream,
        *,
        followed: Followed | FollowedOpenAI | None,
        head: Any,
        status: int,
        writer: asyncio.StreamWriter,
        arrived: float,
        held: bool,
        address: tuple[str, int],
    ) -> bool:
        body = response_body(request, status, head)
        events = (head.get(b"content-type") or b"").startswith(b"text/event-stream")
        client_chunked = request.version == b"HTTP/1.1"
        keep = request.keep_alive and b"close" not in head.tokens(b"connection")
        out = [b"HTTP/1.1%s\r\n" % head.first[8:]]
        out.extend(b"%s: %s\r\n" % kv for kv in head.fields if kv[0] not in HOP)
        if body.kind == "length" and not events:
            out.append(b"content-length: %d\r\n" % body._left)
            framing = "raw"
        elif body.kind == "none":
            if head.get(b"content-length") is not None:
                out.append(b"content-length: %s\r\n" % head.get(b"content-length"))
            framing = "raw"
        elif client_chunked:
            out.append(b"transfer-encoding: chunked\r\n")
            framing = "chunked"
        else:
            framing, keep = "close", False
        if held:
            out.append(b"%s: %.3f\r\n" % (HELD_HEADER, time.monotonic() - arrived))
        out.append(b"connection: keep-alive\r\n\r\n" if keep else b"connection: close\r\n\r\n")
        head_out = b"".join(out)  # sent with the first body bytes (one write, not two)
        sse = Events() if events else None
        up = conn.inb
        try:
            while True:
                data = body.feed(up.buf)
                if sse is not None:
                    data = sse.feed(data)
                    if followed is not None and data:
                        followed.saw(data)
                if data or head_out:
                    framed = chunk(data) if framing == "chunked" and data else data
                    await send(writer, head_out + framed)
                    head_out = b""
                if body.done:
                    break
                if not await up.fill():
                    if body.kind == "close":
                        break
                    raise Closed("the server closed the connection mid-response")
        except ClientGone:
            conn.close()
            self.gate.counters.client_gone += 1
            return False
        except UPSTREAM_ERRORS as exc:
            conn.close()
            if not isinstance(exc, BadMessage):  # (garbage is not a dead server)
                self.gate.refused(address)
            reason: BaseException = exc
            if followed is not None and self.resume is not None and framing == "chunked":
                try:
                    await self.resume.resume(followed, self.pool, writer)
                    return request.keep_alive
                except ClientGone:
                    self.gate.counters.client_gone += 1
                    return False
                except Exception as why:  # CannotResume, or a fault of the resume itself:
                    reason = why  # the stream still ends well formed
            return self._cut(request, writer, framing, sse is not None, reason)
        if framing == "chunked":
            writer.write(LAST_CHUNK)
        if body.kind in ("length", "chunked", "none") and b"close" not in head.tokens(
            b"connection"
        ):
            self.pool.put(conn)
        else:
            conn.close()
        await writer.drain()
        return keep

    def _cut(
        self,
        request: Request,
        writer: asyncio.StreamWriter,
        framing: str,
        events: bool,
        exc: BaseException,
    ) -> bool:
        """The server died mid-response: a stream ends with an error event and its end; any
        other body cannot be finished, so the connection closes."""
        self.gate.counters.cut += 1
        if not events or framing == "raw":
            return False
        message = f"the server ended mid-stream ({exc}); gpuwarden is bringing it back"
        event = b"data: " + error_body(self.gate.state, message) + b"\n\ndata: [DONE]\n\n"
        if framing == "chunked":
            writer.write(chunk(event) + LAST_CHUNK)
            return request.keep_alive
        writer.write(event)
        return False

    def _reject(
        self,
        writer: asyncio.StreamWriter,
        request: Request,
        exc: Rejected,
        arrived: float,
        held: bool,
    ) -> bool:
        extra = []
        if exc.retry_after_s is not None:
            extra.append(b"retry-after: %d\r\n" % exc.retry_after_s)
        held_s = time.monotonic() - arrived
        if held:
            extra.append(b"%s: %.3f\r\n" % (HELD_HEADER, held_s))
            self.gate.counters.held_for(held_s)
        extra.append(
            b"connection: keep-alive\r\n" if request.keep_alive else b"connection: close\r\n"
        )
        body = error_body(exc.state, exc.message, held_s=round(held_s, 3) if held else 0.0)
        writer.write(simple_response(503, b"Service Unavailable", body, extra))
        return request.keep_alive
