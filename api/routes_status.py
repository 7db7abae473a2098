"""`/healthz` (the daemon itself) and `/status` (the server as the supervisor sees it)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gpuwarden.api.deps import SupervisorDep
from gpuwarden.api.models import errors

router = APIRouter(tags=["status"])
public = APIRouter(tags=["status"])


@public.get("/healthz", summary="The daemon is alive (no auth)")
async def healthz() -> dict[str, Any]:
    return {"ok": True}


@router.get(
    "/status",
    summary="State, config, last exit, GPUs and server metrics",
    responses=errors(401),
)
async def status(request: Request, supervisor: SupervisorDep) -> dict[str, Any]:
    return {**supervisor.status(), "log_streams": request.app.state.log_feed.readers}
