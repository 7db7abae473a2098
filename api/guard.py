"""The control plane's gate: a pure ASGI middleware that decides before any body is read.

In order: the `Host` must name this daemon (a page on another site cannot read `/dump` through
DNS rebinding); a state-changing request must not come from another origin (a page cannot
`POST /stop` cross-site); the bearer token; the body's size, as declared and as it streams in.
FastAPI's own auth is a dependency, run only after the body has been read, and its
`max_body_size` answers in plain text, outside any middleware of ours: hence this one.

A refusal is the JSON error body of every other error and closes the connection, since the
body it did not read may still be on its way.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpuwarden.api.auth import TokenFile, bearer_of, token_matches
from gpuwarden.daemon.settings import Settings

# Container and Kubernetes probes name the pod's address, which no setting can know.
PROBES = frozenset({"/healthz", "/readyz"})
# The dashboard's shell and the docs' bundles hold no data: a browser loads them without the
# token, and the page then sends it with every request for data (routes_ui.py).
TOKEN_FREE = frozenset({"/ui"})
TOKEN_FREE_PREFIXES = ("/ui/", "/docs/assets/")
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


@dataclass(frozen=True)
class GuardPolicy:
    token: TokenFile | None
    listen_host: str
    allowed_hosts: tuple[str, ...]
    max_body_bytes: int
    # Routes that can authenticate from their body (/chat: a form's verification token, or a
    # Slack signature over the body): with no valid bearer they still get their body, bounded
    # like every other.
    body_auth_paths: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Refusal:
    status: int
    error: str
    detail: str
    headers: tuple[tuple[bytes, bytes], ...] = ()


class Guard:
    def __init__(self, app: ASGIApp, policy: GuardPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope, Headers(scope=scope))
        if refusal is not None:
            await send_error(send, refusal)
            return
        await self.bounded(scope, receive, send)

    def refusal(self, scope: Scope, headers: Headers) -> Refusal | None:
        policy = self.policy
        path: str = scope["path"]
        host = headers.get("host")
        # A request without Host is HTTP/1.0 and no browser's: nothing to rebind.
        if path not in PROBES and host is not None and not self.host_allowed(host):
            return Refusal(
                403,
                "forbidden",
                f"Host {host!r} does not name this daemon: use a loopback name or the listen "
                "address, or add it to allowed_hosts",
            )
        if scope["method"] in STATE_CHANGING:
            origin = headers.get("origin")
            if origin is not None and not same_origin(origin, host):
                return Refusal(403, "forbidden", f"a request from another origin ({origin})")
            if headers.get("sec-fetch-site") == "cross-site":
                return Refusal(403, "forbidden", "a cross-site request (Sec-Fetch-Site)")
        if (
            policy.token is not None
            and path not in PROBES
            and path not in policy.body_auth_paths
            and not token_free(path)
            and not bearer_matches(policy.token.current(), headers.get("authorization"))
        ):
            return Refusal(
                401,
                "unauthorized",
                "missing or wrong bearer token (Authorization: Bearer <token>)",
                ((b"www-authenticate", b"Bearer"),),
            )
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > policy.max_body_bytes:
            return too_large(policy.max_body_bytes)
        return None

    def host_allowed(self, value: str) -> bool:
        name, _ = split_host(value)
        if is_loopback(name) or name == self.policy.listen_host:
            return True
        for allowed in self.policy.allowed_hosts:
            if allowed in ("*", name) or (allowed[:2] == "*." and name.endswith(allowed[1:])):
                return True
        return False

    async def bounded(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app, with a body that stops at max_body_bytes (a chunked body declares no
        length); past it the client gets 413 and the app a disconnect."""
        limit = self.policy.max_body_bytes
        seen = 0
        started = answered = False

        async def receive_bounded() -> Message:
            nonlocal seen, answered
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    if not started and not answered:
                        answered = True
                        await send_error(send, too_large(limit))
                    return {"type": "http.disconnect"}
            return message

        async def send_unless_answered(message: Message) -> None:
            nonlocal started
            if answered:  # the client has its 413; what the app says after is dropped
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        # A client that left, was timed out or was cut off mid-body: nobody to answer.
        with contextlib.suppress(ClientDisconnect):
            await self.app(scope, receive_bounded, send_unless_answered)


def token_free(path: str) -> bool:
    return path in TOKEN_FREE or path.startswith(TOKEN_FREE_PREFIXES)


def too_large(limit: int) -> Refusal:
    return Refusal(413, "body_too_large", f"the request body exceeds {limit} bytes")


async def send_error(send: Send, no: Refusal) -> None:
    body = json.dumps({"error": no.error, "detail": no.detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *no.headers,
    ]
    await send({"type": "http.response.start", "status": no.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def bearer_matches(expected: str, authorization: str | None) -> bool:
    return token_matches(expected, bearer_of(authorization))


def is_loopback(name: str) -> bool:
    """localhost, 127.0.0.0/8 or ::1 (a name other than localhost may resolve anywhere)."""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def split_host(value: str) -> tuple[str, int | None]:
    """'Example.COM:8600' -> ('example.com', 8600); '[::1]' -> ('::1', None)."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
    else:
        name, port = value, ""
    return name.rstrip("."), int(port) if port.isdigit() else None


def same_origin(origin: str, host: str | None) -> bool:
    """The Origin is the daemon's own: its host and port are the request's Host. `null` (a
    sandboxed page, a file:// one) never is."""
    try:
        parts = urlsplit(origin)
        origin_port = parts.port
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.hostname or host is None:
        return False
    default = 443 if parts.scheme == "https" else 80
    name, port = split_host(host)
    # A Host without a port (a proxy in front) means the origin scheme's default port.
    return parts.hostname.rstrip(".") == name and (origin_port or default) == (port or default)


def policy_for(settings: Settings, token: TokenFile | None) -> GuardPolicy:
    return GuardPolicy(
        token=token,
        listen_host=settings.listen_host_port[0].lower(),
        allowed_hosts=tuple(settings.allowed_hosts),
        max_body_bytes=settings.http.max_body_bytes,
        body_auth_paths=frozenset({"/chat"})
        if settings.chat.verification_token is not None or settings.chat.signing_secret is not None
        else frozenset(),
    )
