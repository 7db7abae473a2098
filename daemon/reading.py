"""Configs read for a command, off the owner's loop (parsing a large or hostile file must not
stall probes, timers, the API or the watchdog; the reader's limits bound how long it takes),
and turned into the refusals the core answers with."""

from __future__ import annotations

import asyncio

from . import errors
from .configs import ConfigError, ConfigStore
from .errors import CommandError
from .preflight import PreflightResult
from .resolvedconfig import ResolvedConfig


async def resolve(configs: ConfigStore, name: str | None) -> ResolvedConfig:
    if not name:
        detail = "no config given, none running and no default_config set"
        raise CommandError(errors.BAD_REQUEST, detail)
    try:
        return await asyncio.to_thread(configs.load, name)
    except ConfigError as exc:
        raise errors.config_refusal(exc) from exc


async def for_command(
    configs: ConfigStore, name: str | None
) -> tuple[ResolvedConfig | None, PreflightResult]:
    """(config, ok) or, for a config that does not load, (None, a failed preflight) — a start
    records that as `failed`; no config named, an unknown or bad name raise."""
    try:
        return await resolve(configs, name), PreflightResult(ok=True)
    except CommandError as exc:
        if exc.error != errors.INVALID_CONFIG:
            raise
        return None, PreflightResult(ok=False, problems=[exc.detail])


async def quietly(
    configs: ConfigStore, name: str | None, have: ResolvedConfig | None
) -> ResolvedConfig | None:
    """A config a swap may roll back to, read ahead (None where it does not load)."""
    if not name:
        return None
    if have is not None and have.name == name:
        return have
    try:
        return await asyncio.to_thread(configs.load, name)
    except ConfigError:
        return None
