"""Bearer-token auth: with `token_file` set, every route but the probes needs the token.

The guard (api/guard.py) enforces it before any body is read; `bearer` only declares the scheme
in the OpenAPI.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from fastapi.security import HTTPBearer

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
