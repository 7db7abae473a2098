"""The stand-in's HTTP app: its routes, behind SGLang's API-key middleware when a key is set.

`build_app` puts together the info routes and the generation routes the chosen version serves
in one Starlette app; with ``--api-key`` every route but ``/health*`` and ``/metrics*`` asks for
``Authorization: Bearer <key>``, as SGLang's add_api_key_middleware does. Imported only when the
server is about to serve: Starlette is a heavy import for the main process's start.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .routes_generate import generate_routes
from .routes_info import info_routes

if TYPE_CHECKING:
    from .server import StandinServer


def build_app(server: StandinServer) -> Starlette:
    routes = info_routes(server) + generate_routes(server)
    middleware = []
    api_key = server.args.api_key
    if api_key:

        async def check_api_key(
            request: Request, call_next: Callable[[Request], Awaitable[Response]]
        ) -> Response:
            # add_api_key_middleware: /health* and /metrics* are exempt.
            if request.url.path.startswith(("/health", "/metrics")):
                return await call_next(request)
            if request.headers.get("Authorization") != f"Bearer {api_key}":
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return await call_next(request)

        middleware.append(Middleware(BaseHTTPMiddleware, dispatch=check_api_key))
    app = Starlette(routes=routes, middleware=middleware)
    return app
