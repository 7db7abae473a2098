"""The dashboard (`/ui`) and the API's own docs (`/docs`), with every asset served here.

An air-gapped GPU host has no CDN: the dashboard is plain HTML, CSS and JavaScript shipped in
this package (`api/ui/`), and Swagger UI's bundle comes from the `fastapi-offline` package's
files. There is no `/redoc`: ReDoc's bundle loads its logo from a CDN whatever it is told.
The dashboard's shell and these assets hold no data, so the guard serves them without the
token (`guard.TOKEN_FREE`); every request the page makes for data carries it.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter
from fastapi import Path as PathParam
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse, Response

from gpuwarden.api.models import errors

router = APIRouter(tags=["ui"])

UI_ASSETS = {
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
DOCS_ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon.png": "image/png",
}
# The page talks to this daemon only; images are the sweep charts, fetched with the token and
# shown from blob: URLs. No inline script or style, nothing from elsewhere.
UI_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
# The shell and its assets change with the package: always revalidated, never stale.
NO_CACHE = {"Cache-Control": "no-cache"}
AssetName = Annotated[str, PathParam(pattern=r"^[a-z0-9.-]+$")]


def _ui_file(name: str) -> bytes:
    return (resources.files("gpuwarden.api.ui") / name).read_bytes()


@cache
def docs_assets_dir() -> Path:
    """fastapi-offline's static folder, found without importing the package."""
    spec = importlib.util.find_spec("fastapi_offline")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the fastapi-offline package (its Swagger UI files) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "static"


def _not_found(name: str) -> Response:
    return Response(
        f'{{"error": "not_found", "detail": "no asset {name!r}"}}',
        status_code=404,
        media_type="application/json",
    )


@router.get(
    "/ui",
    summary="The dashboard (HTML; no data in it, no auth; its requests carry the token)",
    response_class=HTMLResponse,
    responses={**errors(403), 200: {"content": {"text/html": {}}}},
)
async def ui() -> HTMLResponse:
    headers = {**NO_CACHE, "Content-Security-Policy": UI_CSP, "Referrer-Policy": "no-referrer"}
    return HTMLResponse(_ui_file("index.html"), headers=headers)


@router.get("/ui/{name}", include_in_schema=False)
async def ui_asset(name: AssetName) -> Response:
    media = UI_ASSETS.get(name)
    if media is None:
        return _not_found(name)
    return Response(_ui_file(name), media_type=media, headers=NO_CACHE)


@router.get("/docs/assets/{name}", include_in_schema=False)
async def docs_asset(name: AssetName) -> Response:
    media = DOCS_ASSETS.get(name)
    if media is None:
        return _not_found(name)
    return FileResponse(docs_assets_dir() / name, media_type=media)


@router.get("/docs", include_in_schema=False)
async def docs() -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="gpuwarden - Swagger UI",
        swagger_js_url="/docs/assets/swagger-ui-bundle.js",
        swagger_css_url="/docs/assets/swagger-ui.css",
        swagger_favicon_url="/docs/assets/favicon.png",
        oauth2_redirect_url="/docs/oauth2-redirect",
        # Swagger UI's validator badge is an image from validator.swagger.io: none.
        swagger_ui_parameters={"validatorUrl": None},
    )


@router.get("/docs/oauth2-redirect", include_in_schema=False)
async def docs_oauth2_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()
