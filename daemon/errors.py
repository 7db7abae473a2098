"""Refusals of the core, by kind. The control plane maps each kind to an HTTP status once
(`api/app.py`); nothing here knows about HTTP."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .configs import ConfigError

# The kinds a command can be refused with.
BAD_REQUEST = "bad_request"  # nothing to act on (no config named, none running, no default)
NOT_FOUND = "not_found"
CONFLICT = "conflict"  # another operation is under way, or a stop was asked for after this
INVALID_CONFIG = "invalid_config"  # the config does not load
PREFLIGHT_REFUSED = "preflight_refused"  # it loads, but would not start here
UNREADABLE = "unreadable"  # a file the daemon keeps is not a regular file, or is over its limit


class CommandError(Exception):
    """A command the supervisor refuses: `error` is its kind, `detail` says why."""

    def __init__(self, error: str, detail: str, extra: dict[str, Any] | None = None) -> None:
        super().__init__(detail)
        self.error = error
        self.detail = detail
        self.extra = extra or {}


def config_refusal(exc: ConfigError) -> CommandError:
    """A config that cannot be used, as a refusal of the command that named it."""
    return CommandError(exc.kind, str(exc))
