"""Bearer-token auth: with `token_file` set, every route but /healthz needs the token."""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from gpuwarden.daemon.safefile import read_regular_text

bearer = HTTPBearer(auto_error=False, description="the token in `token_file`")


def read_token(path: Path | None) -> str | None:
    if path is None:
        return None
    # Bounded and regular-only: a token file is one line, never a FIFO to block on.
    token = read_regular_text(path, 64 * 1024).strip()
    if not token:
        raise ValueError(f"{path}: the token file is empty")
    return token


def token_matches(expected: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())


async def require_token(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> None:
    expected: str | None = request.app.state.token
    if expected is None:
        return
    if credentials is None or not token_matches(expected, credentials.credentials):
        raise HTTPException(
            status_code=401,
            detail="missing or wrong bearer token (Authorization: Bearer <token>)",
            headers={"WWW-Authenticate": "Bearer"},
        )
