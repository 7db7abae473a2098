"""Slack's request signing: `X-Slack-Signature` is `v0=` and the hex HMAC-SHA256, keyed with
the app's signing secret, of `v0:{X-Slack-Request-Timestamp}:{the raw body}`; a timestamp more
than five minutes from now is refused, so a request captured earlier cannot be replayed later.
"""

from __future__ import annotations

import hashlib
import hmac
import time

WINDOW_S = 300  # Slack's own advice: five minutes either way


def signature(secret: str, timestamp: str, body: bytes) -> str:
    base = b"v0:" + timestamp.encode() + b":" + body
    return "v0=" + hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()


def check(
    secret: str, timestamp: str | None, given: str | None, body: bytes, now: float | None = None
) -> str | None:
    """None when the request is signed with `secret` within the window; else why not."""
    if not given or not timestamp:
        return "no X-Slack-Signature and X-Slack-Request-Timestamp"
    try:
        ts = int(timestamp)
    except ValueError:
        return "X-Slack-Request-Timestamp is not a Unix time"
    if abs((time.time() if now is None else now) - ts) > WINDOW_S:
        return f"X-Slack-Request-Timestamp is more than {WINDOW_S} s from now (stale or replayed)"
    if not hmac.compare_digest(signature(secret, timestamp, body).encode(), given.encode()):
        return "X-Slack-Signature does not match the body"
    return None
