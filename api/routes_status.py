"""`/healthz` (the daemon itself), `/readyz` (the server serves) and `/status` (the server as the
supervisor sees it)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gpuwarden.api.deps import SupervisorDep
from gpuwarden.api.models import errors
from gpuwarden.daemon.states import ServerState

router = APIRouter(tags=["status"])
public = APIRouter(tags=["status"])


@public.get(
    "/healthz",
    summary="The daemon is alive and supervising (no auth; `booting` while it restores its "
    "previous life); 503 when supervision is stuck",
    responses={503: {"description": "supervision is stuck (the detail says why)"}},
)
async def healthz(supervisor: SupervisorDep) -> Any:
    stuck = supervisor.stuck()
    if stuck is not None:
        return JSONResponse({"ok": False, "detail": stuck}, status_code=503)
    return {"ok": True, "booting": supervisor.booting()}


@public.get(
    "/readyz",
    summary="200 while the server is ready, else 503 (no auth)",
    responses=errors(503),
)
async def readyz(supervisor: SupervisorDep) -> Any:
    state = supervisor.snapshot().state
    if state == ServerState.READY:
        return {"ok": True, "state": str(state)}
    return JSONResponse(
        {"error": "not_ready", "detail": f"the server is {state}", "state": str(state)}, 503
    )


@router.get(
    "/status",
    summary="State, config, last exit, GPUs and server metrics",
    responses=errors(401),
)
async def status(request: Request, supervisor: SupervisorDep) -> dict[str, Any]:
    return {
        **supervisor.status(),
        "log_streams": request.app.state.log_feed.readers,
        "compile_cache": supervisor.host.caches.view(),
        "weight_cache": supervisor.host.sidecar.view(),
    }
