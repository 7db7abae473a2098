"""HTTP/1.1 as the front proxy needs it: buffered reads, message heads, body framing decoded
from whatever has arrived, and server-sent events cut at event boundaries.

Bodies are decoded incrementally over one buffer per connection (no copy per token beyond the
slice), so a streamed response passes on as soon as its bytes arrive. Standard library only.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

READ_SIZE = 65536
MAX_HEAD = 65536
MAX_CHUNK_LINE = 4096
MAX_EVENT = 1 << 20  # bytes of an event stream with no event boundary, at most
VERSIONS = (b"HTTP/1.0", b"HTTP/1.1")
TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110's tchar
LENGTH = re.compile(rb"[0-9]{1,18}")
CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,15}")
STATUS = re.compile(rb"[1-5][0-9][0-9]")
WRITE_HIGH = 65536  # bytes waiting for a client before its answer waits for it
# Hop-by-hop fields (RFC 9110 7.6.1) and the framing, which the proxy sets itself.
HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"content-length",
        b"te",
        b"trailer",
        b"upgrade",
        b"expect",
    }
)


class ClientGone(Exception):
    """The client closed its connection while its answer was being written."""


async def send(writer: asyncio.StreamWriter, data: bytes) -> None:
    """Write to a client; wait only while its socket is full (it reads slowly)."""
    writer.write(data)
    if writer.transport.is_closing():
        raise ClientGone()
    if writer.transport.get_write_buffer_size() > WRITE_HIGH:
        try:
            await writer.drain()
        except OSError:
            raise ClientGone() from None


class Closed(Exception):
    """The peer closed the connection before the message was whole."""


class BadMessage(Exception):
    """What arrived is not HTTP/1.1 the proxy can pass on."""


class TooLarge(BadMessage):
    """A request body over the proxy's bound (413)."""


class Inbound:
    """Buffered reads from one connection's stream."""

    __slots__ = ("buf", "reader")

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.buf = bytearray()

    async def fill(self) -> bool:
        """More bytes into the buffer; False at the end of the stream."""
        data = await self.reader.read(READ_SIZE)
        if not data:
            return False
        self.buf += data
        return True

    async def head(self, limit: int = MAX_HEAD) -> bytes | None:
        """One message head (through its blank line); None at a clean end between messages."""
        start = 0
        while True:
            end = self.buf.find(b"\r\n\r\n", max(0, start - 3))
            if end >= 0:
                head = bytes(self.buf[: end + 4])
                del self.buf[: end + 4]
                return head
            if len(self.buf) > limit:
                raise BadMessage(f"a message head over {limit} bytes")
            start = len(self.buf)
            if not await self.fill():
                if self.buf.strip():
                    raise Closed("the connection closed inside a message head")
                return None

    async def exactly(self, size: int) -> bytes:
        while len(self.buf) < size:
            if not await self.fill():
                raise Closed(f"the connection closed {size - len(self.buf)} bytes short")
        data = bytes(self.buf[:size])
        del self.buf[:size]
        return data


@dataclass(slots=True)
class Head:
    first: bytes  # the request or status line
    fields: list[tuple[bytes, bytes]]  # (lower-case name, value), in order

    def get(self, name: bytes) -> bytes | None:
        found = None
        for key, value in self.fields:
            if key == name:
                found = value
        return found

    def tokens(self, name: bytes) -> set[bytes]:
        out: set[bytes] = set()
        for key, value in self.fields:
            if key == name:
                out.update(t.strip().lower() for t in value.split(b","))
        return out


def parse_head(data: bytes) -> Head:
    """A message head, strictly: a bare CR or LF, or a NUL, anywhere in it would let a peer
    that reads line ends more loosely see another message in it (request smuggling)."""
    lines = data[:-4].split(b"\r\n")
    if b"\x00" in data or any(b"\r" in line or b"\n" in line for line in lines):
        raise BadMessage("a bare CR or LF, or a NUL, in the head")
    fields = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not TOKEN.fullmatch(name):
            raise BadMessage(f"a malformed header line: {line[:80]!r}")
        fields.append((name.lower(), value.strip(b" \t")))
    return Head(lines[0], fields)


def content_length(head: Head) -> int | None:
    """Its Content-Length (None: none); several that differ, or one not digits, are refused."""
    values = {value for key, value in head.fields if key == b"content-length"}
    if not values:
        return None
    if len(values) > 1 or not all(LENGTH.fullmatch(v) for v in values):
        raise BadMessage(f"a bad or repeated content-length: {sorted(values)[:2]!r}")
    return int(values.pop())


def chunked(head: Head) -> bool:
    """Whether its body is chunked; any other transfer coding, or one beside a
    Content-Length, is refused (a peer could frame the message differently)."""
    coding = head.tokens(b"transfer-encoding")
    if not coding:
        return False
    if coding != {b"chunked"} or head.get(b"content-length") is not None:
        raise BadMessage(f"a transfer-encoding the proxy does not frame: {sorted(coding)!r}")
    return True


@dataclass(slots=True)
class Request:
    method: bytes
    target: bytes
    version: bytes
    head: Head
    body: bytes = b""

    @property
    def what(self) -> str:
        """Its method and path, as a person reads them (cut short)."""
        return (self.method + b" " + self.target[:200]).decode(errors="replace")

    @property
    def keep_alive(self) -> bool:
        conn = self.head.tokens(b"connection")
        if self.version == b"HTTP/1.0":
            return b"keep-alive" in conn
        return b"close" not in conn

    def upstream_bytes(self) -> bytes:
        """The request as the server gets it: HTTP/1.1, its body framed by length."""
        out = [b"%s %s HTTP/1.1\r\n" % (self.method, self.target)]
        out.extend(b"%s: %s\r\n" % kv for kv in self.head.fields if kv[0] not in HOP)
        if self.head.get(b"host") is None:  # (HTTP/1.0 needs none; 1.1 does)
            out.append(b"host: gpuwarden\r\n")
        out.append(b"content-length: %d\r\n\r\n" % len(self.body))
        out.append(self.body)
        return b"".join(out)


def parse_request(data: bytes) -> Request:
    head = parse_head(data)
    parts = head.first.split(b" ")
    if len(parts) != 3 or parts[2] not in VERSIONS or not TOKEN.fullmatch(parts[0]):
        raise BadMessage(f"not an HTTP/1.x request line: {head.first[:80]!r}")
    if not parts[1] or not parts[1].isascii():
        raise BadMessage(f"a bad request target: {parts[1][:80]!r}")
    return Request(parts[0], parts[1], parts[2], head)


async def read_body(inb: Inbound, head: Head, limit: int) -> bytes:
    """A request's body, whole (it is sent again if its server dies before answering)."""
    length = content_length(head)
    if length is not None and length > limit:
        raise TooLarge(f"a request body of {length} bytes, over {limit}")
    if not chunked(head) and length is None:
        return b""  # (a request without framing has no body)
    return await whole(inb, framing(head), limit)


async def whole(inb: Inbound, body: Body, limit: int) -> bytes:
    """A body decoded whole from `inb`: at most `limit` bytes (TooLarge), all of them (Closed)."""
    out = bytearray()
    while True:
        out += body.feed(inb.buf)
        if len(out) > limit:
            raise TooLarge(f"a body over {limit} bytes")
        if body.done:
            return bytes(out)
        if not await inb.fill():
            if body.kind == "close":
                return bytes(out)
            raise Closed("the connection closed inside a body")


class Body:
    """A response body's framing (`length`, `chunked`, `close` or `none`), decoded from the
    connection's buffer as bytes arrive."""

    __slots__ = ("_crlf", "_left", "_trailers", "done", "kind")

    def __init__(self, kind: str, length: int) -> None:
        self.kind = kind
        self._left = length if kind == "length" else 0
        self._crlf = 0
        self._trailers = False
        self.done = kind == "none" or (kind == "length" and length == 0)

    def feed(self, buf: bytearray) -> bytes:
        """The payload in `buf` so far (consumed from it)."""
        if self.kind == "close":
            data = bytes(buf)
            buf.clear()
            return data
        if self.kind == "length":
            take = min(self._left, len(buf))
            data = bytes(buf[:take])
            del buf[:take]
            self._left -= take
            self.done = self._left == 0
            return data
        out = bytearray()
        while buf and not self.done:
            if self._left:
                take = min(self._left, len(buf))
                out += buf[:take]
                del buf[:take]
                self._left -= take
                if not self._left:
                    self._crlf = 2
                continue
            if self._crlf:
                take = min(self._crlf, len(buf))
                del buf[:take]
                self._crlf -= take
                continue
            end = buf.find(b"\r\n")
            if end < 0:
                if len(buf) > MAX_CHUNK_LINE:
                    raise BadMessage("a chunk-size line too long")
                break
            line = bytes(buf[:end])
            del buf[: end + 2]
            if self._trailers:
                self.done = not line
                continue
            size_text = line.split(b";", 1)[0].strip(b" \t")
            if not CHUNK_SIZE.fullmatch(size_text):
                raise BadMessage(f"a bad chunk size: {line[:40]!r}")
            size = int(size_text, 16)
            if size == 0:
                self._trailers = True
            self._left = size
        return bytes(out)


def framing(head: Head) -> Body:
    """How a message's body is framed: chunked, by its length, or to the connection's end."""
    if chunked(head):
        return Body("chunked", 0)
    length = content_length(head)
    return Body("close", 0) if length is None else Body("length", length)


def response_body(request: Request, status: int, head: Head) -> Body:
    if request.method == b"HEAD" or status in (204, 304):
        return Body("none", 0)
    return framing(head)


def status_of(head: Head) -> int:
    parts = head.first.split(b" ", 2)
    if len(parts) < 2 or parts[0] not in VERSIONS or not STATUS.fullmatch(parts[1]):
        raise BadMessage(f"not an HTTP/1.x status line: {head.first[:80]!r}")
    return int(parts[1])


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"


class Events:
    """Server-sent events, passed on whole: bytes up to the last event boundary. A stream with
    no boundary for `MAX_EVENT` bytes is broken (its bytes would pile up)."""

    __slots__ = ("pending", "scanned")

    def __init__(self) -> None:
        self.pending = bytearray()
        self.scanned = 0  # bytes of `pending` known to hold no boundary

    def feed(self, data: bytes) -> bytes:
        self.pending += data
        start = max(0, self.scanned - 3)  # (a boundary may straddle the last read)
        lf, crlf = self.pending.rfind(b"\n\n", start), self.pending.rfind(b"\r\n\r\n", start)
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        if not end:
            self.scanned = len(self.pending)
            if self.scanned > MAX_EVENT:
                raise BadMessage(f"an event stream with no event boundary in {MAX_EVENT} bytes")
            return b""
        out = bytes(self.pending[:end])
        del self.pending[:end]
        self.scanned = len(self.pending)
        return out


def split_events(data: bytes) -> list[bytes]:
    """Each event's data (its `data:` lines joined), in order."""
    out = []
    for block in data.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [ln[5:].lstrip(b" ") for ln in block.split(b"\n") if ln.startswith(b"data:")]
        if lines:
            out.append(b"\n".join(lines))
    return out
