"""The CLI's HTTP client: one request, or one stream of lines, to the daemon.

The CLI speaks HTTP/1.1 to one daemon, one request per connection: the standard library's
``http.client`` covers that and imports in a few milliseconds, where httpx pulled in rich,
pygments and click for its own command line and doubled the CLI's start. Failures read as
httpx worded them, so the CLI's messages are unchanged.
"""

from __future__ import annotations

import codecs
import http.client
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from email.message import Message
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

STREAM_READ_BYTES = 64 * 1024
LINE_ENDS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # where str.splitlines splits


class TransportError(Exception):
    """No complete answer; the message says why."""


class InvalidUrl(TransportError):
    """A URL this client cannot send a request to."""


class ConnectFailed(TransportError):
    """Nothing took the connection: refused, an unknown name, an unreachable network."""


@dataclass(frozen=True)
class Response:
    status_code: int
    headers: Message
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode(self.headers.get_content_charset() or "utf-8", "replace")

    def json(self) -> Any:
        """The body as JSON; ValueError if it is not."""
        return json.loads(self.content)


class Stream:
    """A response whose body is read as it comes, line by line."""

    def __init__(self, res: http.client.HTTPResponse) -> None:
        self._res = res
        self.status_code = res.status

    def iter_lines(self) -> Iterator[str]:
        """The body's lines without their endings, split as str.splitlines splits (a \r\n
        split across two reads is one ending). A body cut short raises TransportError:
        `readline()` of http.client would take a cut chunked body for its end."""
        decode = codecs.getincrementaldecoder(self._res.headers.get_content_charset() or "utf-8")(
            "replace"
        ).decode
        pending, received = "", 0
        while True:
            try:
                data = self._res.read1(STREAM_READ_BYTES)
            except (http.client.HTTPException, OSError) as exc:
                raise TransportError(_describe(exc, self._res.chunked)) from exc
            received += len(data)
            if not data:
                if self._res.length:  # a Content-Length body that ended early
                    raise TransportError(
                        "peer closed connection without sending complete message body "
                        f"(received {received} bytes, expected {received + self._res.length})"
                    )
                yield from (pending + decode(b"", final=True)).splitlines()
                return
            lines = (pending + decode(data)).splitlines(keepends=True)
            pending = ""
            if lines and (lines[-1][-1] not in LINE_ENDS or lines[-1].endswith("\r")):
                pending = lines.pop()  # unfinished, or a \r whose \n may come next
            for line in lines:
                yield line.splitlines()[0]


class Client:
    """Requests to the daemon at `base_url`, each on its own connection.

    `timeout` bounds the connect and each read or write (None: no bound). A path is taken
    relative to the base URL's own path. No proxy from the environment is used."""

    def __init__(
        self, base_url: str, headers: Mapping[str, str], timeout: float | None = 30.0
    ) -> None:
        self.base_url = base_url
        self.headers = {"Accept": "*/*", "User-Agent": "gpuwarden", **headers}
        self.timeout = timeout

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        conn, res = self._send(method, path, params, json, headers)
        try:
            try:
                return Response(res.status, res.headers, res.read())
            except (http.client.HTTPException, OSError) as exc:
                raise TransportError(_describe(exc, res.chunked)) from exc
        finally:
            conn.close()

    @contextmanager
    def stream(
        self, method: str, path: str, *, params: Mapping[str, Any] | None = None
    ) -> Iterator[Stream]:
        conn, res = self._send(method, path, params, None, None)
        try:
            yield Stream(res)
        finally:
            conn.close()

    def _send(
        self,
        method: str,
        path: str,
        params: Mapping[str, Any] | None,
        body: Any,
        headers: Mapping[str, str] | None,
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn, prefix = self._connection()
        target = prefix + quote(path, safe="/%:@!$&'()*+,;=-._~")
        if params:
            target += "?" + urlencode(params)
        all_headers = {**self.headers, **(headers or {})}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            all_headers["Content-Type"] = "application/json"
        try:
            conn.connect()
        except (TimeoutError, http.client.HTTPException) as exc:
            conn.close()
            raise TransportError(_describe(exc)) from exc
        except OSError as exc:
            conn.close()
            raise ConnectFailed(_describe(exc)) from exc
        try:
            conn.request(method, target, body=data, headers=all_headers)
            return conn, conn.getresponse()
        except (http.client.HTTPException, OSError) as exc:
            conn.close()
            raise TransportError(_describe(exc)) from exc

    def _connection(self) -> tuple[http.client.HTTPConnection, str]:
        """A connection to the base URL (not yet connected), and its path prefix."""
        if "://" not in self.base_url:
            raise InvalidUrl("Request URL is missing an 'http://' or 'https://' protocol.")
        try:
            url = urlsplit(self.base_url)
        except ValueError as exc:  # an unclosed [ of an IPv6 address
            raise InvalidUrl(str(exc)) from exc
        if url.scheme not in ("http", "https"):
            raise InvalidUrl(f"Request URL has an unsupported protocol '{url.scheme}://'.")
        try:
            port = url.port
        except ValueError as exc:
            raise InvalidUrl(f"Invalid port: {url.netloc.rpartition(':')[2]!r}") from exc
        if not url.hostname:
            raise InvalidUrl("Request URL is missing a host.")
        conn: http.client.HTTPConnection
        if url.scheme == "https":
            conn = http.client.HTTPSConnection(url.hostname, port, timeout=self.timeout)
        else:
            conn = http.client.HTTPConnection(url.hostname, port, timeout=self.timeout)
        return conn, url.path.rstrip("/")


def _describe(exc: BaseException, chunked: bool = False) -> str:
    """httpx's wording for the failures the CLI has always reported."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "Server disconnected without sending a response."
    if isinstance(exc, http.client.IncompleteRead):
        if chunked or exc.expected is None:
            return (
                "peer closed connection without sending complete message body "
                "(incomplete chunked read)"
            )
        got = len(exc.partial)
        return (
            "peer closed connection without sending complete message body "
            f"(received {got} bytes, expected {got + exc.expected})"
        )
    return str(exc)
