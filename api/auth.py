"""Bearer-token auth: with `token_file` set, every route but the probes needs the token.

The guard (api/guard.py) enforces it before any body is read; `bearer` only declares the scheme
in the OpenAPI. The file is read again whenever it changes (a stat per request), so a rotated
token takes effect without a restart; a new file that cannot be read keeps the old token.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from fastapi.security import HTTPBearer

from gpuwarden.daemon import logsetup
from gpuwarden.daemon.safefile import read_regular_text

bearer = HTTPBearer(auto_error=False, description="the token in `token_file`")
log = logsetup.get_logger("gpuwarden.api")
TOKEN_MAX_BYTES = 64 * 1024

Stamp = tuple[int, int, int, int] | None  # None: no such file


def read_token(path: Path | None) -> str | None:
    if path is None:
        return None
    # Bounded and regular-only: a token file is one line, never a FIFO to block on.
    token = read_regular_text(path, TOKEN_MAX_BYTES).strip()
    if not token:
        raise ValueError(f"{path}: the token file is empty")
    return token


def _stamp(path: Path) -> Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)


class TokenFile:
    """The token in `path`: read at start (an error then is the daemon's), and again whenever
    the file's stat changes. A changed file that cannot be read (gone, empty, not a regular
    file, too big) keeps the token that was in force, with one warning per change: a botched
    rotation must not lock every client out."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen = _stamp(path)  # the file's stat when last read or refused
        token = read_token(path)
        assert token is not None
        self._token = token

    def current(self) -> str:
        stamp = _stamp(self.path)
        if stamp == self._seen:
            return self._token
        self._seen = stamp
        try:
            token = read_token(self.path)
        except (OSError, ValueError) as exc:
            log.warning(
                "api.token_unreadable",
                path=str(self.path),
                detail=f"{exc}; the previous token stays in force",
            )
            return self._token
        assert token is not None
        self._token = token
        return token


def token_matches(expected: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())


def bearer_of(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (the scheme in any case, as
    RFC 9110 has it); None for any other header."""
    scheme, _, given = (authorization or "").partition(" ")
    return given if scheme.lower() == "bearer" else None
