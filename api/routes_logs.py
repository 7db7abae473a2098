"""Server logs: a launch's tail, and a live stream (server-sent events)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel
from sse_starlette.sse import EventSourceResponse

from gpuwarden.api.deps import SupervisorDep
from gpuwarden.api.models import errors
from gpuwarden.daemon.serverlog import read_tail
from gpuwarden.daemon.supervisor import CommandError, Supervisor

router = APIRouter(tags=["logs"])
STREAM_QUEUE = 2000  # lines buffered per stream client; beyond it the oldest are dropped


class LogTail(BaseModel):
    launch_id: str | None
    config: str | None
    log_file: str | None
    lines: list[str]
    note: str | None = None


def _launch_record(supervisor: Supervisor, launch: str | None) -> dict[str, Any] | None:
    """None: the current launch. 'previous': the one before it. Else by id."""
    history = supervisor.launch_history
    current = supervisor.launch.launch_id if supervisor.launch else None
    if launch is None:
        return None
    if launch == "previous":
        earlier = [h for h in history if h["launch_id"] != current]
        if not earlier:
            raise CommandError(404, "not_found", "no previous launch")
        record: dict[str, Any] = earlier[-1]
        return record
    for h in reversed(history):
        if h["launch_id"] == launch:
            found: dict[str, Any] = h
            return found
    if launch == current:
        return None
    raise CommandError(404, "not_found", f"unknown launch {launch!r}")


@router.get(
    "/logs",
    summary="The tail of a launch's log (default: the current one; `previous`: the one before)",
    responses=errors(400, 401, 404),
)
async def logs(
    supervisor: SupervisorDep,
    lines: Annotated[int, Query(ge=0, le=100000)] = 100,
    launch: Annotated[str | None, Query(description="a launch id, or `previous`")] = None,
) -> LogTail:
    record = _launch_record(supervisor, launch)
    if record is None:
        current = supervisor.launch
        if current is None or current.log is None:
            return LogTail(
                launch_id=None,
                config=supervisor.intent_config,
                log_file=None,
                lines=[],
                note="no launch has produced a log yet",
            )
        return LogTail(
            launch_id=current.launch_id,
            config=current.config.name,
            log_file=str(current.log.path),
            lines=supervisor.ring_lines(lines),
        )
    redactor = supervisor.redactor_for(record.get("config"))
    path = record.get("log_file")
    text = await asyncio.to_thread(read_tail, _path(path), lines) if path else []
    return LogTail(
        launch_id=record["launch_id"],
        config=record.get("config"),
        log_file=path,
        lines=[redactor.text(t) for t in text],
        note=None if text else "the log file is gone (retention) or empty",
    )


def _path(p: str) -> Any:
    from pathlib import Path  # noqa: PLC0415

    return Path(p)


@router.get(
    "/logs/stream",
    summary="Server-sent events, one per log line (`history` lines first)",
    response_class=EventSourceResponse,
    responses=errors(401),
)
async def stream(
    request: Request,
    supervisor: SupervisorDep,
    history: Annotated[int, Query(ge=0, le=10000)] = 0,
) -> EventSourceResponse:
    queue: asyncio.Queue[str] = asyncio.Queue(maxsize=STREAM_QUEUE)
    dropped = 0

    def listener(batch: list[str]) -> None:
        nonlocal dropped
        redactor = supervisor.current_redactor()
        for line in batch:
            if queue.full():  # a slow client loses its oldest lines, never slows the daemon
                queue.get_nowait()
                dropped += 1
            queue.put_nowait(redactor.text(line))

    async def events() -> AsyncIterator[dict[str, Any]]:
        nonlocal dropped
        for line in supervisor.ring_lines(history):
            yield {"event": "line", "data": line}
        supervisor.line_listeners.add(listener)
        try:
            while True:
                line = await queue.get()
                if dropped:
                    yield {"event": "dropped", "data": f"{dropped} lines dropped (slow reader)"}
                    dropped = 0
                yield {"event": "line", "data": line}
        finally:
            supervisor.line_listeners.discard(listener)

    return EventSourceResponse(events(), ping=15)
