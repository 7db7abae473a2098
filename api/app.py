"""The control plane: `create_app(supervisor, settings)` builds the FastAPI app.

No module-level app or settings. Handlers read the supervisor's snapshots or send it requests;
none of them mutates state.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpuwarden.api import (
    routes_chat,
    routes_configs,
    routes_control,
    routes_events,
    routes_logs,
    routes_status,
    routes_sweeps,
    routes_ui,
)
from gpuwarden.api.auth import TokenFile, bearer
from gpuwarden.api.guard import Guard, policy_for
from gpuwarden.api.models import errors
from gpuwarden.daemon import errors as refusals
from gpuwarden.daemon.errors import CommandError
from gpuwarden.daemon.logring import LogFeed
from gpuwarden.daemon.settings import Settings
from gpuwarden.daemon.supervisor import Supervisor
from gpuwarden.daemon.sweep import SweepManager

# The core refuses by kind; this is the one place a kind becomes an HTTP status.
HTTP_STATUS = {
    refusals.BAD_REQUEST: 400,
    refusals.NOT_FOUND: 404,
    refusals.CONFLICT: 409,
    refusals.INVALID_CONFIG: 422,
    refusals.PREFLIGHT_REFUSED: 422,
    refusals.UNREADABLE: 500,
}


def create_app(supervisor: Supervisor, settings: Settings) -> FastAPI:
    app = FastAPI(
        title="gpuwarden",
        summary="Supervises an SGLang inference server on a GPU host.",
        version="0.1.0",
        # /docs is served by routes_ui with its assets from this daemon, never from a CDN.
        docs_url=None,
        redoc_url=None,
    )
    app.state.supervisor = supervisor
    app.state.settings = settings
    # The token file, read again whenever it changes (a rotation needs no restart).
    app.state.token = TokenFile(settings.token_file) if settings.token_file else None
    # One listener on the capture path for every /logs/stream client: it only says "more".
    app.state.log_feed = LogFeed()
    supervisor.line_listeners.add(app.state.log_feed.notify)
    app.state.metrics = None  # the metrics (api/metrics.py), made on the first scrape
    app.state.sweeps = SweepManager(supervisor)
    supervisor.attach_sweeps(app.state.sweeps)
    # The guard checks Host, Origin, the token and the body's size before any body is read.
    app.add_middleware(Guard, policy=policy_for(settings, app.state.token))
    # The bearer dependency only declares the scheme in the OpenAPI (the guard enforces it);
    # with no token_file there is no auth, and the OpenAPI says so.
    guarded = [Depends(bearer)] if app.state.token is not None else []
    app.include_router(routes_status.public, responses=errors(413))
    # /chat may authenticate from its body (a form's verification token): the guard lets it
    # through without a bearer, its body bounded, and the route decides.
    app.include_router(routes_chat.public, responses=errors(403, 413))
    # The dashboard's shell and assets, and the docs: the guard decides which need the token.
    app.include_router(routes_ui.router, responses=errors(413))
    for module in (
        routes_status,
        routes_control,
        routes_configs,
        routes_logs,
        routes_events,
        routes_chat,
        routes_sweeps,
    ):
        app.include_router(module.router, dependencies=guarded, responses=errors(403, 413))

    @app.exception_handler(CommandError)
    async def command_error(request: Request, exc: CommandError) -> JSONResponse:
        return JSONResponse(
            {**error_body(exc.error, exc.detail), **exc.extra}, status_code=HTTP_STATUS[exc.error]
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # The methods the OpenAPI documents for this path (Starlette names only the first
            # matching route's, and adds HEAD to every GET on its own).
            allowed = ", ".join(sorted(documented_methods(request.app, request.url.path)))
            headers = {k: v for k, v in headers.items() if k.lower() != "allow"}
            headers["Allow"] = allowed
            detail = f"{request.method} {request.url.path} is not allowed; use {allowed}"
            return JSONResponse(error_body("method_not_allowed", detail), 405, headers=headers)
        name = {404: "not_found", 401: "unauthorized"}.get(exc.status_code, "error")
        return JSONResponse(error_body(name, exc.detail), exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        return JSONResponse(error_body("bad_request", problems), status_code=400)

    return app


def documented_methods(app: FastAPI, path: str) -> set[str]:
    table: list[tuple[re.Pattern[str], set[str]]] | None = getattr(app.state, "paths", None)
    if table is None:
        table = [
            (re.compile("^" + re.sub(r"\{[^/]+\}", "[^/]+", p) + "$"), {m.upper() for m in ops})
            for p, ops in app.openapi()["paths"].items()
        ]
        app.state.paths = table
    return {m for rx, methods in table if rx.match(path) for m in methods}


def error_body(error: str, detail: Any) -> dict[str, Any]:
    return {"error": error, "detail": detail}
