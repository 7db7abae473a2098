"""Readiness and liveness probes: an HTTP GET that must answer 200 within a timeout.

A probe is one request on a fresh connection to a server on this host, so it needs no client
library: a status line read with asyncio streams. (httpx cost the idle daemon about 4 MiB of
imports and an SSL context for a request that is one line each way.)
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from .redact import mask_url_passwords

MAX_HEAD_BYTES = 64 * 1024  # a status line and headers past this are not a health answer


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str


class Prober(Protocol):
    async def probe(self, url: str, timeout_s: float) -> ProbeResult: ...

    async def close(self) -> None: ...


class ProbeError(Exception):
    """The request could not be made or the answer was not HTTP."""


def _request(url: str) -> tuple[str, int, bool, bytes]:
    """Host, port, TLS and the request's bytes for `url`; ProbeError when it is no HTTP URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ProbeError(f"not an http(s) URL: {mask_url_passwords(url)!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise ProbeError(f"bad port in {mask_url_passwords(url)!r}") from exc
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if any(c in target for c in "\r\n "):
        raise ProbeError(f"the path of {mask_url_passwords(url)!r} has whitespace")
    host = parts.netloc.rpartition("@")[2]  # never send credentials in the Host header
    head = f"GET {target} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: gpuwarden\r\n"
    head += "Accept: */*\r\nConnection: close\r\n\r\n"
    return parts.hostname, port, parts.scheme == "https", head.encode("latin-1")


async def get_status(url: str) -> int:
    """The status code a GET of `url` answers (the body is not read)."""
    host, port, tls, request = _request(url)
    reader, writer = await asyncio.open_connection(
        host, port, ssl=ssl.create_default_context() if tls else None, limit=MAX_HEAD_BYTES
    )
    try:
        writer.write(request)
        await writer.drain()
        line = await reader.readuntil(b"\r\n")
        version, _, rest = line.decode("latin-1").partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/") or not code.isdigit():
            raise ProbeError(f"not an HTTP answer: {line[:80]!r}")
        # The headers, so the server sees its answer taken before the connection closes.
        while await reader.readuntil(b"\r\n") != b"\r\n":
            pass
        return int(code)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        raise ProbeError(f"the answer ended early or is too long: {exc}") from None
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()


class HttpProber:
    async def probe(self, url: str, timeout_s: float) -> ProbeResult:
        shown = mask_url_passwords(url)  # what the result says goes to events and the log
        try:
            async with asyncio.timeout(timeout_s):
                code = await get_status(url)
        except TimeoutError:
            return ProbeResult(False, f"GET {shown}: no answer within {timeout_s:g} s")
        except (OSError, ProbeError, ssl.SSLError, UnicodeError) as exc:
            why = mask_url_passwords(str(exc))
            return ProbeResult(False, f"GET {shown}: {type(exc).__name__}: {why}")
        if code == 200:
            return ProbeResult(True, f"GET {shown}: 200")
        return ProbeResult(False, f"GET {shown}: {code}")

    async def close(self) -> None:
        """Nothing is kept between probes."""
