"""Dependencies shared by the routers.

Coroutines, though they never wait: FastAPI runs a plain function dependency on its thread
pool, and under load (a flood of the server's output keeping the loop busy) that hop made each
request wait for the GIL, a switch interval (5 ms) at a time.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from gpuwarden.daemon.settings import Settings
from gpuwarden.daemon.supervisor import Supervisor


async def get_supervisor(request: Request) -> Supervisor:
    sup: Supervisor = request.app.state.supervisor
    return sup


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


SupervisorDep = Annotated[Supervisor, Depends(get_supervisor)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
