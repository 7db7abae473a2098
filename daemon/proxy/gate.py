"""The gate: whether a request goes to the server now, waits for it, or is answered 503.

The daemon sets it (`set`) on every change of the server's state: `open` (ready, its
address), `hold` (on its way back: waiting for GPUs, starting, backing off, unhealthy, stopping
for a restart or swap) or `reject` (failed, stopped, stopping for a stop). A proxy that has not
heard from the daemon yet holds, and it keeps the last word while the daemon is away.

Held requests wait in arrival order and are released together the moment the gate opens. A
request whose server refuses it while the gate is open (it died a moment before the daemon
said so) is held too: the gate counts its server down until the daemon's next word, or until
a probe connects again. Bounds: `max_held` requests, `max_held_bytes` of their bodies, and
`hold_timeout_s` from arrival; past them a request is answered 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

PROBE_S = 0.1
PROBE_TIMEOUT_S = 1.0
DEFAULT_RETRY_AFTER_S = 5
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
MODES = ("open", "hold", "reject")
HELD_LISTED = 10


class Rejected(Exception):
    """Answered 503: the gate rejects, a bound was reached, or the hold timed out."""

    def __init__(self, state: str, message: str, retry_after_s: int | None) -> None:
        super().__init__(message)
        self.state, self.message, self.retry_after_s = state, message, retry_after_s


class Gone(Exception):
    """The client went away while its request was held."""


@dataclass
class Limits:
    hold_timeout_s: float = 600.0
    max_held: int = 1000
    max_held_bytes: int = 268435456


@dataclass
class Counters:
    requests: int = 0
    released: int = 0  # held, then sent on
    rejected: int = 0  # answered 503
    retried: int = 0  # sent to a server that died before answering, sent again
    continued: int = 0  # streams cut by a dead server, continued on the next one
    cut: int = 0  # streams ended by a dead server with an error event
    client_gone: int = 0
    failed: int = 0  # answered 502: the server's answer could not be passed on
    hold_buckets: list[int] = field(default_factory=lambda: [0] * (len(HOLD_BUCKETS) + 1))
    hold_sum_s: float = 0.0
    last_resume: dict[str, Any] | None = None  # where the last continued stream went on

    def held_for(self, seconds: float) -> None:
        self.hold_sum_s += seconds
        for i, bound in enumerate(HOLD_BUCKETS):
            if seconds <= bound:
                self.hold_buckets[i] += 1
                return
        self.hold_buckets[-1] += 1

    def view(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "released": self.released,
            "rejected": self.rejected,
            "retried": self.retried,
            "continued": self.continued,
            "cut": self.cut,
            "client_gone": self.client_gone,
            "failed": self.failed,
            "last_resume": self.last_resume,
            "hold_seconds": {
                "buckets": list(HOLD_BUCKETS),
                "counts": list(self.hold_buckets),
                "sum": round(self.hold_sum_s, 6),
            },
        }


@dataclass(eq=False)
class Waiter:
    arrived: float
    size: int
    woken: asyncio.Future[None]
    what: str = ""  # its method and path


class Gate:
    def __init__(
        self, limits: Limits, healthy: Callable[[tuple[str, int]], Awaitable[bool]] | None
    ) -> None:
        self.limits = limits
        self.mode = "hold"
        self.state = "unknown"
        self.reason = "the daemon has not said how the server is"
        self.upstream: tuple[str, int] | None = None
        self.model: str | None = None  # what the server serves (a stream goes on only there)
        self.retry_after_s: int | None = None
        self.epoch = 0  # a new server (or a new word on it): pooled connections are stale
        self.down = False  # the server refused while open: held until the daemon's next word
        self.waiters: deque[Waiter] = deque()
        self.held_bytes = 0
        self.counters = Counters()
        self._healthy = healthy or _health
        self._probe: asyncio.Task[None] | None = None

    # -- the daemon's word -----------------------------------------------------------------

    def set(self, word: dict[str, Any]) -> None:
        """The daemon's word, checked whole before any of it applies (ValueError)."""
        mode = str(word.get("mode"))
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        upstream = word.get("upstream")
        address = None
        if mode == "open":
            ok = isinstance(upstream, (list, tuple)) and len(upstream) == 2
            host, port = (upstream[0], upstream[1]) if ok else (None, None)  # type: ignore[index]
            if not (isinstance(host, str) and host and type(port) is int and 0 < port < 65536):
                raise ValueError(f"upstream must be [host, port], got {upstream!r}")
            address = (host, port)
        retry = word.get("retry_after_s")
        if retry is not None and not (
            isinstance(retry, (int, float)) and math.isfinite(retry) and retry >= 0
        ):
            raise ValueError(f"retry_after_s must be a number of seconds, got {retry!r}")
        if address is not None:
            if address != self.upstream or self.mode != "open":
                self.epoch += 1
            self.upstream = address
        self.mode = mode
        self.model = str(word["model"]) if word.get("model") else self.model
        self.state = str(word.get("state") or mode)
        self.reason = str(word.get("reason") or "")
        self.retry_after_s = max(1, min(int(retry), 86400)) if retry is not None else None
        self.down = False
        self._wake()

    def refused(self, upstream: tuple[str, int]) -> None:
        """The server at `upstream` refused or dropped a request while the gate was open."""
        if self.mode != "open" or upstream != self.upstream or self.down:
            return
        self.down = True
        if self._probe is None or self._probe.done():
            self._probe = reported(asyncio.get_running_loop().create_task(self._probe_until_up()))

    async def _probe_until_up(self) -> None:
        """While the daemon has not said otherwise: the server is asked for its health until
        it answers 200 (a server that listens may still be loading)."""
        while self.down and self.mode == "open" and self.upstream is not None:
            await asyncio.sleep(PROBE_S)
            with contextlib.suppress(OSError, TimeoutError):
                if (
                    await asyncio.wait_for(self._healthy(self.upstream), PROBE_TIMEOUT_S)
                    and self.down
                ):
                    self.down = False
                    self._wake()

    def _wake(self) -> None:
        waiters, self.waiters = self.waiters, deque()
        for waiter in waiters:  # in arrival order
            self.held_bytes -= waiter.size
            if not waiter.woken.done():
                waiter.woken.set_result(None)

    # -- a request's pass ------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        return self.mode == "open" and not self.down

    def answer(self, arrived: float, why: str) -> Rejected:
        self.counters.rejected += 1
        state = self.state if self.mode != "open" else "unreachable"
        retry = None if self.mode == "reject" else self.retry_after_s or DEFAULT_RETRY_AFTER_S
        return Rejected(state, why, retry)

    async def admit(
        self, arrived: float, size: int, gone: asyncio.Future[Any] | None, what: str = ""
    ) -> tuple[str, int]:
        """The server's address once the request may go (it waits while the gate holds).
        Raises Rejected (503) or Gone (the client left)."""
        while True:
            if self.mode == "reject":
                raise self.answer(arrived, self._said())
            if self.usable and self.upstream is not None:
                return self.upstream
            if len(self.waiters) >= self.limits.max_held:
                raise self.answer(arrived, f"{len(self.waiters)} requests held already (max_held)")
            if self.held_bytes + size > self.limits.max_held_bytes:
                raise self.answer(arrived, f"{self.held_bytes} bytes held already (max_held_bytes)")
            left = self.limits.hold_timeout_s - (time.monotonic() - arrived)
            if left <= 0:
                raise self.answer(
                    arrived, f"held {self.limits.hold_timeout_s:g} s (hold_timeout_s)"
                )
            waiter = Waiter(arrived, size, asyncio.get_running_loop().create_future(), what)
            self.waiters.append(waiter)
            self.held_bytes += size
            waits: set[asyncio.Future[Any]] = {waiter.woken}
            if gone is not None:
                waits.add(gone)
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not waiter.woken.done():  # timed out, the client left, or cancelled
                    waiter.woken.cancel()
                    with contextlib.suppress(ValueError):
                        self.waiters.remove(waiter)
                        self.held_bytes -= size
            if gone is not None and gone.done():
                raise Gone()

    def _said(self) -> str:
        return f"the server is {self.state}" + (f": {self.reason}" if self.reason else "")

    def view(self) -> dict[str, Any]:
        now = time.monotonic()
        oldest = min((w.arrived for w in self.waiters), default=None)
        return {
            "mode": self.mode,
            "state": self.state,
            "upstream": f"{self.upstream[0]}:{self.upstream[1]}" if self.upstream else None,
            "down": self.down,
            "held": len(self.waiters),
            "held_bytes": self.held_bytes,
            "oldest_held_s": round(now - oldest, 3) if oldest is not None else None,
            "held_requests": [  # the first few, oldest first
                {"what": w.what, "held_s": round(now - w.arrived, 3), "bytes": w.size}
                for w in list(self.waiters)[:HELD_LISTED]
            ],
            **self.counters.view(),
        }


async def _health(address: tuple[str, int]) -> bool:
    """GET /health of the server at `address` answers 200."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nhost: gpuwarden\r\nconnection: close\r\n\r\n")
        return (await reader.readline()).split(b" ")[1:2] == [b"200"]
    finally:
        writer.close()


def reported(task: asyncio.Task[Any]) -> asyncio.Task[Any]:
    """`task`, whose failure goes to the loop's exception handler (the proxy's says it to the
    daemon and to its log) the moment it ends, not whenever it is collected."""

    def done(t: asyncio.Task[Any]) -> None:
        if not t.cancelled() and t.exception() is not None:
            t.get_loop().call_exception_handler(
                {"message": f"the proxy's task {t.get_name()} failed", "exception": t.exception()}
            )

    task.add_done_callback(done)
    return task
