"""Dependencies shared by the routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from gpuwarden.daemon.settings import Settings
from gpuwarden.daemon.supervisor import Supervisor


def get_supervisor(request: Request) -> Supervisor:
    sup: Supervisor = request.app.state.supervisor
    return sup


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


SupervisorDep = Annotated[Supervisor, Depends(get_supervisor)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
