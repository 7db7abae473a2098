"""Readiness and liveness probes: an HTTP GET that must answer 200 within a timeout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import httpx


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str


class Prober(Protocol):
    async def probe(self, url: str, timeout_s: float) -> ProbeResult: ...

    async def close(self) -> None: ...


class HttpProber:
    def __init__(self) -> None:
        # No proxies from the environment: the server is local.
        self._client = httpx.AsyncClient(trust_env=False)

    async def probe(self, url: str, timeout_s: float) -> ProbeResult:
        try:
            res = await self._client.get(url, timeout=timeout_s)
        except httpx.TimeoutException:
            return ProbeResult(False, f"GET {url}: no answer within {timeout_s:g} s")
        except httpx.HTTPError as exc:
            return ProbeResult(False, f"GET {url}: {type(exc).__name__}: {exc}")
        if res.status_code == 200:
            return ProbeResult(True, f"GET {url}: 200")
        return ProbeResult(False, f"GET {url}: {res.status_code}")

    async def close(self) -> None:
        await self._client.aclose()
