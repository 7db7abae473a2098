"""The probe against real sockets: servers that answer, refuse, stall or speak no HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gpuwarden.daemon.health import HttpProber

from .support.procs import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/health?x=1"
    finally:
        server.close()


def _answering(head: bytes, seen: list[bytes] | None = None) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        if seen is not None:
            seen.append(request)
        writer.write(head)
        await writer.drain()
        writer.close()

    return handle


@pytest.fixture
async def url_of() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    gens: list[AsyncIterator[str]] = []

    async def start(handler: Handler) -> str:
        gen = _serve(handler)
        gens.append(gen)
        return await gen.__anext__()

    yield start
    for gen in gens:
        with pytest.raises(StopAsyncIteration):
            await gen.__anext__()


async def test_a_200_is_healthy_and_the_request_is_plain_http(
    url_of: Callable[[Handler], Awaitable[str]],
) -> None:
    seen: list[bytes] = []
    url = await url_of(_answering(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", seen))
    result = await HttpProber().probe(url, 5)
    assert result.ok, result.detail
    assert seen[0].startswith(b"GET /health?x=1 HTTP/1.1\r\nHost: 127.0.0.1:")


async def test_other_codes_and_non_http_answers_are_unhealthy(
    url_of: Callable[[Handler], Awaitable[str]],
) -> None:
    prober = HttpProber()
    r503 = await prober.probe(await url_of(_answering(b"HTTP/1.1 503 Busy\r\n\r\n")), 5)
    assert (r503.ok, r503.detail.endswith(": 503")) == (False, True)
    garbage = await prober.probe(await url_of(_answering(b"SSH-2.0-OpenSSH\r\n\r\n")), 5)
    assert not garbage.ok and "not an HTTP answer" in garbage.detail
    cut = await prober.probe(await url_of(_answering(b"HTTP/1.1 200 OK\r\nX: y")), 5)
    assert not cut.ok and "ended early" in cut.detail


async def test_a_server_that_never_answers_is_a_timeout(
    url_of: Callable[[Handler], Awaitable[str]],
) -> None:
    release = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()
        writer.close()

    result = await HttpProber().probe(await url_of(silent), 0.2)
    release.set()
    assert not result.ok and "no answer within 0.2 s" in result.detail


async def test_a_closed_port_and_a_bad_url_are_unhealthy_not_errors() -> None:
    prober = HttpProber()
    closed = await prober.probe(f"http://127.0.0.1:{free_port()}/health", 5)
    assert not closed.ok and "ConnectionRefusedError" in closed.detail
    for bad in ("ftp://127.0.0.1/x", "http:///nohost", "http://127.0.0.1:99999/"):
        result = await prober.probe(bad, 5)
        assert not result.ok and "ProbeError" in result.detail, (bad, result.detail)
