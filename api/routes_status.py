"""`/healthz` (the daemon itself) and `/status` (the server as the supervisor sees it)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gpuwarden.api.deps import SupervisorDep
from gpuwarden.api.models import errors

router = APIRouter(tags=["status"])
public = APIRouter(tags=["status"])


@public.get(
    "/healthz",
    summary="The daemon is alive and supervising (no auth); 503 when supervision is stuck",
    responses={503: {"description": "supervision is stuck (the detail says why)"}},
)
async def healthz(supervisor: SupervisorDep) -> Any:
    stuck = supervisor.stuck()
    if stuck is not None:
        return JSONResponse({"ok": False, "detail": stuck}, status_code=503)
    return {"ok": True}


@router.get(
    "/status",
    summary="State, config, last exit, GPUs and server metrics",
    responses=errors(401),
)
async def status(supervisor: SupervisorDep) -> dict[str, Any]:
    return supervisor.status()
