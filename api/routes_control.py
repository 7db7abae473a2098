"""Lifecycle commands: start, stop, restart (a swap when it names another config)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from gpuwarden.api.deps import SupervisorDep
from gpuwarden.api.models import Accepted, ConfigQuery, errors

router = APIRouter(tags=["control"])
ConfigParam = ConfigQuery


class Outcome(BaseModel):
    outcome: str
    reason: str | None = None
    evidence: str | None = None
    launch_ids: list[str] = []
    swap_id: str | None = None
    config: str | None = None
    state: str | None = None
    accepted: bool = True


@router.post(
    "/start",
    status_code=202,
    summary="Start a config (409 while a server runs: swap with restart)",
    responses=errors(400, 401, 404, 409, 422),
)
async def start(supervisor: SupervisorDep, config: ConfigParam = None) -> Accepted:
    return Accepted(**await supervisor.start(config))


@router.post(
    "/stop",
    status_code=202,
    summary="Stop the server and leave it stopped; wins over a start, swap or sweep",
    responses=errors(401),
)
async def stop(supervisor: SupervisorDep) -> Accepted:
    return Accepted(**await supervisor.stop())


@router.post(
    "/restart",
    status_code=202,
    summary="Restart the current config, or swap to another one (preflight first)",
    description="Without `wait`: 202 once accepted. With `wait=true`: 200 with the settled "
    "outcome (`ready`, `rolled_back` or `failed`); with `probation=true` (the default) a swap "
    "or restart that came up is answered once `probation_s` is over, so `ready` means it stayed "
    "up; a crash within it answers `rolled_back` (a restart of the current config, which has "
    "no rollback: `failed`). A swap whose preflight fails answers 422 at once "
    "and touches nothing.",
    responses={
        **errors(400, 401, 404, 409, 422),
        200: {"model": Outcome, "description": "settled (wait=true)"},
    },
)
async def restart(
    supervisor: SupervisorDep,
    config: ConfigParam = None,
    wait: Annotated[bool, Query(description="answer once the restart has settled")] = False,
    probation: Annotated[
        bool, Query(description="with wait: answer once the config brought up passed probation")
    ] = True,
) -> Any:
    result = await supervisor.restart(config, wait=wait, probation=probation)
    if wait:
        return JSONResponse(Outcome(**result).model_dump(), status_code=200)
    return Accepted(**result)
