"""Response models and the error body shared by every route."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


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


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI declarations for error responses."""
    words = {
        400: "bad input",
        401: "no or bad token",
        404: "unknown config",
        405: "wrong method",
        409: "a conflicting operation is under way",
        422: "invalid config or request",
    }
    return {c: {"model": ErrorBody, "description": words.get(c, "error")} for c in codes}
