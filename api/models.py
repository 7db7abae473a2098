"""Response models and the error body shared by every route."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path, Query
from pydantic import BaseModel, Field, StringConstraints

from gpuwarden.daemon.configs import NAME_RE

CONFIG_NAME = NAME_RE.pattern
# A config name, as a path segment or a query value (the schema carries the pattern).
ConfigName = Annotated[str, Path(pattern=CONFIG_NAME, description="a config name")]
ConfigQuery = Annotated[
    str | None, Query(pattern=CONFIG_NAME, description="a config name (configs/NAME.yaml)")
]
ConfigItem = Annotated[str, StringConstraints(pattern=CONFIG_NAME)]
DumpName = Annotated[str, Path(pattern=r"^[0-9]{8}T[0-9]{6}-[a-z_]+(-[0-9]+)?$")]
SweepId = Annotated[str, Path(pattern=r"^sweep-[0-9]{8}T[0-9]{6}(\.[0-9]+)?$")]


class ErrorBody(BaseModel):
    error: str = Field(description="a short machine-readable name")
    detail: Any = Field(description="what went wrong, for a person")
    problems: list[str] | None = Field(None, description="every preflight problem (422)")
    warnings: list[str] | None = Field(None, description="preflight warnings (422)")


class Accepted(BaseModel):
    accepted: bool = True
    state: str
    config: str | None = None
    swap_id: str | None = None
    grace_s: float | None = None  # a stop's: SIGKILL comes this long after SIGTERM


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI declarations for error responses."""
    words = {
        400: "bad input",
        401: "no or bad token",
        403: "a Host or Origin that is not this daemon's",
        404: "unknown config",
        405: "wrong method",
        409: "a conflicting operation is under way",
        413: "the request body is too large",
        422: "invalid config or request",
        500: "a file the daemon keeps cannot be read (not a regular file, or too large)",
        503: "not ready",
    }
    # The explicit JSON content: on a text route FastAPI would declare the model as text/plain.
    return {
        c: {
            "model": ErrorBody,
            "description": words.get(c, "error"),
            "content": {"application/json": {}},
        }
        for c in codes
    }
