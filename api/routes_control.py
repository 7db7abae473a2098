"""Lifecycle commands: start, stop, restart (a swap when it names another config)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from gpuwarden.api.deps import SupervisorDep
from gpuwarden.api.models import Accepted, errors

router = APIRouter(tags=["control"])
ConfigParam = Annotated[str | None, Query(description="a config name (configs/NAME.yaml)")]


@router.post(
    "/start",
    status_code=202,
    summary="Start a config (409 while a server runs: swap with restart)",
    responses=errors(400, 404, 409, 422),
)
async def start(supervisor: SupervisorDep, config: ConfigParam = None) -> Accepted:
    return Accepted(**await supervisor.start(config))


@router.post(
    "/stop",
    status_code=202,
    summary="Stop the server and leave it stopped; always wins over a start, swap or sweep",
    responses=errors(),
)
async def stop(supervisor: SupervisorDep) -> Accepted:
    return Accepted(**await supervisor.stop())


@router.post(
    "/restart",
    status_code=202,
    summary="Restart the current config, or swap to another one",
    responses=errors(400, 404, 409, 422),
)
async def restart(supervisor: SupervisorDep, config: ConfigParam = None) -> Accepted:
    return Accepted(**await supervisor.restart(config))
