"""The daemon the CLI talks to: where it is, the token it wants, and one request to it.

The daemon is ``--url``, else ``$GPUWARDEN_URL``, else the ``listen`` address of
``--settings``, else the default; the token is read from ``--token-file``, else
``$GPUWARDEN_TOKEN``, else the ``token_file`` of ``--settings``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from .parsers import DEFAULT_URL
from .transport import Client, ConnectFailed, Response, TransportError


class ClientError(Exception):
    """A command that failed: the one line the CLI prints."""


def _daemon_settings(args: argparse.Namespace) -> Any:
    from gpuwarden.daemon.settings import SettingsError, load_settings  # noqa: PLC0415

    try:
        return load_settings(args.settings)
    except SettingsError as exc:
        raise ClientError(str(exc)) from exc


def resolve_target(args: argparse.Namespace) -> None:
    """Fill in args.url and args.token_file: the flags, else the environment, else the
    daemon's own settings (--settings), else the defaults."""
    settings = None
    if args.url is None:
        args.url = os.environ.get("GPUWARDEN_URL")
    if args.url is None and args.settings is not None:
        settings = _daemon_settings(args)
        host, port = settings.listen_host_port
        host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
        args.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    if args.url is None:
        args.url = DEFAULT_URL
    if args.token_file is None and "GPUWARDEN_TOKEN" not in os.environ and args.settings:
        settings = settings or _daemon_settings(args)
        args.token_file = settings.token_file


def connect(args: argparse.Namespace, timeout: float | None = 30.0) -> Client:
    """A client for the daemon at args.url, with the token (resolve_target first)."""
    token = os.environ.get("GPUWARDEN_TOKEN")
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            raise ClientError(f"{args.token_file}: {exc.strerror}") from exc
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return Client(args.url, headers, timeout)


def call(
    args: argparse.Namespace,
    method: str,
    path: str,
    *,
    ok: tuple[int, ...] = (200, 202),
    timeout: float | None = 30.0,
    **kw: Any,
) -> Response:
    """One request; a failure, or a status not in `ok`, as a one-line ClientError."""
    try:
        res = connect(args, timeout).request(method, path, **kw)
    except ConnectFailed as exc:
        raise ClientError(f"cannot reach the daemon at {args.url}: {exc}") from exc
    except TransportError as exc:
        raise ClientError(f"{method} {path}: {exc}") from exc
    if res.status_code not in ok:
        try:
            body = res.json()
            detail = body.get("detail")
            reason = f"{body.get('error', res.status_code)}: {detail}"
        except ValueError:
            reason = f"{res.status_code} {res.text[:200]}"
        raise ClientError(reason)
    return res
