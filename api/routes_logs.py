"""Server logs: a launch's tail, and a live stream (server-sent events)."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sse_starlette.event import ensure_bytes
from sse_starlette.sse import EventSourceResponse, SendTimeoutError
from starlette.types import Receive, Scope, Send

from gpuwarden.api.deps import SettingsDep, SupervisorDep
from gpuwarden.api.models import errors
from gpuwarden.daemon import history as launches
from gpuwarden.daemon import logsetup
from gpuwarden.daemon.errors import CommandError
from gpuwarden.daemon.logfiles import read_tail
from gpuwarden.daemon.logring import LogCursor, LogFeed
from gpuwarden.daemon.supervisor import Supervisor

router = APIRouter(tags=["logs"])
log = logsetup.get_logger("gpuwarden.api")
RESTORE_WAIT_S = 30.0  # an earlier launch asked for while the daemon boots waits this long
BATCH_LINES = 256  # lines per send to a stream client: one write of at most a few hundred KiB
SEP = "\r\n"  # sse-starlette's separator


class LogTail(BaseModel):
    launch_id: str | None
    config: str | None
    log_file: str | None
    lines: list[str]
    note: str | None = None


async def _launch_record(supervisor: Supervisor, launch: str | None) -> dict[str, Any] | None:
    """None: the current launch. 'previous': the one before it. Else by id. An earlier launch
    is looked up once the previous life's history is restored (its record keeps the digests
    of the secrets that launch ran with): never served unmasked while the daemon boots."""
    if launch is not None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(supervisor.restored(), RESTORE_WAIT_S)
    snap = supervisor.snapshot()
    if launch is None or launch == snap.launch_id:
        return None  # served from the ring
    if launch == "previous":
        earlier = launches.previous(snap.history, snap.launch_id)
        if earlier is None:
            raise CommandError("not_found", "no previous launch")
        return dict(earlier)
    found = launches.find(snap.history, launch)
    if found is not None:
        return dict(found)
    # Older than the history kept in state.json, or from a state file since lost: a launch whose
    # log file exists is found by its id (validated: it names a file, never a path).
    if LAUNCH_ID_RE.match(launch):
        pattern = f"*/{launch}.log"
        paths = await asyncio.to_thread(lambda: sorted(supervisor.settings.log_dir.glob(pattern)))
        for path in paths:
            return {"launch_id": launch, "config": path.parent.name, "log_file": str(path)}
    raise CommandError("not_found", f"unknown launch {launch!r}")


LAUNCH_ID_RE = re.compile(r"^\d{8}T\d{6}-\d{6}$")


@router.get(
    "/logs",
    summary="The tail of a launch's log (default: the current one; `previous`: the one before)",
    response_model=LogTail,
    responses=errors(400, 401, 404),
)
async def logs(
    supervisor: SupervisorDep,
    lines: Annotated[int, Query(ge=0, le=100000)] = 100,
    launch: Annotated[str | None, Query(description="a launch id, or `previous`")] = None,
) -> Response:
    """Up to 100,000 lines, each masked: the masking and the JSON are done on a thread (twenty
    such requests on the loop held `/healthz` for 6.9 s), as are the earlier launch's file and
    its config."""
    record = await _launch_record(supervisor, launch)
    snap = supervisor.snapshot()
    if record is None:
        if snap.log is None:
            return JSONResponse(
                LogTail(
                    launch_id=None,
                    config=snap.intent_config,
                    log_file=None,
                    lines=[],
                    note="no launch has produced a log yet",
                ).model_dump()
            )
        raw = [e.text for e in snap.log.ring.tail(lines)]  # the ring changes under the loop
        current = LogTail(
            launch_id=snap.launch_id,
            config=snap.launch_config,
            log_file=str(snap.log.path),
            lines=[],
        )

        def ring_answer() -> JSONResponse:
            masked = [snap.redactor.text(t) for t in raw]
            return JSONResponse(current.model_dump() | {"lines": masked})

        return await asyncio.to_thread(ring_answer)

    def file_answer() -> JSONResponse:
        # Masking an earlier launch's secrets by digest costs a hash per word: here too.
        redactor = supervisor.redactor_for(record)
        path = record.get("log_file")
        text = read_tail(Path(path), lines) if path else []
        tail = LogTail(
            launch_id=record["launch_id"],
            config=record.get("config"),
            log_file=path,
            lines=[],
            note=None if text else "the log file is gone (retention) or empty",
        )
        return JSONResponse(tail.model_dump() | {"lines": [redactor.text(t) for t in text]})

    return await asyncio.to_thread(file_answer)


@router.get(
    "/logs/stream",
    summary="Server-sent events, one per log line (`history` lines first)",
    response_class=EventSourceResponse,
    responses=errors(401),
)
async def stream(
    request: Request,
    supervisor: SupervisorDep,
    settings: SettingsDep,
    history: Annotated[int, Query(ge=0, le=10000)] = 0,
) -> EventSourceResponse:
    feed: LogFeed = request.app.state.log_feed
    cursor = LogCursor(lambda: supervisor.snapshot().log, history)

    async def events() -> AsyncIterator[bytes]:
        with feed.reading():
            while True:
                # After a disconnect uvicorn's send returns at once, so a reader with lines to
                # send never waits on anything a cancellation could land on: ask, every batch.
                if await request.is_disconnected():
                    return
                dropped, lines = cursor.read(BATCH_LINES)
                if not dropped and not lines:
                    await feed.wait()
                    continue
                yield encode(dropped, lines)

    return LogStreamResponse(
        events(),
        ping=settings.log_stream.heartbeat_s,
        sep=SEP,
        send_timeout=settings.log_stream.send_timeout_s,
    )


def encode(dropped: int, lines: list[str]) -> bytes:
    """A batch as the events sse-starlette would write one by one (`event: line`, and
    `event: dropped` before them when the reader fell behind the ring), for one send."""
    out = []
    if dropped:
        out.append(f"event: dropped{SEP}data: {dropped} lines dropped (slow reader){SEP}{SEP}")
    for line in lines:
        if "\r" in line or "\n" in line:  # not from the ring (its lines are split and collapsed)
            out.append(ensure_bytes({"event": "line", "data": line}, SEP).decode())
        else:
            out.append(f"event: line{SEP}data: {line}{SEP}{SEP}")
    return "".join(out).encode()


class LogStreamResponse(EventSourceResponse):
    """A stream whose client stopped reading for `send_timeout` is ended, and said so in the
    daemon's log: it would otherwise hold its socket buffers for as long as the client lives."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except* SendTimeoutError:
            client = scope.get("client") or ("?", 0)
            log.warning(
                "api.log_stream_dropped",
                client=f"{client[0]}:{client[1]}",
                detail=f"the client read nothing for {self.send_timeout:g} s",
            )
