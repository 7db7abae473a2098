"""Named configs: list, view (resolved, secrets masked), preflight check."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from gpuwarden.api.deps import SupervisorDep
from gpuwarden.api.models import ConfigName, errors
from gpuwarden.daemon.configs import ConfigError
from gpuwarden.daemon.errors import config_refusal

router = APIRouter(tags=["configs"])


class ConfigList(BaseModel):
    configs: list[str]
    current: str | None
    last_good: str | None


class CheckResult(BaseModel):
    ok: bool
    problems: list[str] = []
    warnings: list[str] = []
    method: str = ""


@router.get("/configs", summary="Config names", responses=errors(401))
async def list_configs(supervisor: SupervisorDep) -> ConfigList:
    return ConfigList(
        configs=supervisor.configs.names(),
        current=supervisor.snapshot().intent_config,
        last_good=supervisor.snapshot().last_good_config,
    )


@router.get(
    "/configs/{name}",
    summary="One config resolved (extends applied), with its argv; secrets masked",
    responses=errors(400, 401, 404, 422),
)
async def get_config(name: ConfigName, supervisor: SupervisorDep) -> dict[str, Any]:
    try:
        # Off the loop: a large config must not stall the daemon while it is parsed.
        return (await asyncio.to_thread(supervisor.configs.load, name)).view()
    except ConfigError as exc:
        raise config_refusal(exc) from exc


@router.post(
    "/configs/{name}/check",
    summary="The preflight, without touching the running server",
    responses={**errors(400, 401, 404), 422: {"model": CheckResult, "description": "refused"}},
)
async def check_config(name: ConfigName, supervisor: SupervisorDep) -> Any:
    result = await supervisor.check(name)
    body = CheckResult(**result.to_json())
    if not result.ok:
        return JSONResponse(body.model_dump(), status_code=422)
    return body
