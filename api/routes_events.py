"""Events (launches, exits, restarts, swaps, rollbacks, ...) and Prometheus metrics.

prometheus_client is imported on the first scrape (``metrics.py``): a daemon that nobody scrapes
does not carry it.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel

from gpuwarden.api.deps import SupervisorDep
from gpuwarden.api.models import errors

router = APIRouter(tags=["events"])


class EventList(BaseModel):
    events: list[dict[str, Any]]


@router.get(
    "/events",
    summary="Recent events, oldest first (persisted in events.jsonl); `after` pages on",
    responses=errors(400, 401),
)
async def events(
    supervisor: SupervisorDep,
    limit: Annotated[int, Query(ge=1, le=2000)] = 100,
    kind: Annotated[str | None, Query(description="only events of this kind")] = None,
    after: Annotated[
        int | None,
        Query(ge=0, description="the first `limit` events whose seq follows this one (a cursor)"),
    ] = None,
) -> EventList:
    return EventList(events=supervisor.events.recent(limit, kind, after))


@router.get(
    "/metrics",
    summary="Prometheus text exposition",
    response_class=Response,
    responses={**errors(401), 200: {"content": {"text/plain": {}}}},
)
async def metrics(request: Request) -> Response:
    # On the first scrape (prometheus_client is not imported before).
    from .metrics import Metrics  # noqa: PLC0415

    state = request.app.state
    if state.metrics is None:
        state.metrics = Metrics(state.supervisor, state.log_feed)
    body = await state.metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
