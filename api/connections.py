"""uvicorn's h11 protocol with bounded connections: a cap on how many, and deadlines while the
client has the turn.

uvicorn 0.55 arms its keep-alive timer only after a response, and disarms it on the next byte,
so a client that connects and says nothing, or sends half a request, holds its connection
forever; its `limit_concurrency` answers 503 only after reading a whole request. Here each
connection has one timer for the phase it is in:

- headers: from the connection (or the next request's first byte) to the end of the headers,
  `header_timeout_s`, however slowly the bytes trickle in; then 408 and close;
- body: from the end of the headers to the end of the body, `body_timeout_s`; then close (the
  app gets a disconnect);
- idle: between requests, `keep_alive_s`; then close.

While the app has the request (a stream, a `restart?wait=true`) nothing is timed: the client
is waiting on us, not the other way round.

At `max_connections`, a new connection takes the place of the oldest one that is waiting on its
client (idle between requests, or not yet done sending its request's headers), as nginx reuses
its idle connections: about 300 idle sockets from any local process otherwise held every slot,
and `/healthz`, `/readyz` and `gpuwarden stop` got 503 until the flood stopped. A connection
whose request the app holds is never the one evicted; only when every connection is such a one
does the newcomer get 503. A newcomer sends its request at once, so a flood has to open the cap's
worth of connections after it, before its headers are in, to push it out.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, ClassVar, cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.utils import get_remote_addr

from gpuwarden.daemon import logsetup
from gpuwarden.daemon.logsetup import Repeats
from gpuwarden.daemon.settings import HttpLimits

log = logsetup.get_logger("gpuwarden")


def canned(status: int, reason: str, error: str, detail: str) -> bytes:
    """A whole response written straight to the socket, for when no request is parsed."""
    body = json.dumps({"error": error, "detail": detail}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


BUSY = canned(503, "Service Unavailable", "busy", "too many connections; try again")
SLOW = canned(408, "Request Timeout", "timeout", "the request's headers came too slowly")


class GuardedH11Protocol(H11Protocol):
    limits: ClassVar[HttpLimits]  # bound by guarded_h11()
    repeats: ClassVar[Repeats]
    # The connections waiting on their client, oldest first (one registry per server).
    waiting: ClassVar[dict[GuardedH11Protocol, None]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: str | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._served = False  # a response went out: the next wait is keep-alive idle
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections and not self._evict_oldest():
            # Refused before any parsing or task: the cap holds under a flood.
            self._refused = True
            self.transport = transport
            self.client = get_remote_addr(transport)
            transport.write(BUSY)
            transport.close()
            self._note("api.connection_refused", max_connections=self.limits.max_connections)
            return
        super().connection_made(transport)
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_phase(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._unset_keepalive_if_required()  # the idle phase below replaces uvicorn's timer
        self._served = True
        self._follow()

    def _follow(self) -> None:
        """Arm the timer of the phase the connection is in (kept if the phase is unchanged)."""
        if self.transport.is_closing():
            self._set_phase(None)
            return
        theirs, ours = self.conn.their_state, self.conn.our_state
        if theirs is h11.IDLE and ours is h11.IDLE:
            waiting = self._served and not self.conn.trailing_data[0]
            self._set_phase("idle" if waiting else "headers")
        elif theirs is h11.SEND_BODY:
            self._set_phase("body")
        else:
            self._set_phase(None)

    def _evict_oldest(self) -> bool:
        """Close the connection that has waited longest on its client, to make room."""
        if not self.waiting:
            return False
        victim = next(iter(self.waiting))
        phase = victim._phase
        victim._set_phase(None)  # out of the registry: the next newcomer picks another
        if phase == "headers":  # it may be a client about to send: tell it why
            victim.transport.write(BUSY)
        victim.transport.close()
        victim._note("api.connection_evicted", phase=phase)
        return True

    def _set_phase(self, phase: str | None) -> None:
        if phase == self._phase:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.waiting.pop(self, None)
        self._phase = phase
        if phase in ("headers", "idle"):
            self.waiting[self] = None
        if phase is not None:
            limit = {
                "headers": self.limits.header_timeout_s,
                "body": self.limits.body_timeout_s,
                "idle": self.limits.keep_alive_s,
            }[phase]
            self._timer = self.loop.call_later(limit, self._expired, phase)

    def _expired(self, phase: str) -> None:
        self._timer = None
        self.waiting.pop(self, None)  # closing: no longer one to evict
        if self.transport.is_closing():
            return
        if phase == "headers":
            self.transport.write(SLOW)
        if phase != "idle":
            self._note("api.connection_timed_out", phase=phase)
        self.transport.close()

    def _note(self, event: str, **fields: object) -> None:
        if self.repeats.admit(event):
            log.warning(event, client=_addr(self.client), **fields)


def _addr(client: tuple[str, int] | None) -> str | None:
    return f"{client[0]}:{client[1]}" if client else None


def guarded_h11(limits: HttpLimits, repeats: Repeats) -> type[H11Protocol]:
    """The protocol class for uvicorn.Config(http=...), bound to these limits."""
    fields = {"limits": limits, "repeats": repeats, "waiting": {}}
    return cast(type[H11Protocol], type("GuardedH11Protocol", (GuardedH11Protocol,), fields))
